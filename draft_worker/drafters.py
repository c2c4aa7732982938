"""Drafters: propose k tokens given a session's context.

One small interface: `start(params)` returns a per-session state whose `propose(context, k)`
returns a Draft, a chain or, within a budget, a token tree. The model drafter (draft_worker/model.py)
keeps a KV cache per session and rolls it back to the longest prefix it shares with the new
context; the n-gram drafter needs no model at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.kvpool import proposal_room
from tandem.speculation import tree
from tandem.speculation.drafting import Drawn
from tandem.speculation.grammar import Matcher
from tandem.speculation.ngram import lookup, lookup_tree
from tandem.speculation.sampling import SamplingParams
from tandem.speculation.tree import TreeBudget


@dataclass(frozen=True)
class Draft:
    tokens: list[int]                          # k proposed token ids
    support: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # per proposed position: (ids [m] int64, probs [m] float32) of q, when sampled; None when the
    # proposal is greedy or deterministic
    kind: int | None = None                    # proposals of one kind share an acceptance record:
                                               # the n-gram drafter's match length; None: one for all
    forced: int = 0                            # leading tokens a guide forces (jump-forward), not drafted
    drawn: list[Drawn] | None = None           # a model's greedy draft: per token, its q and the second choice
    parents: list[int] | None = None           # a token tree's (tandem/speculation/tree.py), main line
                                               # first; None: a chain

    def prefix(self, n: int) -> Draft:
        return Draft(self.tokens[:n], self.support[:n] if self.support is not None else None, self.kind,
                     min(self.forced, n), self.drawn[:n] if self.drawn is not None else None,
                     self.parents[:n] if self.parents is not None else None)

    @property
    def line(self) -> int:
        """The main line's length: the leading tokens that follow one another."""
        if self.parents is None:
            return len(self.tokens)
        return next((j for j, p in enumerate(self.parents) if p != j - 1), len(self.parents))

    def off_line(self, accepted: int, committed) -> bool:
        """Whether a verdict that accepted `accepted` tokens (the first of `committed`) left the main line."""
        return accepted > self.line or list(committed[:accepted]) != self.tokens[:accepted]

    def depth(self, n: int) -> int:
        """The deepest of the first n tokens (n itself for a chain)."""
        return max(tree.depths(self.parents[:n]), default=0) if self.parents is not None else n

    def fit_line(self, n: int) -> Draft:
        """The first n tokens of the main line and the branches off them."""
        if self.parents is None or n <= 0:
            return self.prefix(n)
        if n >= self.line:
            return self
        keep, place = [], {}
        for j, p in enumerate(self.parents):
            if j < n or j >= self.line and (p < n if p < self.line else p in place):
                place[j] = len(keep)
                keep.append(j)
        parents = [place.get(self.parents[j], -1) for j in keep]
        drawn = [self.drawn[j] for j in keep] if self.drawn is not None else None
        return Draft([self.tokens[j] for j in keep], None, self.kind, 0, drawn,
                     parents if any(p != i - 1 for i, p in enumerate(parents)) else None)


class DraftState(Protocol):
    """One session's drafting. An `inline` state proposes with propose() on the event loop (no
    torch, cheaper than a thread hop); any other proposes with propose_batched() through the
    worker's batcher, sharing forward passes with other sessions, or with propose() on the
    inference thread when the worker batches nothing."""
    inline: bool
    # budget: propose a token tree within it (Draft.parents) where the drafter has alternatives;
    # None: a chain. steps: at most this many of the drafter's forward passes (0: as many as k
    # takes); a drafter without steps proposes all it can at once and ignores it
    def propose(self, context: list[int], k: int, budget: TreeBudget | None = None, steps: int = 0) -> Draft: ...
    async def propose_batched(self, batcher, context: list[int], k: int,
                              budget: TreeBudget | None = None, steps: int = 0) -> Draft: ...
    def kv_bytes(self) -> int: ...
    def close(self) -> None: ...


class Drafter(Protocol):
    name: str
    # A draft model: its vocabulary must be the target's; streamed, it drafts a token a step (any
    # other drafter proposes as far as it can at once).
    uses_model: bool
    # grammar: the guide's matcher at the context propose() will be given; a drafter that takes it
    # drafts under its mask (and leaves it as it found it), any other is cut by the caller.
    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int,
              room: int = proposal_room(), grammar: Matcher | None = None) -> DraftState: ...


class NgramDrafter:
    """Prompt lookup (tandem.speculation.ngram): what followed the latest earlier occurrence of the
    context's last n tokens (n = max_ngram down to min_ngram)."""

    name = "ngram"
    uses_model = False
    inline = True        # a list search, no torch

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int,
              room: int = proposal_room(), grammar: Matcher | None = None) -> DraftState:
        return self

    def propose(self, context: list[int], k: int, budget: TreeBudget | None = None, steps: int = 0) -> Draft:
        """What followed the latest occurrence; with a budget, what followed other occurrences too,
        where it differs, as branches (tandem.speculation.ngram.lookup_tree)."""
        if budget is None:
            follow, n = lookup(context, k, self.max_ngram, self.min_ngram)
            return Draft(follow, kind=n) if follow else Draft([])
        follow, parents, n = lookup_tree(context, k, budget.nodes, budget.branches, budget.at_least,
                                         self.max_ngram, self.min_ngram)
        return Draft(follow, kind=n, parents=parents) if follow else Draft([])

    async def propose_batched(self, batcher, context: list[int], k: int, budget: TreeBudget | None = None,
                              steps: int = 0) -> Draft:
        return self.propose(context, k, budget)

    def kv_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

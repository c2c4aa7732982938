"""Speculation with a trained head beside the target: the verify worker proposes to itself.

The head reads the target's hidden states for every position the target processes, so it runs
where they are made. A session's rounds go through the worker's batcher like any other: the
round's step feeds [last committed token] + the head's proposal and asks for the tapped states;
its follow-up, on the inference thread right after the pass, judges the proposal, hands the
states of the committed positions to the head's context, and drafts the next proposal at once,
so a round costs one pass plus one head pass and no network hop.

How many drafted positions a round verifies follows the head's confidence (see
tandem.head.drafter.choose_k): greedy requests weigh it against the worker's calibrated pass-cost
curve, and then against the price of the pass the round joins (verify_worker/price.py: a position
stays only while the chance of reaching it beats what it costs the other sessions of the pass, so
under load the head proposes less, and nothing when what it would gain does not pay for its own
next pass, which the other sessions wait for as for so many positions: then that pass is skipped
too, round after round, until the price falls enough for the last proposal's reach to pay for it);
sampled ones use the fixed rule, so that a seed gives the same
output on any worker at any load. When
the head is not confident enough to propose anything, the next 1, 2, 4, then at most MAX_REST
rounds decode plainly without a head pass, and a proposal ends the rest. While the head drafts
nothing, the committed positions' states are held back and join its context in one call when it
drafts again or HELD_ROWS of them wait, instead of one call of the head's layers every round.

A greedy session copies a prompt prefix from another head session (live, or kept for a next turn)
whose context covers it: the target's KV and the head's context rows together (share_prefix).

Each draft also looks the context's end up earlier in it (prompt lookup, as n-gram drafting does)
and proposes what followed instead of the head's block when that promises more accepted tokens: by
this session's acceptance of earlier lookups with as long a match, against the head's confidence.
Where answers copy the prompt (extraction, edits, roleplay) lookups win; elsewhere the head does.
The choice reads only what is already decided, so sampled output stays exact and reproducible.

Greedy rounds propose a token tree (--head-tree-leaves, tandem.head.drafter.head_tree): the chain,
the other of the two proposals as a branch where it leaves the chain, and the head's second
choices as leaves, each node only where its chance of being taken pays for its position.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from operator import mul

import torch

from tandem.engine.batcher import Step
from tandem.head.drafter import (HeadContext, HeadDraft, HeadDrafter, HeadTree, choose_k, head_tree, pays_for_head_pass,
                                 worth_its_price)
from tandem.head.model import state_indices
from tandem.service import metrics
from tandem.speculation.drafting import RowDrafter
from tandem.speculation.ngram import lookup
from tandem.speculation.room import plan_k
from tandem.speculation.sampling import make_generator
from tandem.speculation import tree
from tandem.speculation.survival import Survival, position_ms
from tandem.speculation.tree import TreeBudget
from verify_worker.engine import TargetSession, VerdictResult, VerifyEngine

METHOD = "head"
MAX_REST = 8        # most plain rounds in a row after the head proposed nothing
HELD_ROWS = 32      # most committed positions' states held back from a resting head's context
HEAD_TREE_LEAVES = 4   # the verify worker's default --head-tree-leaves
LEAF_DECAY = 0.99      # per round with leaves: how fast older leaves weigh less in leaf_scale


@dataclass
class HeadSession:
    context: HeadContext
    generator: torch.Generator | None
    proposal: HeadDraft | None = None      # the next round's, drafted right after the last verdict
    rest: int = 0                          # plain rounds left before the head drafts again
    backoff: int = 0                       # the length of the last rest
    # this session's prompt-lookup proposals: acceptance through each position, by match length
    lookups: dict[int, Survival] = field(default_factory=dict)
    # greedy, as of its last proposal: the pass's price, and the chance of reaching each position
    price: float = 0.0
    reach: list[float] | None = None
    # committed positions' tapped states not yet in the context, while the head drafts nothing
    held: list[torch.Tensor] = field(default_factory=list)

    def held_rows(self) -> int:
        return sum(f.shape[0] for f in self.held)

    def known(self) -> int:
        """The positions the head has states for: its context and what is held back."""
        return self.context.length + self.held_rows()


class HeadSpeculation:
    """Draft method "head" (an OwnDrafting, verify_worker/rounds.py)."""
    method = METHOD
    span = "head round"
    reads_states = True

    def __init__(self, drafter: HeadDrafter, engine: VerifyEngine, leaves: int = HEAD_TREE_LEAVES) -> None:
        """leaves: greedy rounds propose a tree (head_tree), with up to this many of the head's second
        choices as leaves; 0: chains."""
        self.drafter, self.engine, self.leaves = drafter, engine, leaves
        self.leaves_estimated = self.leaves_taken = 0.0     # see leaf_scale
        self.taps = state_indices(drafter.taps)           # indices into the target's hidden states
        self.draft_ms = 0.0                                # running mean of one head pass
        # greedy, across sessions: the price of the latest pass, and the latest proposal's reach
        self.price, self.reach = 0.0, None

    def open(self, s: TargetSession) -> HeadSession:
        return HeadSession(self.drafter.new_context(s.cache.capacity),
                           None if s.params.greedy else make_generator(s.params.seed, stream=1))

    def prefill_then(self, s: TargetSession, h: HeadSession, report):
        """A prefill chunk's follow-up: the chunk's states join the head's context, then `report`."""
        def then(rows):
            logits, features = rows
            self.drafter.extend(h.context, features)
            return report(logits)
        return then

    def share_prefix(self, s: TargetSession, h: HeadSession, donors: list[TargetSession]) -> None:
        """A prompt prefix from a head session whose context covers it, with its context rows.
        Greedy only: a copied row may differ in its last bits from one computed in another call,
        which may change a proposal, and a seed's draws must not depend on the sessions around."""
        if not s.params.greedy:
            return
        heads = [d for d in donors if isinstance(d.drafting, HeadSession)]
        donor = self.engine.share_prefix(s, heads, upto=lambda d: d.drafting.context.length)
        if donor is not None:
            h.context.copy_prefix(donor.drafting.context, s.cache.length)

    def start(self, s: TargetSession, h: HeadSession) -> None:
        """The first proposal, unless (greedy) the latest proposal of any session would not pay
        for its head pass at the latest price: then the session starts as one whose proposal did
        not pay, and drafts once the price falls enough (HeadSession.price, reach)."""
        if s.params.greedy and self.reach is not None:
            h.price, h.reach = self.price, self.reach
            if not pays_for_head_pass(self.reach, self.price, self._head_positions()):
                return
        self.draft(s, h)

    def propose_seconds(self) -> float:
        return self.draft_ms / 1000

    def draft(self, s: TargetSession, h: HeadSession) -> None:
        """Drafts the next proposal after s's committed tokens (on the inference thread), each
        position through the request's pipeline and guide, as the target's rows will be."""
        self._catch_up(h)                        # not timed: a head pass's price is the pass alone
        start = time.perf_counter()
        rows = RowDrafter(s.tokens, s.prompt_len, s.params, self.engine.model.eos_ids, s.grammar, h.generator,
                          want_prob=bool(self.leaves) and s.params.greedy)
        try:
            head = self.drafter.draft(h.context, s.tokens[-1], self.drafter.config.block_size, rows)
        finally:
            rows.finish()
        h.proposal = self._choose(s, h, head, self._lookup(s, h))
        seconds = time.perf_counter() - start
        metrics.PROPOSE.observe(seconds)
        ms = 1000 * seconds
        self.draft_ms = ms if not self.draft_ms else 0.9 * self.draft_ms + 0.1 * ms

    def _lookup(self, s: TargetSession, h: HeadSession) -> HeadDraft | None:
        """A prompt lookup's proposal (tandem.speculation.ngram), its confidences from this session's
        acceptance of earlier lookups with a match as long. Its tokens are certain: q puts all its
        mass on them."""
        follow, n = lookup(s.tokens, self.engine.max_proposal)
        if not follow:
            return None
        reach = h.lookups.setdefault(n, Survival()).reach(len(follow))
        confidence = [r / before if before else 0.0 for r, before in zip(reach, [1.0, *reach])]
        support = None if s.params.greedy else [(torch.tensor([t]), torch.tensor([1.0])) for t in follow]
        return HeadDraft(follow[:len(reach)], confidence, support, ngram=n)

    def _choose(self, s: TargetSession, h: HeadSession, head: HeadDraft, looked: HeadDraft | None) -> HeadDraft:
        """The head's block or the prompt lookup's, whichever promises more accepted tokens (the
        sum of its reach); a greedy round with trees offers the other as a branch (head_tree)."""
        if looked is None:
            return head
        main, other = ((looked, head) if sum(accumulate(looked.confidence, mul)) > sum(accumulate(head.confidence, mul))
                       else (head, looked))
        if self.leaves and s.params.greedy:
            main.other = other
        return main

    def step(self, s: TargetSession, h: HeadSession, price: float = 0.0, cap: int = 0, k: int | None = None
             ) -> tuple[Step, list[int]]:
        """The round's step, and the tokens it proposes: the drafted block cut to the confident
        part (or to `k` positions), to the request's cap and to the room left. A cut never looks
        at a position's own draw (the confidence of position j reads the tokens before it), so it
        keeps rejection sampling exact; the guide needs no cut, the block was drawn under its mask.
        Greedy, with trees on, the chain becomes a token tree (head_tree)."""
        draft = h.proposal or HeadDraft([], [])
        most = self.engine.max_proposal
        room = plan_k(cap or most, len(s.tokens), s.generated, s.params.max_new_tokens, self.engine.model.max_context,
                      most)
        if k is None:
            curve = self.engine.model.forward_ms if s.params.greedy else []
            k = choose_k(draft.confidence, curve, self.draft_ms)
            if s.params.greedy:
                k = min(k, worth_its_price(draft.confidence, price))
                reach = list(accumulate(draft.confidence, mul))
                if h.proposal is not None:
                    h.reach = self.reach = reach
                h.price = self.price = price
                if not pays_for_head_pass(reach[:k], price, self._head_positions()):
                    k = 0
        k = max(0, min(room, k))
        if h.proposal is not None:
            # Nothing worth proposing: rest the head for a while, longer each time in a row.
            h.backoff = 0 if k else min(MAX_REST, 2 * h.backoff or 1)
            h.rest = h.backoff
        shape = HeadTree.of_chain(draft, k)
        if k and self.leaves and s.params.greedy:
            shape = head_tree(draft, k, room - k, self._node_worth(draft, k, price), self.leaf_scale(), self.leaves)
        proposed = shape.tokens
        support = draft.support[:len(proposed)] if draft.support is not None else None
        then = partial(self._judge, s, h, shape, support)
        return Step(s.cache, [s.tokens[-1], *proposed], None, then, least=1, returns=True, taps=True,
                    tree=None if shape.parents is None else tree.fed(shape.parents)), proposed

    def _node_worth(self, draft: HeadDraft, k: int, price: float):
        """Whether a tree node taken this often pays for its position in the pass (TreeBudget.floor),
        the session's tokens per second being the round's expected tokens over the head pass and a
        verify pass as long as the tree so far, by the calibrated curve."""
        curve = self.engine.model.forward_ms
        expected = 1.0 + sum(accumulate(draft.confidence[:k], mul))

        def worth(value: float, nodes: int) -> bool:
            ms = self.draft_ms + (curve[min(nodes, len(curve) - 1)] if curve else 0.0)
            return value > TreeBudget.floor(price, curve, 1000 * expected / ms if ms > 0 else 0.0)
        return worth

    def leaf_scale(self) -> float:
        """How often the head's second choices were taken against its estimate (head_tree),
        over recent fed leaves, older ones weighing less; 1 before any, as if one leaf's estimate
        had been right."""
        return (self.leaves_taken + 1.0) / (self.leaves_estimated + 1.0)

    def _judge(self, s: TargetSession, h: HeadSession, shape: HeadTree, support, rows) -> VerdictResult:
        logits, features = rows
        vocab = self.engine.model.vocab_size
        proposed = shape.tokens

        def q() -> torch.Tensor | None:
            if support is None:
                return None
            dense = torch.zeros(len(proposed), vocab)
            for i, (ids, probs) in enumerate(support):
                dense[i, ids] = probs
            return dense

        verdict = self.engine.judge_fed(s, proposed, q, logits, shape.parents)
        fed = logits.shape[0] - 1                 # the batcher may have cut the proposal, parents first
        mine = [proposed[i] for i in shape.lookup if i < fed]
        if mine:                                  # how far the lookup's own tokens were accepted
            accepted = [proposed[i] for i in verdict.path]
            h.lookups[shape.ngram].add(len(mine), next((i for i, (a, b) in enumerate(zip(mine, accepted)) if a != b),
                                                       min(len(mine), len(accepted))))
        if shape.parents is not None:
            leaf = bool(verdict.path) and verdict.path[-1] in shape.leaves
            self.leaves_estimated = LEAF_DECAY * self.leaves_estimated + sum(v for i, v in shape.leaves.items() if i < fed)
            self.leaves_taken = LEAF_DECAY * self.leaves_taken + leaf
            metrics.TREE_ROUNDS.labels("branch" if verdict.path and verdict.path[-1] >= shape.chain else "line").inc()
        # the committed positions' states: the root's and the accepted path's rows, in order
        rows_kept = [0, *(j + 1 for j in verdict.path)][:s.cache.length - h.known()]
        h.held.append(features[rows_kept].clone())
        if h.held_rows() >= HELD_ROWS:
            self._catch_up(h)
        h.proposal = None
        if verdict.stop_reason:
            return verdict
        if h.rest:
            h.rest -= 1
        elif not s.params.greedy or h.reach is None or pays_for_head_pass(h.reach, h.price, self._head_positions()):
            self.draft(s, h)
        return verdict

    def _catch_up(self, h: HeadSession) -> None:
        """The held states join the head's context, in one call of the head's layers: a head that
        drafts nothing for a while pays one such call per HELD_ROWS positions, not one a round."""
        if h.held:
            self.drafter.extend(h.context, torch.cat(h.held))
            h.held.clear()

    def _head_positions(self) -> float:
        """A head pass in verify-pass positions that take as long (0 without a calibrated curve)."""
        slope = position_ms(self.engine.model.forward_ms)
        return self.draft_ms / slope if slope > 0 else 0.0

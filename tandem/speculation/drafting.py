"""Drafting a proposal row by row under the request's own rules, for every drafter that scores
tokens (the draft model, the trained head).

Each row's raw logits go through the one processing pipeline (sampling.py) with the history so far
(the committed tokens and the proposal's earlier tokens) and the guide's state after it, and the
token is drawn from what comes out: greedy, its argmax; sampled, a draw from the warped
distribution cut to its likeliest MAX_DRAFT_SUPPORT tokens. q, the distribution the target's p is
compared with, is exactly the one drawn from. A row that leaves nothing to draw (the guide allows
only tokens the drafter gives no score) ends the proposal before it: the proposal's length then
depends on the tokens drawn before, never on the row's own draw, which keeps rejection sampling
exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.speculation.grammar import Matcher
from tandem.speculation.sampling import SamplingError, SamplingParams, probabilities, process

# The wire carries at most this many (id, prob) pairs of q per position: q is cut to them before
# the draw, so the target corrects against exactly the q drawn from.
MAX_DRAFT_SUPPORT = 1024


@dataclass(frozen=True)
class Drawn:
    token: int
    prob: float          # q(token): 1.0 under greedy unless asked for (RowDrafter's want_prob)
    alt: int = -1        # greedy, asked for: the row's second choice (-1: none) and its probability,
    alt_prob: float = 0.0  # where a prepared continuation would branch (draft_worker/streamed.py)


def second_choices(drawn: list[Drawn]) -> list[tuple[float, int]]:
    """(value, i) for each position i of a greedy line whose second choice is known: the draft's
    estimate that the target takes that second choice there, its probability of reaching i (the
    product of q before it) times the second choice's probability. In position order."""
    out, reach = [], 1.0
    for i, d in enumerate(drawn):
        if d.alt >= 0:
            out.append((reach * d.alt_prob, i))
        reach *= d.prob
    return out


class RowDrafter:
    """One proposal's rows. `take` each row's raw logits in order; `finish` once, which leaves the
    guide's matcher as it was found. tokens: drawn so far; support: per token (ids, probs) of q
    when sampled, None when greedy."""

    def __init__(self, context: list[int], prompt_len: int, params: SamplingParams, eos_ids: list[int],
                 grammar: Matcher | None = None, generator: torch.Generator | None = None,
                 want_prob: bool = False) -> None:
        self.context, self.prompt_len, self.params, self.eos_ids = context, prompt_len, params, eos_ids
        self.grammar, self.generator, self.want_prob = grammar, generator, want_prob
        self.tokens: list[int] = []
        self.support: list[tuple[torch.Tensor, torch.Tensor]] | None = None if params.greedy else []
        self._advanced = 0

    def take(self, logits: torch.Tensor) -> Drawn | None:
        """The next token from this row's raw logits [1, V] (or [V]); None when the row leaves
        nothing to draw: the proposal ends before it."""
        allowed = self.grammar.allowed() if self.grammar is not None else None
        try:
            row = process(logits.reshape(1, -1), [*self.context, *self.tokens], self.prompt_len, self.params,
                          self.eos_ids, allowed=allowed)[0]
        except SamplingError:
            return None
        if self.params.greedy:
            token = int(row.argmax())
            if row[token] == float("-inf"):          # every token masked: nothing to draw
                return None
            prob, alt, alt_prob = 1.0, -1, 0.0
            if self.want_prob:
                probs = torch.softmax(row.float(), -1)
                top = torch.topk(probs, 2)
                second = 1 if int(top.indices[0]) == token else 0      # a tie may order them either way
                prob, alt, alt_prob = float(probs[token]), int(top.indices[second]), float(top.values[second])
                if alt_prob <= 0.0:
                    alt = -1
        else:
            try:                                     # SamplingError: every token masked
                ids, probs = truncate(probabilities(row[None], self.params)[0])
            except SamplingError:
                return None
            pick = int(torch.multinomial(probs, 1, generator=self.generator))
            token, prob, alt, alt_prob = int(ids[pick]), float(probs[pick]), -1, 0.0
            self.support.append((ids, probs))
        self.tokens.append(token)
        if self.grammar is not None:
            self._advanced += self.grammar.advance([token])
        return Drawn(token, prob, alt, alt_prob)

    def finish(self) -> None:
        if self.grammar is not None:
            self.grammar.rollback(self._advanced)
            self._advanced = 0


def truncate(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [V] -> (ids [m], renormalized probs [m]) of the nonzero entries, at most MAX_DRAFT_SUPPORT."""
    nonzero = int((probs > 0).sum())
    top = torch.topk(probs, min(nonzero, MAX_DRAFT_SUPPORT))
    return top.indices, top.values / top.values.sum()

"""Drafting with a trained head beside its target, one session at a time.

A session's `HeadContext` holds each head layer's keys and values for every target position the
head has been told about: the verify pass that judges a proposal also yields the tapped hidden
states of the positions it fed, and those of the committed ones extend the context. So the
context always covers the committed tokens but the last (the anchor, not yet fed to the target).

A draft is one forward pass of the head over the block (anchor + mask tokens), then the block's
positions are decided left to right: each position's logits are the base logits (one product with
the target's output layer for the whole block, only its rows of the head's draft vocabulary when
it has one; every other token gets none) plus the Markov head's bias from the token drafted
before, over the whole draft vocabulary as in training; the token is drawn from them through the
request's own pipeline and guide (tandem.speculation.drafting.RowDrafter), as the draft model's
are, so q is exactly the distribution drawn from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from operator import mul

import torch

from tandem.engine.kvpool import MAX_PROPOSAL
from tandem.head.model import BlockHead
from tandem.speculation import tree
from tandem.speculation.drafting import RowDrafter
from tandem.speculation.survival import worth


class HeadContext:
    """One session's head keys/values by layer, [kv_heads, capacity, head_dim] each, grown by doubling."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 256) -> None:
        self.k = [torch.zeros(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.v = [torch.zeros(kv_heads, capacity, head_dim) for _ in range(layers)]
        self.length = 0

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = kv[0][0].shape[1]
        if self.length + n > self.k[0].shape[1]:
            grow = max(self.length + n, 2 * self.k[0].shape[1])
            self.k = [torch.cat([t, t.new_zeros(t.shape[0], grow - t.shape[1], t.shape[2])], 1) for t in self.k]
            self.v = [torch.cat([t, t.new_zeros(t.shape[0], grow - t.shape[1], t.shape[2])], 1) for t in self.v]
        for i, (k, v) in enumerate(kv):
            self.k[i][:, self.length:self.length + n] = k
            self.v[i][:, self.length:self.length + n] = v
        self.length += n

    def copy_prefix(self, other: HeadContext, n: int) -> None:
        """This (empty) context becomes other's first n positions."""
        self.length = 0
        self.append([(k[:, :n], v[:, :n]) for k, v in other.view()])

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :self.length], v[:, :self.length]) for k, v in zip(self.k, self.v)]


@dataclass
class HeadDraft:
    tokens: list[int]
    confidence: list[float]        # per position: predicted probability the target accepts it
    support: list[tuple[torch.Tensor, torch.Tensor]] | None = None   # q per position, when sampled
    ngram: int = 0                 # a prompt lookup's match length when the tokens come from one
    # greedy, where asked for: per position, the head's second choice and its share of what the
    # head's first choice leaves (q2 / (1 - q1)), its estimate of the target's token there when the
    # first is rejected; (-1, 0.0) where there is none
    alternatives: list[tuple[int, float]] | None = None
    # greedy, where asked for: the other source's proposal (a prompt lookup's beside the head's
    # block, or the head's beside a lookup's that promised more), offered as a branch
    other: HeadDraft | None = None


class HeadDrafter:
    """A BlockHead bound to its target's embedding table and output layer (transformers modules)."""

    def __init__(self, head: BlockHead, embed: torch.nn.Module, lm_head: torch.nn.Module) -> None:
        self.head = head.eval()
        self.embed, self.lm_head = embed, lm_head
        self.config = head.config
        # The output layer's rows of the draft vocabulary, when the head has one and the layer's
        # weight is at hand (a packed untied layer keeps none: then the head drafts from all).
        self.vocab = head.draft_vocab
        weight = getattr(lm_head, "weight", None)
        self.vocab_weight = self.markov_rows = None
        self.vocab_size = int(weight.shape[0]) if weight is not None else None
        if self.vocab is not None and weight is not None:
            self.vocab_weight = weight.detach()[self.vocab].float().contiguous()
            if head.markov_head is not None:        # the Markov head's rows of the draft vocabulary
                self.markov_rows = head.markov_head.markov_w2.weight.detach()[self.vocab].float().contiguous()
        else:
            self.vocab = None

    @property
    def taps(self) -> list[int]:
        return self.config.target_layer_ids

    def new_context(self, capacity: int = 256) -> HeadContext:
        c = self.config
        return HeadContext(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, capacity)

    @torch.inference_mode()
    def extend(self, ctx: HeadContext, features: torch.Tensor) -> None:
        """Adds the next positions' tapped features [n, taps * hidden] to the context."""
        if features.shape[0] == 0:
            return
        positions = torch.arange(ctx.length, ctx.length + features.shape[0])
        ctx.append(self.head.context_kv(self.head.context(features), positions))

    @torch.inference_mode()
    def draft(self, ctx: HeadContext, anchor: int, k: int, rows: RowDrafter) -> HeadDraft:
        """Up to k (at most block_size) tokens after `anchor`, the last committed token, whose
        position is ctx.length, each drawn by `rows` (which the caller finishes); fewer where a
        position leaves nothing to draw."""
        c, head = self.config, self.head
        k = min(k, c.block_size)
        if k <= 0:
            return HeadDraft([], [], rows.support)
        ids = torch.tensor([anchor] + [c.mask_token_id] * (c.block_size - 1))
        positions = torch.arange(ctx.length, ctx.length + c.block_size)
        hidden = head.backbone(self.embed(ids).float(), positions, ctx.view(), None)[:k]   # [k, H]
        if self.vocab is not None:
            base = hidden @ self.vocab_weight.T                                             # [k, n]
        else:
            base = self.lm_head(hidden).float()                                             # [k, V]
        markov = head.markov_head
        confidence = []
        alternatives = [] if rows.want_prob else None
        prev = anchor
        for j in range(k):
            prev_t = torch.tensor([prev])
            logits = base[j]
            if markov is not None:
                w1 = markov.markov_w1.weight[prev]
                logits = logits + (self.markov_rows @ w1 if self.markov_rows is not None else markov.markov_w2(w1))
            if self.vocab is not None:
                full = torch.full((self.vocab_size,), float("-inf"))
                full[self.vocab] = logits
                logits = full
            drawn = rows.take(logits)
            if drawn is None:
                break
            conf = head.confidence_logits(hidden[j:j + 1], prev_t)
            confidence.append(1.0 if conf is None else
                              float(head.acceptance(conf, torch.tensor([j]), rows.params.greedy)[0]))
            if alternatives is not None:
                share = drawn.alt_prob / (1.0 - drawn.prob) if drawn.alt >= 0 and drawn.prob < 1.0 else 0.0
                alternatives.append((drawn.alt, min(1.0, share)))
            if drawn.token in rows.eos_ids:
                break
            prev = drawn.token
        return HeadDraft(list(rows.tokens), confidence, rows.support, alternatives=alternatives)


@dataclass
class HeadTree:
    """A greedy round's proposal (tandem.speculation.tree): the draft's first `chain` tokens, then
    the other source's branch (a line), then the leaves; parents None for a chain."""
    tokens: list[int]
    parents: list[int] | None
    chain: int
    leaves: dict[int, float]           # index -> the estimate that the target takes it
    lookup: list[int]                  # the indices of a prompt lookup's tokens, in order
    ngram: int = 0                     # that lookup's match length (0: none)

    @classmethod
    def of_chain(cls, draft: HeadDraft, k: int) -> HeadTree:
        """The draft's first k tokens as a chain."""
        return cls(draft.tokens[:k], None, k, {}, list(range(k)) if draft.ngram else [], draft.ngram)


def head_tree(draft: HeadDraft, k: int, most: int, worth: Callable[[float, int], bool], scale: float = 1.0,
              leaves: int = MAX_PROPOSAL) -> HeadTree:
    """The proposal of a greedy round whose chain is the draft's first k tokens, with at most `most`
    more nodes (of which at most `leaves` leaves), each while `worth(value, nodes so far)` says it
    pays, value being the chance the target takes it:

    - the other source's proposal (draft.other) as a branch where its tokens leave the chain's: a
      node's value is that source's own reach there (a lookup's measured acceptance, the head's
      confidences);
    - as leaves, the head's second choices at the chain's positions (a leaf at position j is a
      sibling of the chain's token j), the likeliest first: position j reached (the chain's
      confidences before it), its chain token rejected, and the head's share for its second
      choice times `scale` (how often such leaves were taken against that estimate)."""
    tokens, parents = draft.tokens[:k], tree.chain(k)
    lookup, ngram = (list(range(k)), draft.ngram) if draft.ngram else ([], 0)
    other, taken = draft.other, set()
    if other is not None and k:
        d = next((i for i, (a, b) in enumerate(zip(other.tokens, tokens)) if a != b), min(len(other.tokens), k))
        parent = d - 1
        for i, reach in enumerate(accumulate(other.confidence, mul)):
            if i < d:
                continue
            if len(tokens) - k >= most or not worth(reach, len(tokens)):
                break
            tokens.append(other.tokens[i])
            parents.append(parent)
            parent = len(tokens) - 1
        if len(tokens) > k:
            taken.add((d - 1, other.tokens[d]))
            if other.ngram:
                lookup, ngram = list(range(d)) + list(range(k, len(tokens))), other.ngram
    chosen: dict[int, float] = {}
    if draft.alternatives and k:
        reach = list(accumulate(draft.confidence[:k], mul, initial=1.0))     # [j]: position j reached
        values = sorted(((min(1.0, reach[j] * (1.0 - draft.confidence[j]) * share * scale), j)
                         for j, (alt, share) in enumerate(draft.alternatives[:k])
                         if alt >= 0 and (j - 1, alt) not in taken), reverse=True)
        for value, j in values[:leaves]:
            if len(tokens) - k >= most or not worth(value, len(tokens)):
                break
            chosen[len(tokens)] = value
            tokens.append(draft.alternatives[j][0])
            parents.append(j - 1)
    return HeadTree(tokens, parents if len(tokens) > k else None, k, chosen, lookup, ngram)


def choose_k(confidence: list[float], pass_ms: list[float], head_ms: float = 0.0, floor: float = 0.05) -> int:
    """How many drafted positions to verify: the k that maximizes expected tokens per millisecond,
    (1 + sum over j < k of the chance positions 0..j are all accepted) / (head_ms + pass_ms[k]),
    with pass_ms[i] a verify pass feeding i + 1 tokens (the worker's calibrated curve). Without a
    curve, every position whose chance of being reached stays at least `floor`."""
    reach = list(accumulate(confidence, mul))          # [j]: the chance positions 0..j are all accepted
    if not pass_ms:
        return sum(1 for r in reach if r >= floor)
    expected = list(accumulate(reach, initial=1.0))     # [k]: expected tokens from a proposal of k
    best, best_rate = 0, 0.0
    for k in range(min(len(confidence), len(pass_ms) - 1) + 1):
        rate = expected[k] / (head_ms + pass_ms[k])
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def worth_its_price(confidence: list[float], price: float) -> int:
    """The head's positions worth the pass's price (tandem.speculation.survival.worth), each reached
    as often as the product of the confidences up to it says."""
    return worth(list(accumulate(confidence, mul)), price)


def gain_at_price(reach: list[float], price: float) -> float:
    """What proposing is worth in a pass at `price`: over the positions worth their price
    (tandem.speculation.survival.worth), the chance of reaching each less its price."""
    return sum(r - price for r in reach[:worth(reach, price)])


def pays_for_head_pass(reach: list[float], price: float, head_positions: float) -> bool:
    """Whether a proposal whose positions are reached this often pays for the head pass that
    proposing brings: the next proposal's, run in the round's follow-up while the other sessions of
    the pass wait for it, priced as the `head_positions` positions that take as long in a verify
    pass. Alone (no price) it always does."""
    return price <= 0 or gain_at_price(reach, price) > price * head_positions

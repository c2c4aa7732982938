"""Drafters: propose k tokens given a session's context.

One small interface: `start(params)` returns a per-session state whose `propose(context, k)`
returns a Draft. The model drafter keeps a KV cache per session and rolls it back to the
longest prefix it shares with the new context; the n-gram drafter needs no model at all.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.batcher import Step
from tandem.engine.kvpool import KVPoolFull, SessionCache, common_prefix, copy_longest_prefix, kv_need, proposal_room
from tandem.engine.lru import KeptCaches
from tandem.engine.modeling import CausalLM
from tandem.speculation.grammar import Matcher
from tandem.speculation.drafting import Drawn, RowDrafter
from tandem.speculation.ngram import lookup
from tandem.speculation.sampling import SamplingParams, make_generator


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

    def prefix(self, n: int) -> Draft:
        return Draft(self.tokens[:n], self.support[:n] if self.support is not None else None, self.kind,
                     min(self.forced, n), self.drawn[:n] if self.drawn is not None else None)


class DraftState(Protocol):
    """One session's drafting. An `inline` state proposes with propose() on the event loop (no
    torch, cheaper than a thread hop); any other proposes with propose_batched() through the
    worker's batcher, sharing forward passes with other sessions, or with propose() on the
    inference thread when the worker batches nothing."""
    inline: bool
    def propose(self, context: list[int], k: int) -> Draft: ...
    async def propose_batched(self, batcher, context: list[int], k: int) -> Draft: ...
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


class ModelDrafter:
    """A causal LM sharing the target's vocabulary. `confidence`: stop a proposal after a token the
    draft itself gives less probability than this, since the tokens after it are likely wasted.

    Like the verify worker, a new session copies the KV of the longest prompt prefix (`MIN_SHARED`
    tokens or more) that a live session or a recently finished one holds instead of computing it;
    finished sessions' caches are kept for that, least recently used first out, up to `keep_share`
    of the KV pool."""

    name = "model"
    uses_model = True
    MIN_SHARED = 16

    def __init__(self, model: CausalLM, confidence: float = 0.0, keep_share: float = 0.25) -> None:
        self.model = model
        self.confidence = confidence
        self.keep_tokens = int(keep_share * model.pool.slots)
        self._live: weakref.WeakSet[_ModelDraftState] = weakref.WeakSet()
        self._kept: KeptCaches[tuple[list[int], SessionCache]] = KeptCaches(lambda kept: kept[1])
        self._lock = threading.Lock()           # start() runs on the event loop, the rest on the inference thread

    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int,
              room: int = proposal_room(), grammar: Matcher | None = None) -> DraftState:
        """room: beyond the prompt and output, what the verify worker's largest proposal takes."""
        while True:
            try:
                state = _ModelDraftState(self, params, eos_ids, prompt_len, room, grammar)
                break
            except KVPoolFull:
                if not self._drop_kept():
                    raise
        self._live.add(state)
        return state

    def keep(self, cached: list[int], cache: SessionCache) -> None:
        """A finished session's cache, kept to lend its prefix to later sessions."""
        if len(cached) < self.MIN_SHARED or self.keep_tokens <= 0:
            cache.release()
            return
        with self._lock:
            self._kept.put(id(cache), (cached, cache))
            self._kept.trim(self.keep_tokens)

    def share(self, state: _ModelDraftState, context: list[int]) -> None:
        """Fills an empty cache with the longest prefix of context (all but its last token) that
        another live or kept cache holds. On the inference thread, between passes."""
        want = context[:len(context) - 1]
        with self._lock:
            donors = [(s.cached, s.cache) for s in list(self._live)] + self._kept.values()
            if copy_longest_prefix(state.cache, want, donors, self.MIN_SHARED):
                state.cached = want[:state.cache.length]

    def _drop_kept(self) -> bool:
        with self._lock:
            return self._kept.evict_oldest()


class _ModelDraftState:
    inline = False

    def __init__(self, drafter: ModelDrafter, params: SamplingParams, eos_ids: list[int], prompt_len: int,
                 room: int, grammar: Matcher | None = None):
        self.drafter, self.model = drafter, drafter.model
        self.grammar = grammar
        self.params, self.eos_ids, self.prompt_len = params, eos_ids, prompt_len
        self.confidence = drafter.confidence
        # what the target reserves too; it grows if a turn needs more (a pipelined proposal)
        self.cache = self.model.new_cache(kv_need(prompt_len, params.max_new_tokens, room, self.model.max_context))
        self.cached: list[int] = []              # token ids whose KV is in self.cache
        self.generator = make_generator(params.seed, stream=1)

    def propose(self, context: list[int], k: int) -> Draft:
        """k tokens (fewer after an end-of-sequence or an unconfident one), one forward pass each."""
        if not self.cached and k > 0:
            self.drafter.share(self, context)
        proposal = self._begin(context, k)
        feed = proposal.feed
        while feed:
            feed = proposal.take(self.model.forward(feed, self.cache, last=1))
        return proposal.draft()

    async def propose_batched(self, batcher, context: list[int], k: int) -> Draft:
        """As propose, each step going through `batcher` so that it shares a forward pass with the
        other sessions' steps."""
        if not self.cached and k > 0:
            await batcher.between_passes(self.drafter.share, self, context)
        proposal = self._begin(context, k)
        feed = proposal.feed
        while feed:
            feed = (await batcher.forward(Step(self.cache, feed, 1, proposal.take, returns=True))).value
        batcher.leave(self.cache)              # nothing more until the verdict comes back
        return proposal.draft()

    def _begin(self, context: list[int], k: int) -> _Proposal:
        """Rolls the cache back to the longest prefix it shares with context."""
        if k <= 0:
            return _Proposal(self, context, 0, [])
        keep = common_prefix(self.cached, context)
        keep = min(keep, len(context) - 1)       # at least one token must be fed to get logits
        self.cache.crop(keep)
        self.cached = self.cached[:keep]
        return _Proposal(self, context, k, context[keep:])

    def kv_bytes(self) -> int:
        return self.cache.nbytes()

    def close(self) -> None:
        self.drafter._live.discard(self)
        cached, self.cached = self.cached, []
        self.drafter.keep(cached, self.cache)


class _Proposal:
    """One proposal being drafted: `take` turns each step's logits into a token (through the
    request's pipeline and guide, tandem.speculation.drafting) and says what to feed next (nothing
    when the proposal is complete)."""

    def __init__(self, state: _ModelDraftState, context: list[int], k: int, feed: list[int]) -> None:
        self.state, self.k, self.feed = state, k, feed
        self.rows = RowDrafter(context, state.prompt_len, state.params, state.eos_ids, state.grammar,
                               state.generator, want_prob=True)
        self.drawn: list[Drawn] = []

    def take(self, logits: torch.Tensor) -> list[int]:
        st = self.state
        st.cached.extend(self.feed)
        drawn = self.rows.take(logits)
        if drawn is not None:
            self.drawn.append(drawn)
        done = (drawn is None or len(self.rows.tokens) >= self.k or drawn.token in st.eos_ids
                or drawn.prob < st.confidence)
        self.feed = [] if done else [drawn.token]
        return self.feed

    def draft(self) -> Draft:
        self.rows.finish()
        return Draft(self.rows.tokens, self.rows.support, drawn=self.drawn if self.state.params.greedy else None)


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

    def propose(self, context: list[int], k: int) -> Draft:
        follow, n = lookup(context, k, self.max_ngram, self.min_ngram)
        return Draft(follow, kind=n) if follow else Draft([])

    async def propose_batched(self, batcher, context: list[int], k: int) -> Draft:
        return self.propose(context, k)

    def kv_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass

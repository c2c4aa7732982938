"""Drafters: propose k tokens given a session's context.

One small interface: `start(params)` returns a per-session state whose `propose(context, k)`
returns a Draft. The model drafter keeps a KV cache per session and rolls it back to the
longest prefix it shares with the new context; the n-gram drafter needs no model at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.modeling import CausalLM, SessionCache
from tandem.sampling import SamplingParams, make_generator, probabilities, suppress_eos

# A sampled draft distribution is cut to its most likely tokens before sampling from it, so
# the wire carries at most this many (id, prob) pairs per position. Lossless all the same: the
# target corrects against exactly the q the drafter sampled from.
MAX_DRAFT_SUPPORT = 1024


@dataclass(frozen=True)
class Draft:
    tokens: list[int]                          # k proposed token ids
    support: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # per proposed position: (ids [m] int64, probs [m] float32) of q, when sampled; None when the
    # proposal is greedy or deterministic


class DraftState(Protocol):
    def propose(self, context: list[int], k: int) -> Draft: ...
    def close(self) -> None: ...


class Drafter(Protocol):
    name: str
    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int) -> DraftState: ...


class ModelDrafter:
    """A causal LM sharing the target's vocabulary. `confidence`: stop a proposal after a token the
    draft itself gives less probability than this, since the tokens after it are likely wasted."""

    name = "model"

    def __init__(self, model: CausalLM, confidence: float = 0.0) -> None:
        self.model = model
        self.confidence = confidence

    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int) -> DraftState:
        return _ModelDraftState(self.model, params, eos_ids, prompt_len, self.confidence)


class _ModelDraftState:
    def __init__(self, model: CausalLM, params: SamplingParams, eos_ids: list[int], prompt_len: int,
                 confidence: float = 0.0):
        self.model, self.params, self.eos_ids, self.prompt_len = model, params, eos_ids, prompt_len
        self.confidence = confidence
        self.cache = SessionCache()
        self.cached: list[int] = []              # token ids whose KV is in self.cache
        self.generator = make_generator(params.seed, stream=1)

    def propose(self, context: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        keep = _common_prefix(self.cached, context)
        keep = min(keep, len(context) - 1)       # at least one token must be fed to get logits
        self.cache.crop(keep)
        self.cached = self.cached[:keep]
        feed = context[keep:]
        tokens: list[int] = []
        support = [] if not self.params.greedy else None
        for i in range(k):
            logits = self.model.forward(feed, self.cache, last=1)     # [1, V]
            self.cached.extend(feed)
            generated = len(context) - self.prompt_len + i
            logits = suppress_eos(logits, self.eos_ids, generated, self.params.min_new_tokens)
            if self.params.greedy:
                token = int(logits[0].argmax())
                q_token = float(torch.softmax(logits[0], dim=-1)[token]) if self.confidence else 1.0
            else:
                ids, probs = _truncate(probabilities(logits, self.params)[0])
                pick = int(torch.multinomial(probs, 1, generator=self.generator))
                token, q_token = int(ids[pick]), float(probs[pick])
                support.append((ids, probs))
            tokens.append(token)
            if token in self.eos_ids or q_token < self.confidence:
                break
            feed = [token]
        return Draft(tokens, support)

    def close(self) -> None:
        self.cache = SessionCache()
        self.cached = []


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n = max_ngram down to min_ngram) and propose what followed it."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, params: SamplingParams, eos_ids: list[int], prompt_len: int) -> DraftState:
        return self

    def propose(self, context: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            tail = context[n_ctx - n:]
            for start in range(n_ctx - n - 1, -1, -1):
                if context[start:start + n] == tail:
                    follow = context[start + n:start + n + k]
                    if follow:
                        return Draft(follow)
        return Draft([])

    def close(self) -> None:
        pass


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _truncate(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [V] -> (ids [m], renormalized probs [m]) of the nonzero entries, at most MAX_DRAFT_SUPPORT."""
    nonzero = int((probs > 0).sum())
    top = torch.topk(probs, min(nonzero, MAX_DRAFT_SUPPORT))
    return top.indices, top.values / top.values.sum()

"""The target side of speculative decoding: prefill, verify a proposal, decode plainly.

Everything here runs on the worker's single inference thread; nothing here knows about gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.modeling import CausalLM, SessionCache
from tandem.sampling import SamplingParams, make_generator, probabilities, suppress_eos
from tandem.verification import verify_greedy, verify_sampled

STOP_NONE, STOP_LENGTH, STOP_EOS, STOP_CONTEXT = 0, 1, 2, 3   # StopReason in internal.proto


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ProtocolError(ValueError):
    """A request that breaks the session protocol; the session is left untouched."""


@dataclass
class TargetSession:
    session_id: str
    params: SamplingParams
    prompt_len: int
    tokens: list[int]                  # prompt + generated, all committed
    cache: SessionCache = field(default_factory=SessionCache)
    generator: torch.Generator | None = None
    stop_reason: int = STOP_NONE

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True)
class VerdictResult:
    accepted: int            # leading proposed tokens accepted
    token_ids: list[int]     # accepted tokens + the bonus/corrected token, cut at a stop
    stop_reason: int


class VerifyEngine:
    def __init__(self, model: CausalLM, max_proposal: int = 16) -> None:
        self.model = model
        self.max_proposal = max_proposal

    def open(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
             reuse: TargetSession | None = None) -> TargetSession:
        """Prefills all prompt tokens but the last; that one is fed with the first proposal, whose
        distribution it predicts. `reuse`, an earlier turn of the same session, lends its cache:
        only the positions after the prefix it shares with prompt_ids are computed."""
        self._check_ids(prompt_ids, "prompt token")
        if not prompt_ids:
            raise ProtocolError("prompt_ids must not be empty")
        if len(prompt_ids) >= self.model.max_context:
            raise ProtocolError(f"prompt is {len(prompt_ids)} tokens; the model's context is "
                                f"{self.model.max_context}")
        s = TargetSession(session_id, params, len(prompt_ids), list(prompt_ids),
                          generator=make_generator(params.seed, stream=0))
        if reuse is not None:
            reuse.cache.crop(min(common_prefix(reuse.tokens, prompt_ids), len(prompt_ids) - 1))
            s.cache = reuse.cache
        if len(prompt_ids) - 1 > s.cache.length:
            self.model.forward(prompt_ids[s.cache.length:-1], s.cache, last=1)
        return s

    def verify(self, s: TargetSession, proposed: list[int],
               draft_probs: torch.Tensor | None = None) -> VerdictResult:
        """One forward pass over [last committed token] + proposed (k+1 positions).

        draft_probs: [k, V] q the proposal was sampled from, or None (greedy or deterministic).
        """
        if s.stop_reason != STOP_NONE:
            raise ProtocolError(f"session {s.session_id} has already finished")
        k = len(proposed)
        if k > self.max_proposal:
            raise ProtocolError(f"proposal of {k} tokens exceeds this worker's limit of {self.max_proposal}")
        self._check_ids(proposed, "proposed token")
        if draft_probs is not None and tuple(draft_probs.shape) != (k, self.model.vocab_size):
            raise ProtocolError(f"draft distributions have shape {tuple(draft_probs.shape)}, "
                                f"expected ({k}, {self.model.vocab_size})")
        base = s.cache.length                                     # == len(s.tokens) - 1
        logits = self.model.forward([s.tokens[-1], *proposed], s.cache)   # [k+1, V]
        logits = suppress_eos(logits, self.model.eos_ids, s.generated, s.params.min_new_tokens)
        proposed_t = torch.tensor(proposed, dtype=torch.long)      # [k]
        if s.params.greedy:
            outcome = verify_greedy(proposed_t, logits)
        else:
            p = probabilities(logits, s.params)                    # [k+1, V]
            uniforms = torch.rand(k, generator=s.generator)        # [k]
            outcome = verify_sampled(proposed_t, draft_probs, p, uniforms, s.generator)
        # Keep the last committed token and the accepted ones; rejected positions are dropped.
        s.cache.crop(base + 1 + outcome.accepted)
        return self._commit(s, outcome.accepted, [*proposed[:outcome.accepted], outcome.next_token])

    def decode(self, s: TargetSession) -> VerdictResult:
        """Plain decoding: one target token, no proposal."""
        return self.verify(s, [])

    def _commit(self, s: TargetSession, accepted: int, new: list[int]) -> VerdictResult:
        eos = set(self.model.eos_ids)
        kept: list[int] = []
        stop = STOP_NONE
        for t in new:
            if t in eos:
                stop = STOP_EOS
                break
            kept.append(t)
            if s.generated + len(kept) >= s.params.max_new_tokens:
                stop = STOP_LENGTH
                break
            if len(s.tokens) + len(kept) >= self.model.max_context:
                stop = STOP_CONTEXT
                break
        s.tokens.extend(kept)
        s.stop_reason = stop
        if stop != STOP_NONE and s.cache.length > len(s.tokens) - 1:
            s.cache.crop(len(s.tokens) - 1)
        return VerdictResult(min(accepted, len(kept)), kept, stop)

    def _check_ids(self, ids: list[int], what: str) -> None:
        vocab = self.model.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise ProtocolError(f"{what} id {t} is outside the vocabulary [0, {vocab})")

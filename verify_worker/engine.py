"""The target side of speculative decoding: prefill, verify a proposal, decode plainly.

Everything here runs on the worker's single inference thread; nothing here knows about gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from tandem.engine.batcher import Step
from tandem.engine.kvpool import MAX_PROPOSAL, common_prefix, copy_longest_prefix, kv_need, proposal_room
from tandem.engine.modeling import CausalLM, SessionCache
from tandem.speculation.finish import Finish
from tandem.speculation.logprobs import TokenLogprob, logprobs_of
from tandem.speculation.grammar import Matcher
from tandem.speculation.sampling import SamplingError, SamplingParams, make_generator, probabilities, process
from tandem.speculation import tree
from tandem.speculation.verification import verify_sampled


class ProtocolError(ValueError):
    """A request that breaks the session protocol; the session is left untouched."""


@dataclass
class TargetSession:
    session_id: str
    params: SamplingParams
    prompt_len: int
    tokens: list[int]                  # prompt + generated, all committed
    cache: SessionCache
    generator: torch.Generator | None = None
    stop_reason: Finish = Finish.NONE
    grammar: Matcher | None = None     # the guide's state after `tokens` (structured output)
    drafting: Any = None               # the state of the worker's own drafting for it (verify_worker/rounds.py)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class VerdictResult:
    accepted: int            # leading proposed tokens accepted
    token_ids: list[int]     # accepted tokens + the bonus/corrected token, cut at a stop
    stop_reason: Finish
    logprobs: list[TokenLogprob] | None = None   # one per token_ids entry, when the session reports
    path: list[int] | None = None      # the proposed indices accepted, in order (a tree's path; a chain's 0..)


class VerifyEngine:
    def __init__(self, model: CausalLM, max_proposal: int = MAX_PROPOSAL) -> None:
        self.model = model
        self.max_proposal = max_proposal

    def capacity(self, prompt_len: int, params: SamplingParams) -> int:
        """KV positions a session reserves here (tandem.engine.kvpool.kv_need)."""
        return kv_need(prompt_len, params.max_new_tokens, proposal_room(self.max_proposal), self.model.max_context)

    def open(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
             reuse: TargetSession | None = None, grammar: Matcher | None = None,
             reuse_prefix: bool = True) -> TargetSession:
        """A session with its KV reserved; `prefill_chunks` says what to feed before the first
        proposal. `reuse`, an earlier turn of the same session, lends its cache: only the positions
        after the prefix it shares with prompt_ids are computed (none without `reuse_prefix`: a
        trained head needs the hidden states of every position). Raises KVPoolFull."""
        self._check_ids(prompt_ids, "prompt token")
        if not prompt_ids:
            raise ProtocolError("prompt_ids must not be empty")
        if len(prompt_ids) >= self.model.max_context:
            raise ProtocolError(f"prompt is {len(prompt_ids)} tokens; the model's context is "
                                f"{self.model.max_context}")
        need = self.capacity(len(prompt_ids), params)
        if reuse is not None:
            # Prompt logprobs need the logits of every prompt position: then nothing is reused.
            keep = 0 if params.prompt_logprobs or not reuse_prefix else common_prefix(reuse.tokens, prompt_ids)
            reuse.cache.crop(min(keep, len(prompt_ids) - 1))
            reuse.cache.reserve(need, spare=False)     # exactly what the budget reserved
            cache = reuse.cache
        else:
            cache = self.model.new_cache(need)
        return TargetSession(session_id, params, len(prompt_ids), list(prompt_ids), cache,
                             generator=make_generator(params.seed, stream=0), grammar=grammar)

    @staticmethod
    def share_prefix(s: TargetSession, donors: list[TargetSession], least: int = 16,
                     upto: Callable[[TargetSession], int] | None = None) -> TargetSession | None:
        """Copies into s's cache the longest prompt prefix (at least `least` tokens, beyond what s
        holds already) whose KV another session holds, live or idle, and at most `upto(donor)` of
        a donor's positions; returns the donor. On the inference thread, between passes: a donor
        released meanwhile is skipped."""
        want = s.prompt_len - 1                   # the last prompt token goes with the first round
        pairs = [(d.tokens if upto is None else d.tokens[:upto(d)], d.cache) for d in donors]
        chosen = copy_longest_prefix(s.cache, s.tokens[:want], pairs, least)
        return next((d for d in donors if d.cache is chosen), None)

    @staticmethod
    def prefill_chunks(s: TargetSession, chunk: int) -> list[list[int]]:
        """The prompt tokens still to feed (all but the last, which goes with the first proposal,
        whose distribution it predicts), in pieces of at most `chunk`."""
        todo = s.tokens[s.cache.length:s.prompt_len - 1]
        return [todo[i:i + chunk] for i in range(0, len(todo), chunk)]

    @staticmethod
    def prefill_rows(s: TargetSession) -> int | None:
        """The logits rows a prefill chunk keeps (`last`): all of them for prompt logprobs, else
        none is used, and one is the least a forward pass returns."""
        return None if s.params.prompt_logprobs else 1

    def prefill(self, s: TargetSession, chunk: int = 1 << 30) -> list[TokenLogprob]:
        """Feeds the prompt; returns the prompt tokens' reports when the session asks for them."""
        reports: list[TokenLogprob] = []
        for piece in self.prefill_chunks(s, chunk):
            start = s.cache.length
            reports += self.prompt_report(s, self.model.forward(piece, s.cache, last=self.prefill_rows(s)), start)
        return reports

    @staticmethod
    def prompt_report(s: TargetSession, logits: torch.Tensor, start: int) -> list[TokenLogprob]:
        """Reports of the prompt tokens that a prefill chunk's logits [n, V] predict: row i follows
        prompt token start + i. Empty unless the session asks for prompt logprobs."""
        if not s.params.prompt_logprobs:
            return []
        return logprobs_of(logits, s.tokens[start + 1:start + 1 + logits.shape[0]], s.params.top_logprobs)

    def verify_input(self, s: TargetSession, proposed: list[int], parents: list[int] | None = None) -> list[int]:
        """Checks a proposal (a chain, or a token tree with its parents: greedy sessions only);
        returns the k+1 tokens to feed: the last committed one + proposed."""
        if s.stop_reason:
            raise ProtocolError(f"session {s.session_id} has already finished")
        k = len(proposed)
        if k > self.max_proposal:
            raise ProtocolError(f"proposal of {k} tokens exceeds this worker's limit of {self.max_proposal}")
        self._check_ids(proposed, "proposed token")
        if parents is not None:
            if not s.params.greedy:
                raise ProtocolError("a tree proposal needs a greedy session (sampled proposals are chains)")
            if (why := tree.problem(proposed, parents)) is not None:
                raise ProtocolError(why)
        if len(s.tokens) + k > self.model.max_context:
            raise ProtocolError(f"proposal of {k} tokens runs past the context window "
                                f"({len(s.tokens)} of {self.model.max_context} positions used)")
        if s.cache.length != len(s.tokens) - 1:
            raise ProtocolError(f"session {s.session_id} is not prefilled")
        return [s.tokens[-1], *proposed]

    def judge(self, s: TargetSession, proposed: list[int], draft_probs: torch.Tensor | None,
              logits: torch.Tensor, parents: list[int] | None = None) -> VerdictResult:
        """The verdict on a proposal from the target's logits [k+1, V] over verify_input's tokens,
        which the cache now holds; rejected positions are rolled back, and of a tree only the
        accepted path is kept, in order.

        draft_probs: [k, V] q the proposal was sampled from, or None (greedy or deterministic).
        parents: a tree's (greedy only), None for a chain."""
        k = len(proposed)
        base = s.cache.length - (k + 1)                           # == len(s.tokens) - 1
        if draft_probs is not None and tuple(draft_probs.shape) != (k, self.model.vocab_size):
            s.cache.crop(base)
            raise ProtocolError(f"draft distributions have shape {tuple(draft_probs.shape)}, "
                                f"expected ({k}, {self.model.vocab_size})")
        parents = tree.chain(k) if parents is None else parents

        def process_path(rows: torch.Tensor, path: list[int]) -> torch.Tensor:
            allowed = s.grammar.allowed(path) if s.grammar is not None else None     # [len(path)+1, V]
            return process(rows, s.tokens, s.prompt_len, s.params, self.model.eos_ids, path, allowed)
        try:
            processed = tree.rows_by_path(logits, proposed, parents, process_path)     # [k+1, V]
        except SamplingError:
            s.cache.crop(base)
            raise
        if s.params.greedy:
            path, next_token = tree.walk(proposed, parents, processed.argmax(dim=-1).tolist())
        else:
            p = probabilities(processed, s.params)                 # [k+1, V]
            uniforms = torch.rand(k, generator=s.generator)        # [k]
            outcome = verify_sampled(torch.tensor(proposed, dtype=torch.long), draft_probs, p, uniforms, s.generator)
            path, next_token = list(range(outcome.accepted)), outcome.next_token
        # Keep the last committed token and the accepted path; the other positions are dropped.
        s.cache.keep_path(base + 1, path)
        verdict = self._commit(s, len(path), [*(proposed[j] for j in path), next_token])
        verdict.path = path[:verdict.accepted]
        if s.params.reports:
            # the raw logits' row after the root and after each accepted token: the distribution
            # each of token_ids was decided from
            rows = [0, *(j + 1 for j in path)][:len(verdict.token_ids)]
            verdict.logprobs = logprobs_of(logits[rows], verdict.token_ids, s.params.top_logprobs)
        return verdict

    def judge_fed(self, s: TargetSession, proposed: list[int],
                  draft_probs: Callable[[], torch.Tensor | None], logits: torch.Tensor,
                  parents: list[int] | None = None) -> VerdictResult:
        """judge for a proposal the batcher may have cut to fit its pass: `logits` has a row per
        token fed, so the first len(logits) - 1 proposed tokens are judged (of a tree too: parents
        come first). draft_probs() builds the whole proposal's q (only sampling needs it); its
        ValueError rolls the pass back and is a ProtocolError."""
        k = logits.shape[0] - 1
        q = None
        if not s.params.greedy:
            try:
                q = draft_probs()
                q = None if q is None else q[:k]
            except ValueError as e:
                s.cache.crop(len(s.tokens) - 1)
                raise ProtocolError(str(e)) from None
        return self.judge(s, proposed[:k], q, logits, None if parents is None else parents[:k])

    def round_step(self, s: TargetSession, proposed: list[int], draft_probs: Callable[[], torch.Tensor | None],
                   parents: list[int] | None = None, returns: bool = False) -> Step:
        """A round's step for the batcher: the proposal (a chain, or a tree with its `parents`) fed
        after the last committed token and judged by judge_fed; it may be cut to fit a pass.
        Raises ProtocolError for a bad proposal."""
        feed = self.verify_input(s, proposed, parents)
        return Step(s.cache, feed, None, partial(self.judge_fed, s, proposed, draft_probs, parents=parents),
                    least=1, returns=returns, tree=None if parents is None else tree.fed(parents))

    def verify(self, s: TargetSession, proposed: list[int], draft_probs: torch.Tensor | None = None,
               parents: list[int] | None = None) -> VerdictResult:
        """One forward pass over [last committed token] + proposed (k+1 positions), on its own."""
        tokens = self.verify_input(s, proposed, parents)
        logits = self.model.forward_batch([(s.cache, tokens, None, None if parents is None else tree.fed(parents))])[0]
        return self.judge(s, proposed, draft_probs, logits, parents)

    def _commit(self, s: TargetSession, accepted: int, new: list[int]) -> VerdictResult:
        eos = set(self.model.eos_ids)
        kept: list[int] = []
        stop = Finish.NONE
        for t in new:
            if t in eos:
                stop = Finish.EOS
                break
            kept.append(t)
            if s.generated + len(kept) >= s.params.max_new_tokens:
                stop = Finish.LENGTH
                break
            if len(s.tokens) + len(kept) >= self.model.max_context:
                stop = Finish.CONTEXT_LENGTH
                break
        s.tokens.extend(kept)
        if s.grammar is not None:
            if s.grammar.advance(kept) != len(kept):
                raise RuntimeError("a committed token broke the guide: its mask was not applied")
            # Where nothing but end-of-sequence may follow, the guide ended the output, whether the
            # end-of-sequence token was decided in this round or not (the same reason either way).
            if stop in (Finish.NONE, Finish.EOS) and s.grammar.done():
                stop = Finish.GUIDE
        s.stop_reason = stop
        if stop and s.cache.length > len(s.tokens) - 1:
            s.cache.crop(len(s.tokens) - 1)
        return VerdictResult(min(accepted, len(kept)), kept, stop)

    def _check_ids(self, ids: list[int], what: str) -> None:
        vocab = self.model.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise ProtocolError(f"{what} id {t} is outside the vocabulary [0, {vocab})")

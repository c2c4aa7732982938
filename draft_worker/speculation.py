"""One request's speculation against its verify worker: a round is propose -> send -> apply verdict.

The drafter proposes k tokens (inference thread), the verify worker's Verdict extends the context
with the accepted + bonus tokens, which go to the gateway as one TokenChunk; the drafter rolls its
cache back on the next propose. With --pipeline, greedy proposals are streamed instead (streamed.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch

from draft_worker.controller import SpeculationController, controller_for, plain_instead
from draft_worker.drafters import Draft, Drafter, DraftState
from draft_worker.streamed import BranchRows, Streaming
from tandem.engine.batcher import Batcher
from tandem.engine.kvpool import proposal_room
from tandem.engine.thread import InferenceThread
from tandem.service import metrics, telemetry, wire
from tandem.speculation.grammar import GrammarError, Grammars, Matcher
from tandem.speculation.room import plan_k
from tandem.speculation.sampling import SamplingParams
from tandem.speculation.survival import Survival
from tandem.speculation.tree import TreeBudget
from tandem.v1 import internal_pb2 as pb


JUMP_FORWARD = "jump_forward"    # the method label of the tokens a guide forces, in metrics


@dataclass
class Drafting:
    """What a draft worker lends each of its streams."""
    inference: InferenceThread
    batcher: Batcher | None       # batches the model drafter's steps across sessions
    pipeline: bool                # stream greedy proposals, drafting while the target verifies
    adaptive_k: bool
    eos_ids: list[int]
    vocab_size: int | None        # the draft model's; None for model-free drafting
    grammars: Grammars | None = None   # guides compiled for the draft model's vocabulary (None: no model)
    compile_timeout: float = 10.0
    jump_forward: bool = True     # propose the tokens a guide forces before the drafted ones
    branch_rows: BranchRows | None = None   # streamed: rows to prepare continuations with (None: none)
    tree_branches: int = 0        # rounds of greedy unguided requests: a tree with this many branches (0: chains)


class VerifyClosed(Exception):
    """The verify worker ended the session stream without an answer."""


class Speculation:
    def __init__(self, drafting: Drafting, drafter: Drafter, request: pb.DraftGenerateRequest,
                 params: SamplingParams, call) -> None:
        self.drafting, self.drafter, self.request, self.params, self.call = drafting, drafter, request, params, call
        self.prompt = list(request.prompt_ids)
        self.tokens = list(self.prompt)
        self.state: DraftState | None = None
        self.grammar: Matcher | None = None           # the guide's state after self.tokens
        self.control: SpeculationController | None = None
        self.pending: asyncio.Future | None = None    # the next proposal being drafted
        self.streaming: Streaming | None = None       # --pipeline: proposals streamed (streamed.py)
        self.rounds = self.drafted = self.accepted = 0

    async def open(self, prior: dict[object, Survival]) -> pb.Opened:
        """Opens the session on the verify worker and starts drafting; `prior`: acceptance by
        position over recent sessions of this method on that worker. Raises ValueError when the
        draft model's vocabulary is not the target's."""
        # Streamed: greedy requests without a guide (a guide's matcher follows the verdicts; see
        # streamed.py for sampling).
        stream = self.drafting.pipeline and self.params.greedy and self.params.guide is None
        await self.call.write(pb.VerifyRequest(open=pb.OpenSession(
            session_id=self.request.session_id, prompt_ids=self.prompt, sampling=self.request.sampling,
            stream=stream, num_speculative_tokens=self.request.num_speculative_tokens)))
        opened = self.opened = (await self.read()).opened
        vocab = self.drafting.vocab_size
        if self.drafter.uses_model and vocab not in (None, opened.vocab_size):
            raise ValueError(f"draft model vocabulary ({vocab}) does not match the target's ({opened.vocab_size})")
        self.grammar = await self._grammar()
        self.state = self.drafter.start(self.params, self.drafting.eos_ids, len(self.prompt),
                                        proposal_room(opened.max_proposal), self.grammar)
        if stream:
            self.streaming = Streaming(self, self.drafting.eos_ids, self.drafting.branch_rows,
                                       self.request.num_speculative_tokens)
            return opened
        # Greedy only: a sampled request's output must not depend on measured timings, so that its
        # seed reproduces it on any worker.
        if self.drafting.adaptive_k and self.params.greedy:
            self.control = controller_for(opened.forward_ms, prior, opened.token_cost)
        self.pending = self._propose(self.tokens, self._next_k())
        return opened

    async def _grammar(self) -> Matcher | None:
        """The guide's matcher after the prompt (a moved request replays what it delivered). None
        when there is no guide, or no grammar here to draft under: the verify worker's decides
        anyway, so drafting goes on without a mask."""
        grammars, guide = self.drafting.grammars, self.params.guide
        if guide is None or grammars is None:
            return None
        try:
            return await grammars.matcher_within(guide, self.drafting.compile_timeout,
                                                 self.prompt[len(self.prompt) - self.params.resumed:])
        except GrammarError:
            return None

    def _room(self) -> int:
        """The most tokens a proposal may hold now."""
        return plan_k(self.request.num_speculative_tokens, len(self.tokens), len(self.tokens) - len(self.prompt),
                      self.params.max_new_tokens, self.opened.max_context, self.opened.max_proposal)

    def _next_k(self) -> int:
        k = self._room()
        return self.control.choose(k) if self.control is not None else k

    async def chunks(self) -> AsyncIterator[pb.TokenChunk]:
        """The rounds to the end of the request, a chunk each. Plain rounds in a row go as one
        request: the verify worker decodes them back to back without a round trip each."""
        if self.streaming is not None:
            async for chunk in self.streaming.chunks():
                yield chunk
            return
        owed, arrived = 0, 0.0      # verdicts still to come of a run of plain rounds; when the last came
        draft = Draft([])
        while True:
            run = 1
            if not owed:
                draft, propose_s = await self.pending
                draft, run = self._shape(draft)
            continued = owed > 0           # not a round trip: the next verdict of a plain run
            with telemetry.span("speculation round") as span:
                if continued:
                    propose_s, owed = 0.0, owed - 1
                    verdict, rtt_s = await self._read_verdict(arrived)
                else:
                    verdict, rtt_s = await self._send(draft, run)
                    owed = run - 1
                arrived = time.perf_counter()
                if span is not None:
                    span.set_attributes(telemetry.round_attributes(
                        len(draft.tokens), verdict.accepted, verdict.token_ids, verdict.batch_size,
                        verdict.verify_seconds, rtt_s))
                    span.set_attribute("tandem.propose_seconds", propose_s)
            if not continued:
                metrics.PROPOSE.observe(propose_s)
                metrics.ROUND_TRIP.observe(rtt_s)
            checked, forced, forced_accepted = self._apply(draft, verdict, propose_s + rtt_s, rtt_s)
            chunk = self.chunk(verdict, checked - forced, verdict.accepted - forced_accepted, forced, forced_accepted)
            if verdict.stop_reason:
                yield chunk
                return
            if not owed:
                self.pending = self._propose(self.tokens, self._next_k())     # drafts while the chunk travels
            yield chunk

    def _shape(self, draft: Draft) -> tuple[Draft, int]:
        """The drafted proposal fitted to the controller's choice, and how many plain rounds to ask
        for when there is none."""
        control = self.control
        if control is not None and draft.line > draft.forced:
            draft = draft.fit_line(draft.forced + control.fit(draft.line - draft.forced, draft.kind))
        return draft, control.plain_run() if control is not None and not draft.tokens else 1

    def _apply(self, draft: Draft, verdict: pb.Verdict, round_s: float, rtt_s: float) -> tuple[int, int, int]:
        """Takes in a verdict: the context grows by its tokens, the counts and the controller learn
        from it. Returns how many proposed tokens the target judged, and how many of those and of
        the accepted ones a guide forced (they lead the proposal)."""
        checked = len(draft.tokens) - verdict.unverified
        forced = min(draft.forced, checked)
        forced_accepted = min(draft.forced, verdict.accepted)
        metrics.observe_verdict(JUMP_FORWARD, forced, forced_accepted)
        if draft.parents is not None:
            metrics.TREE_ROUNDS.labels("branch" if draft.off_line(verdict.accepted, verdict.token_ids) else "line").inc()
        if self.control is not None:       # a tree's acceptance is counted by depth, as a chain's
            plain_s = plain_instead(rtt_s, checked, verdict.position_seconds) if checked else None
            self.control.observe(draft.depth(checked), len(verdict.token_ids), round_s, verdict.accepted,
                                 verdict.token_cost, plain_s)
        self.tokens.extend(verdict.token_ids)
        if self.grammar is not None and not verdict.stop_reason:
            taken = self.grammar.advance(list(verdict.token_ids))
            if taken != len(verdict.token_ids):
                # Cannot happen with the verify worker's guide. The n-gram cut and jump-forward stop;
                # a model drafter's mask goes stale, which the verify worker's matcher corrects.
                self.grammar.rollback(taken)
                self.grammar = None
        return checked, forced, forced_accepted

    def chunk(self, verdict: pb.Verdict, drafted: int, accepted: int, forced: int = 0,
              forced_accepted: int = 0) -> pb.TokenChunk:
        """One verdict's chunk for the gateway, its drafted and accepted tokens counted in the metrics
        and the request's totals; the first chunk also carries the prompt's cached tokens and reports."""
        metrics.observe_verdict(self.drafter.name, drafted, accepted)
        first = self.rounds == 0
        self.rounds, self.drafted, self.accepted = self.rounds + 1, self.drafted + drafted, self.accepted + accepted
        return pb.TokenChunk(token_ids=verdict.token_ids, draft_tokens=drafted, accepted_tokens=accepted,
                             forced_tokens=forced, forced_accepted=forced_accepted, stop_reason=verdict.stop_reason,
                             cached_tokens=self.opened.cached_tokens if first else 0, logprobs=verdict.logprobs,
                             prompt_logprobs=self.opened.prompt_logprobs if first else ())

    def _propose(self, tokens: list[int], k: int) -> asyncio.Future:
        """Drafts a proposal in the background: (Draft, seconds until it was ready). Greedy, where
        trees are on, within a round's tree budget (sampled proposals are judged as chains)."""
        if self.grammar is not None:
            return asyncio.ensure_future(self._guided(tokens, k))
        budget, o, control = None, self.opened, self.control
        if self.drafting.tree_branches and self.params.greedy:
            budget = TreeBudget.for_round(self.request.num_speculative_tokens, o.max_proposal,
                                          o.max_context - len(tokens), self.drafting.tree_branches,
                                          control.price if control else 0.0, o.forward_ms,
                                          (control.speculative.value or 0.0) if control else 0.0)
        return self.propose(tokens, k, budget=budget)

    async def _guided(self, tokens: list[int], k: int) -> tuple[Draft, float]:
        """A proposal under the guide: first the tokens it forces (jump-forward; proposed even when
        the controller chose plain decoding, as they need no draft), then up to k more drafted
        after them under its mask. A drafter that does not take the mask is cut at the first token
        the guide refuses: the target would reject it anyway."""
        start = time.perf_counter()
        g = self.grammar
        forced = g.forced(self._room()) if self.drafting.jump_forward else []
        forced = forced[:g.advance(forced)]
        try:
            draft, _ = await self.propose(tokens + forced, min(k, self._room() - len(forced)))
            if not self.drafter.uses_model:
                taken = g.advance(draft.tokens)
                g.rollback(taken)
                draft = draft.prefix(taken)
        finally:
            g.rollback(len(forced))
        support = draft.support          # forced tokens are certain: q puts all its mass on them
        if support is not None:
            support = [(torch.tensor([t]), torch.tensor([1.0])) for t in forced] + support
        return Draft(forced + draft.tokens, support, draft.kind, len(forced)), time.perf_counter() - start

    def start_state(self) -> DraftState:
        """Another drafting state for this request (a streamed run's second line); KVPoolFull when
        the drafter has no room for it."""
        return self.drafter.start(self.params, self.drafting.eos_ids, len(self.prompt),
                                  proposal_room(self.opened.max_proposal))

    def propose(self, tokens: list[int], k: int, state: DraftState | None = None,
                budget: TreeBudget | None = None, steps: int = 0) -> asyncio.Future:
        """The drafter's proposal of up to k tokens after `tokens` (from `state`, by default the
        request's; a tree within `budget`, in at most `steps` passes, when given) and its seconds."""
        state, drafting = state or self.state, self.drafting
        if state.inline:
            start = time.perf_counter()
            done = asyncio.get_running_loop().create_future()
            done.set_result((state.propose(tokens, k, budget, steps), time.perf_counter() - start))
            return done
        if drafting.batcher is None:
            return asyncio.ensure_future(drafting.inference.run_timed(state.propose, tokens, k, budget, steps))

        async def batched():
            start = time.perf_counter()
            return await state.propose_batched(drafting.batcher, tokens, k, budget, steps), time.perf_counter() - start
        return asyncio.ensure_future(batched())

    async def _send(self, draft: Draft, run: int = 1) -> tuple[pb.Verdict, float]:
        """Sends one proposal (or, with no tokens, a run of `run` plain rounds) and reads its first
        verdict: (verdict, round-trip seconds)."""
        proposal = pb.Proposal(token_ids=draft.tokens, plain_steps=run if run > 1 else 0, parents=draft.parents or ())
        if draft.support is not None:
            proposal.distributions.extend(wire.support_to_proto(i, p) for i, p in draft.support)
        sent = time.perf_counter()
        await self.call.write(pb.VerifyRequest(proposal=proposal))
        return await self._read_verdict(sent)

    async def _read_verdict(self, since: float) -> tuple[pb.Verdict, float]:
        """The next verdict, and the seconds from `since` to its arrival."""
        return (await self.read()).verdict, time.perf_counter() - since

    async def read(self) -> pb.VerifyResponse:
        """The verify worker's next message (VerifyClosed when its stream has ended)."""
        if (msg := await self.call.read()) is grpc.aio.EOF:
            raise VerifyClosed("verify worker closed the session stream")
        return msg

    async def finish(self) -> None:
        """Ends the verify stream in order once the last chunk is out, reading it to its end so
        that the call (and its client span) closes now, not at garbage collection."""
        if self.streaming is not None:
            await self.streaming.stop()
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass

    async def close(self) -> None:
        """Cancels drafting still under way and frees the drafter's state; runs however the stream ended."""
        self.call.cancel()
        if self.streaming is not None:
            self.streaming.cancel()
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()            # its result is not needed; close runs after it
        for state in [self.state, *(self.streaming.release() if self.streaming is not None else [])]:
            if state is not None:
                await self.drafting.inference.run(state.close)

"""DraftService: runs the speculation loop of one request against its verify worker.

Per round: propose k tokens (inference thread) -> send the Proposal -> read the Verdict ->
extend the context with the accepted + bonus tokens -> stream them to the gateway. The drafter
rolls its own cache back on the next propose, from the context it is given.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from draft_worker.controller import Survival, controller_for, plain_instead
from draft_worker.drafters import Draft, Drafter
from tandem.engine.batcher import Batcher
from tandem.engine.kvpool import proposal_room
from tandem.engine.thread import InferenceThread
from tandem.service import logs, metrics, telemetry, wire
from tandem.service.server import channel as traced_channel
from tandem.speculation.sampling import SamplingError
from tandem.v1 import internal_pb2 as pb
from tandem.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def plan_k(requested: int, context_len: int, generated: int, max_new_tokens: int,
           max_context: int, max_proposal: int) -> int:
    """How many tokens to propose this round: never more than can still be used (each round also
    yields one bonus token) and never past the target's context window."""
    room = min(max_new_tokens - generated - 1, max_context - context_len - 1, max_proposal)
    return max(0, min(requested, room))


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, drafters: dict[str, Drafter], eos_ids: list[int], vocab_size: int | None,
                 inference: InferenceThread, adaptive_k: bool = True, batcher: Batcher | None = None,
                 pipeline: bool = False) -> None:
        self.drafters = drafters
        self.pipeline = pipeline              # draft the next proposal while this one is verified
        self.batcher = batcher                # batches the model drafter's steps across sessions
        self.adaptive_k = adaptive_k
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size          # the draft model's; None for model-free drafting
        self.inference = inference
        self._channels: dict[str, grpc.aio.Channel] = {}
        # by (method, verify worker), then kind of proposal: acceptance by position over recent
        # sessions, a new session's prior
        self._acceptance: dict[tuple[str, str], dict[object, Survival]] = {}
        self.sessions: dict[int, object] = {}     # drafter state by stream, while the stream lives
        metrics.gauge_from(metrics.DRAFT_RUNNING, lambda: len(self.sessions))
        metrics.declare_methods(drafters)

    def _verify_stub(self, address: str) -> pb_grpc.VerifyServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = traced_channel(address)
        return pb_grpc.VerifyServiceStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def Generate(self, request: pb.DraftGenerateRequest, context: grpc.aio.ServicerContext):
        drafter = self.drafters.get(request.method)
        if drafter is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"draft method {request.method!r} is not served by this worker "
                                f"(serves: {', '.join(sorted(self.drafters))})")
        if not request.verify_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "verify_address is required")
        logs.session_id.set(request.session_id)
        try:
            params = wire.check_params(wire.params_from_proto(request.sampling))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_ids)
        call = self._verify_stub(request.verify_address).Verify(timeout=context.time_remaining(),
                                                                metadata=logs.outgoing_metadata())
        state = pending = ahead = None
        try:
            await call.write(pb.VerifyRequest(open=pb.OpenSession(
                session_id=request.session_id, prompt_ids=prompt, sampling=request.sampling)))
            opened = (await self._read(call, context)).opened
            if drafter.uses_model and self.vocab_size not in (None, opened.vocab_size):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"draft model vocabulary ({self.vocab_size}) does not match the "
                                    f"target's ({opened.vocab_size})")
            state = self.sessions[id(context)] = drafter.start(params, self.eos_ids, len(prompt),
                                                                   proposal_room(opened.max_proposal))
            tokens = list(prompt)
            cached = opened.cached_tokens        # reported once, on the first chunk
            prompt_reports = opened.prompt_logprobs
            # Greedy only: a sampled request's output must not depend on measured timings, so that
            # its seed reproduces it on any worker.
            adaptive = self.adaptive_k and params.greedy
            prior = self._acceptance.setdefault((drafter.name, request.verify_address), {})
            control = controller_for(opened.forward_ms, prior, opened.token_cost) if adaptive else None

            def next_k() -> int:
                k = plan_k(request.num_speculative_tokens, len(tokens), len(tokens) - len(prompt),
                           params.max_new_tokens, opened.max_context, opened.max_proposal)
                return control.choose(k) if control is not None else k

            pending = self._propose(state, tokens, next_k())
            rounds = drafted = accepted = 0
            owed, arrived = 0, 0.0     # verdicts still to come of a run of plain rounds; when the last came
            while True:
                if not owed:
                    draft, propose_s = await pending
                    if control is not None and draft.tokens:
                        draft = draft.prefix(control.fit(len(draft.tokens), draft.kind))
                    # Plain rounds in a row go as one request: the verify worker decodes them
                    # back to back without waiting for a round trip each.
                    run = control.plain_run() if control is not None and not draft.tokens else 1
                    if self.pipeline and draft.tokens and drafter.uses_model:
                        # While the target verifies, draft on as if it accepted everything: the
                        # draft's own next token is its guess of the bonus token.
                        ahead = self._propose(state, tokens + draft.tokens, request.num_speculative_tokens + 1)
                continued = owed > 0           # not a round trip: the next verdict of a plain run
                with telemetry.span("speculation round") as span:
                    if continued:
                        propose_s, owed = 0.0, owed - 1
                        verdict, rtt_s = await self._read_verdict(call, context, arrived)
                    else:
                        verdict, rtt_s = await self._verify_round(call, context, draft, run)
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
                checked = len(draft.tokens) - verdict.unverified    # what the target judged
                metrics.observe_verdict(drafter.name, checked, verdict.accepted)
                rounds, drafted, accepted = rounds + 1, drafted + checked, accepted + verdict.accepted
                if control is not None:
                    control.observe(checked, len(verdict.token_ids), propose_s + rtt_s,
                                    verdict.accepted, verdict.token_cost,
                                    plain_instead(rtt_s, checked, verdict.position_seconds) if checked else None)
                tokens.extend(verdict.token_ids)
                chunk = pb.TokenChunk(token_ids=verdict.token_ids, draft_tokens=checked,
                                      accepted_tokens=verdict.accepted, stop_reason=verdict.stop_reason,
                                      cached_tokens=cached, logprobs=verdict.logprobs,
                                      prompt_logprobs=prompt_reports)
                cached, prompt_reports = 0, ()
                if verdict.stop_reason:
                    yield chunk
                    break
                if not owed:
                    pending = await self._next_proposal(state, tokens, next_k(), draft, verdict, ahead)
                    ahead = None
                yield chunk
            log.info("speculation finished", extra={"fields": {
                "method": drafter.name, "rounds": rounds, "draft_tokens": drafted, "accepted_tokens": accepted,
                "generated_tokens": len(tokens) - len(prompt), "verify_worker": request.verify_address}})
            await call.done_writing()
            # Read the stream to its end so the call (and its client span) closes now, not at GC.
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as e:
            # Marked, so the gateway moves the session off that verify worker, not off this one.
            await self._relay(context, request.verify_address, e.code(), e.details())
        except SamplingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.InvalidStateError:
            # The verify stream ended (its worker died or stopped) while a proposal was being written.
            code = await call.code()
            await self._relay(context, request.verify_address,
                              grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code, await call.details())
        finally:
            self.sessions.pop(id(context), None)
            call.cancel()
            for job in (pending, ahead):
                if job is not None and not job.done():
                    job.cancel()                 # its result is not needed; close runs after it
            if state is not None:
                await self.inference.run(state.close)

    @staticmethod
    async def _relay(context, address: str, code: grpc.StatusCode, details: str) -> None:
        """Ends the request with the verify worker's error, marked as the verify worker's. Its
        address goes to the log, not into the message, which may reach a client."""
        if code not in wire.ANSWERS:
            log.warning("verify worker %s: %s: %s", address, code.name, details)
        await context.abort(code, f"verify worker: {details}", trailing_metadata=wire.FAILED_VERIFY)

    async def _next_proposal(self, state, tokens: list[int], k: int, draft: Draft, verdict: pb.Verdict,
                             ahead: asyncio.Future | None) -> asyncio.Future:
        """The next proposal, drafting while the last chunk travels to the gateway. A pipelined
        draft (`ahead`) is used when the target accepted the whole proposal and its bonus token is
        the draft's guess; otherwise the drafter rolls back and drafts again."""
        if ahead is not None:
            waited = time.perf_counter()
            early, _ = await ahead
            waited = time.perf_counter() - waited          # what the pipelined draft still cost
            rest = early.tokens[1:1 + k]
            if k and rest and verdict.accepted == len(draft.tokens) and early.tokens[0] == verdict.token_ids[-1]:
                support = early.support[1:1 + k] if early.support is not None else None
                metrics.PIPELINED.labels("used").inc()
                done = asyncio.get_running_loop().create_future()
                done.set_result((Draft(rest, support), waited))
                return done
            metrics.PIPELINED.labels("discarded").inc()
        return self._propose(state, tokens, k)

    def _propose(self, state, tokens: list[int], k: int) -> asyncio.Future:
        """Drafts the next proposal in the background: (Draft, seconds until it was ready)."""
        if state.inline:
            start = time.perf_counter()
            done = asyncio.get_running_loop().create_future()
            done.set_result((state.propose(tokens, k), time.perf_counter() - start))
            return done
        if self.batcher is None:
            return asyncio.ensure_future(self.inference.run_timed(state.propose, tokens, k))

        async def batched():
            start = time.perf_counter()
            return await state.propose_batched(self.batcher, tokens, k), time.perf_counter() - start
        return asyncio.ensure_future(batched())

    async def _verify_round(self, call, context, draft: Draft, run: int = 1) -> tuple[pb.Verdict, float]:
        """Sends one proposal (or, with no tokens, a run of `run` plain rounds) and reads its first
        verdict: (verdict, round-trip seconds)."""
        proposal = pb.Proposal(token_ids=draft.tokens, plain_steps=run if run > 1 else 0)
        if draft.support is not None:
            proposal.distributions.extend(wire.support_to_proto(i, p) for i, p in draft.support)
        sent = time.perf_counter()
        await call.write(pb.VerifyRequest(proposal=proposal))
        return await self._read_verdict(call, context, sent)

    async def _read_verdict(self, call, context, since: float) -> tuple[pb.Verdict, float]:
        """The next verdict, and the seconds from `since` to its arrival."""
        verdict = (await self._read(call, context)).verdict
        return verdict, time.perf_counter() - since

    async def Status(self, request, context) -> pb.WorkerStatus:
        kv = sum(s.kv_bytes() for s in self.sessions.values())
        return pb.WorkerStatus(model=",".join(sorted(self.drafters)), live_sessions=len(self.sessions),
                               kv_bytes=kv)

    @staticmethod
    async def _read(call, context) -> pb.VerifyResponse:
        msg = await call.read()
        if msg is grpc.aio.EOF:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "verify worker closed the session stream",
                                trailing_metadata=wire.FAILED_VERIFY)
        return msg

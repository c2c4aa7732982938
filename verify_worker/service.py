"""VerifyService: a thin adapter from gRPC streams to the VerifyEngine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from functools import partial

import grpc

from tandem.engine.batcher import Batcher, Ran, Step
from tandem.service import logs, metrics, telemetry, wire
from tandem.service.telemetry import round_attributes
from tandem.speculation.grammar import GrammarError, Grammars, Matcher
from tandem.speculation.survival import Survival
from tandem.v1 import internal_pb2 as pb
from tandem.v1 import internal_pb2_grpc as pb_grpc
from verify_worker.engine import ProtocolError, TargetSession, VerifyEngine
from verify_worker.kvstore import KVBudgetExceeded, SessionKeeper
from verify_worker.price import TokenPrice, report_pass_speed
from verify_worker.rounds import OWN_METHODS, OwnDrafting, Plain
from verify_worker.streamed import HALF_CLOSE_S, StreamedRun, read_pieces

log = logging.getLogger(__name__)


class VerifyServicer(pb_grpc.VerifyServiceServicer):
    def __init__(self, engine: VerifyEngine, batcher: Batcher, keeper: SessionKeeper | None = None,
                 prefill_chunk: int = 256, share_prefixes: bool = True, grammars: Grammars | None = None,
                 compile_timeout: float = 10.0, drafting: Sequence[OwnDrafting] = ()) -> None:
        """drafting: the draft methods this worker serves itself beside plain decoding (a trained head)."""
        self.engine = engine
        self.own = {d.method: d for d in (Plain(engine), *drafting)}   # by draft method
        self.grammars = grammars               # None: guided requests are refused
        self.compile_timeout = compile_timeout
        self.share_prefixes = share_prefixes   # copy a prompt prefix's KV from another session
        self.batcher = batcher
        self.keeper = keeper or SessionKeeper(0)
        self.prefill_chunk = prefill_chunk
        model = engine.model
        self.price = TokenPrice(curve=model.pass_ms, alone=model.pass_seconds if model.forward_ms else None)
        batcher.observers.append(lambda sessions, tokens, prefill, seconds:
                                 self.price.observe_pass(tokens, prefill, seconds, sessions))
        batcher.observers.append(partial(report_pass_speed, self.price))
        self.sessions: dict[int, TargetSession] = {}    # by stream, while the stream lives
        self.streamed = Survival()      # acceptance by position of streamed sessions: a new one's prior
        self._export_gauges()

    def _export_gauges(self) -> None:
        keeper = self.keeper

        def used() -> int:
            # Read on the metrics thread while the event loop changes the dicts: list() copies each at once.
            return sum(list(keeper.live.values())) + sum(s.cache.capacity for s in list(keeper.idle.values()))

        metrics.gauge_from(metrics.VERIFY_RUNNING, lambda: len(self.sessions))
        metrics.gauge_from(metrics.VERIFY_IDLE, lambda: len(keeper.idle))
        metrics.gauge_from(metrics.KV_USED, used)
        metrics.gauge_from(metrics.KV_BUDGET, lambda: keeper.budget)
        metrics.gauge_from(metrics.KV_USAGE, lambda: used() / keeper.budget if keeper.budget else 0.0)
        metrics.gauge_from(metrics.VERIFY_QUEUE, lambda: self.batcher.waiting + keeper.waiting)
        metrics.gauge_from(metrics.KV_POOL_BYTES, lambda: self.engine.model.pool.nbytes)
        metrics.gauge_from(metrics.TOKEN_COST, lambda: self.price.value)

    async def _open(self, context, session_id: str, prompt_ids: list[int], sampling,
                    own: OwnDrafting | None = None) -> tuple[TargetSession, int, list]:
        """Admits the session into the KV budget and prefills it; returns it with the number of prompt
        tokens whose KV came from its kept earlier turn, and the prompt tokens' reports (protobuf)
        when the session asks for them. `own`: the worker's own drafting for the session (Decode),
        which gets the prefill's follow-ups and shares prompt prefixes; one that reads states gets
        every prompt position's, so no KV of an earlier turn is reused."""
        states = own is not None and own.reads_states
        logs.session_id.set(session_id)
        try:
            params = wire.check_params(wire.params_from_proto(sampling))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        grammar = await self._grammar(context, params, prompt_ids)
        need = self.engine.capacity(len(prompt_ids), params)

        async def open_session(reuse: TargetSession | None) -> TargetSession:
            if reuse is None:
                return self.engine.open(session_id, prompt_ids, params, grammar=grammar)
            # Between passes: a session whose stream broke mid-round may still be in a pass.
            return await self.batcher.between_passes(self.engine.open, session_id, prompt_ids, params, reuse,
                                                     grammar, not states)

        try:
            session = await self.keeper.place(id(context), session_id, need, open_session,
                                              self.engine.model.pool, self.batcher.between_passes)
        except ProtocolError as e:
            self.keeper.release(id(context), None, keep=False)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVBudgetExceeded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        reports = []
        if own is not None:
            session.drafting = own.open(session)
        if self.share_prefixes and not params.prompt_logprobs:   # prompt logprobs need every row
            donors = [*self.sessions.values(), *self.keeper.idle.values()]
            await self.batcher.between_passes((own or self.own["none"]).share_prefix, session, session.drafting, donors)
        cached = session.cache.length
        with telemetry.span("prefill", {"tandem.prompt_tokens": len(prompt_ids),
                                        "tandem.cached_prompt_tokens": cached}) as span:
            seconds = 0.0
            for chunk in self.engine.prefill_chunks(session, self.prefill_chunk):
                report = partial(self.engine.prompt_report, session, start=session.cache.length)
                if own is not None:
                    report = own.prefill_then(session, session.drafting, report)
                ran = await self.batcher.forward(Step(session.cache, chunk, self.engine.prefill_rows(session),
                                                      report, prefill=True, taps=states))
                seconds += ran.seconds
                reports += ran.value
            if span is not None:
                span.set_attribute("tandem.verify_seconds", seconds)
        self.sessions[id(context)] = session
        computed = len(prompt_ids) - 1 - cached         # the last prompt token is fed with round 1
        metrics.PREFILL_TOKENS.labels("computed").inc(max(0, computed))
        metrics.PREFILL_TOKENS.labels("cached").inc(cached)
        return session, cached, wire.logprobs_to_proto(reports)

    async def _grammar(self, context, params, prompt_ids: list[int]) -> Matcher | None:
        """The guide's matcher after the prompt, compiled (or found in the cache) within the compile
        timeout; a moved request's delivered tokens (the prompt's last `resumed`) are replayed."""
        if params.guide is None:
            return None
        if self.grammars is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this verify worker serves no guided decoding")
        try:
            return await self.grammars.matcher_within(params.guide, self.compile_timeout,
                                                      prompt_ids[len(prompt_ids) - params.resumed:])
        except GrammarError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _close(self, context) -> None:
        session = self.sessions.pop(id(context), None)
        if session is not None:
            self.batcher.leave(session.cache)
        # A session whose stream broke is kept as well as a finished one: its cache holds the KV of
        # its committed tokens (a verdict crops what it rejects before it returns), and the same
        # session moved off a failed draft worker continues on it, reusing the prefix it shares
        # with the new prompt instead of prefilling the prompt and the delivered tokens again.
        self.keeper.release(id(context), session, keep=True)
        if session is not None:
            log.info("session %s", "finished" if session.stop_reason else "ended early", extra={"fields": {
                "prompt_tokens": session.prompt_len, "generated_tokens": session.generated,
                "stop_reason": session.stop_reason,
                "kept_for_next_turn": self.keeper.idle.get(session.session_id) is session}})

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        session = None
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "session already open on this stream")
                    session, cached, prompt_reports = await self._open(
                        context, req.open.session_id, list(req.open.prompt_ids), req.open.sampling)
                    yield pb.VerifyResponse(opened=pb.Opened(
                        cached_tokens=cached, vocab_size=self.engine.model.vocab_size,
                        max_proposal=self.engine.max_proposal, max_context=self.engine.model.max_context,
                        forward_ms=self.engine.model.forward_ms,
                        token_cost=self.price.for_batch(len(self.sessions)), prompt_logprobs=prompt_reports))
                    if req.open.stream:
                        async for response in self._streamed(context, session, request_iterator, req.open):
                            yield response
                        return
                elif kind == "proposal":
                    if session is None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            "proposal before the session was opened")
                    await self._check_owner(context, session)
                    p = req.proposal
                    if p.plain_steps > 1 and p.token_ids:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"plain_steps ({p.plain_steps}) "
                                            f"needs a proposal without tokens, got {len(p.token_ids)}")
                    steps = max(1, p.plain_steps)
                    for step in range(steps):
                        ran = await self._verify(context, session, list(p.token_ids), p.distributions,
                                                 returns=step < steps - 1, parents=list(p.parents) or None)
                        yield self._verdict(ran, len(p.token_ids))
                        if ran.value.stop_reason:
                            return
                else:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty VerifyRequest")
        finally:
            self._close(context)

    async def _streamed(self, context, session: TargetSession, requests, opened: pb.OpenSession):
        """A streamed session's passes (OpenSession.stream): each verifies the part of the run that
        has arrived, and its verdict goes out before the next pass is queued."""
        if not session.params.greedy:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "stream needs a greedy session: sampled proposals carry their distributions")
        most = min(opened.num_speculative_tokens or self.engine.max_proposal, self.engine.max_proposal)
        run = StreamedRun(session, most, lambda: self.price.for_batch(len(self.sessions)), self.price.alone, self.streamed)
        reader = asyncio.create_task(read_pieces(requests, run))
        try:
            while (tokens := await run.next()) is not None:
                await self._check_owner(context, session)
                ran = await self._verify(context, session, tokens, ())
                run.judged(ran.value.token_ids, ran.fed - 1, ran.value.accepted)
                yield self._verdict(ran, len(tokens))
                if ran.value.stop_reason:
                    # Ended under a piece being written, the call fails on the draft side (INTERNAL),
                    # last verdict unread: so it ends once the draft side has closed its side.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(reader), HALF_CLOSE_S)
                    return
            if run.error is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, run.error)
        finally:
            reader.cancel()

    async def _check_owner(self, context, session: TargetSession) -> None:
        if not self.keeper.owns(id(context), session.session_id):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"session {session.session_id} was reopened on another stream")

    def _verdict(self, ran: Ran, proposed: int) -> pb.VerifyResponse:
        """The verdict message of one round that was given `proposed` tokens."""
        verdict = ran.value
        metrics.VERIFY_SECONDS.observe(ran.seconds)
        # The draft worker's round span records this, next to its round-trip time.
        return pb.VerifyResponse(verdict=pb.Verdict(
            accepted=verdict.accepted, token_ids=verdict.token_ids, stop_reason=verdict.stop_reason.wire,
            verify_seconds=ran.seconds, batch_size=ran.batch_size,
            token_cost=self.price.for_batch(max(ran.batch_size, len(self.sessions)), ran.positions),
            unverified=proposed + 1 - ran.fed, checked=ran.fed - 1,
            position_seconds=self.price.position_seconds(ran.batch_size, ran.positions),
            logprobs=wire.logprobs_to_proto(verdict.logprobs or ())))

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        method = request.method or "none"
        own = self.own.get(method)
        if own is None:
            if method in OWN_METHODS:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"this verify worker does not serve draft method {method!r}: {OWN_METHODS[method]}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"method {request.method!r} is not one a verify "
                                f"worker serves ({', '.join(OWN_METHODS)})")
        try:
            session, cached, prompt_reports = await self._open(context, request.session_id,
                                                               list(request.prompt_ids), request.sampling, own)
            await self.batcher.between_passes(own.start, session, session.drafting)
            first = True
            while True:
                with telemetry.span(own.span) as span:
                    step, proposed = own.step(session, session.drafting, self.price.for_batch(len(self.sessions)),
                                              request.num_speculative_tokens)
                    ran = await self._round(context, step)
                    checked, verdict = ran.fed - 1, ran.value
                    if span is not None:
                        span.set_attributes(round_attributes(checked, verdict.accepted, verdict.token_ids,
                                                             ran.batch_size, ran.seconds))
                        if (seconds := own.propose_seconds()) is not None:
                            span.set_attribute("tandem.propose_seconds", seconds)
                metrics.VERIFY_SECONDS.observe(ran.seconds)
                metrics.observe_verdict(method, checked, verdict.accepted)
                yield pb.TokenChunk(token_ids=verdict.token_ids, stop_reason=verdict.stop_reason.wire,
                                    draft_tokens=checked, accepted_tokens=verdict.accepted,
                                    cached_tokens=cached if first else 0,
                                    logprobs=wire.logprobs_to_proto(verdict.logprobs or ()),
                                    prompt_logprobs=prompt_reports if first else ())
                first = False
                if verdict.stop_reason:
                    return
        finally:
            self._close(context)

    async def Status(self, request, context) -> pb.WorkerStatus:
        idle = self.keeper.idle.values()
        return pb.WorkerStatus(model=self.engine.model.name, live_sessions=len(self.sessions),
                               kv_bytes=sum(s.cache.nbytes() for s in self.sessions.values()),
                               idle_sessions=len(idle), idle_kv_bytes=sum(s.cache.nbytes() for s in idle),
                               reserved_kv_tokens=sum(self.keeper.live.values()))

    async def _verify(self, context, session: TargetSession, tokens: list[int], distributions,
                      returns: bool = False, parents: list[int] | None = None) -> Ran:
        """One round (of a chain, or of a token tree with its `parents`) in the next batch; a bad
        proposal aborts this stream only (INVALID_ARGUMENT). returns: this worker decodes the
        session's next round itself right after (a plain run)."""
        draft_probs = partial(wire.dense_draft_probs, distributions, len(tokens), self.engine.model.vocab_size)
        try:
            step = self.engine.round_step(session, tokens, draft_probs, parents, returns)
        except ProtocolError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return await self._round(context, step)

    async def _round(self, context, step: Step) -> Ran:
        """A round's step in the next batch; its bad input aborts this stream only (INVALID_ARGUMENT)."""
        try:
            ran = await self.batcher.forward(step)
            self.price.observe_output(len(ran.value.token_ids))
            return ran
        except (ProtocolError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

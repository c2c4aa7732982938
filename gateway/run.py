"""One request's stream across the workers that serve it: routing, the worker call, migration to
another worker when one fails, and the per-token reports."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import AsyncIterator

import grpc

from gateway.conversation import Conversations, Turn
from gateway.events import Delta, Final, GatewayError, TokenReport, Usage
from gateway.request import GenRequest
from gateway.routing import Route, Router, RoutingError
from gateway.text import IncrementalDetokenizer, StopMatcher, TokenTexts
from tandem.engine.kvpool import kv_need
from tandem.service import logs, metrics, telemetry, wire
from tandem.speculation.finish import Finish
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """What every request's run shares: the tokens' texts, the workers, the sessions, the limits."""
    texts: TokenTexts
    router: Router
    conversations: Conversations
    max_context: int
    max_migrations: int


class RequestRun:
    """One request's stream across the workers that serve it, migrations included."""

    def __init__(self, serving: Serving, req: GenRequest, turn: Turn, timeout: float | None) -> None:
        self.serving, self.req, self.turn = serving, req, turn
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.usage = Usage(prompt_tokens=len(turn.prompt_ids), draft_method=req.method)
        self.detok = IncrementalDetokenizer(serving.texts.tokenizer, turn.prompt_ids)
        self.stops = StopMatcher(req.stop_sequences)
        self.delivered: list[int] = []          # tokens handed to the client so far, in order
        self.prompt_reported = not req.prompt_details
        self.finish = Finish.NONE
        self.stop_token: int | None = None
        self.route = Route("", None, "none")

    def history(self) -> list[int]:
        """The conversation after this turn. Without the EOS it ended on, if any: the verify worker's
        kept cache stops before it too, and a chat template's next turn closes the answer itself."""
        return [*self.turn.prompt_ids, *self.delivered]

    def final(self) -> Final:
        return Final(self.finish, self.usage, self.turn.session_id, self.stops.matched or "", self.stop_token)

    async def events(self) -> AsyncIterator[Delta]:
        failed: set[str] = set()
        router = self.serving.router
        affinity = self.turn.affinity
        numerics = ""             # the first verify worker's: a move keeps to them where it can
        while True:
            # the KV the verify worker reserves for the rest of this request (prompt_ids hold the
            # delivered tokens' place: they are prompt to the next worker after a move)
            need = partial(kv_need, len(self.turn.prompt_ids), self.req.params.max_new_tokens,
                           max_context=self.serving.max_context)
            try:
                self.route = await router.route(self.req.method, affinity, failed, need, numerics)
            except RoutingError as e:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            numerics = numerics or self.route.numerics
            self.usage.draft_method = self.route.method
            router.hold(self.route)
            try:
                async for delta in self._attempt():
                    yield delta
                return
            except _Respeculate:
                metrics.LINK_FALLBACKS.labels("retry").inc()
                affinity = self.route.verify
                continue
            except _WorkerLost as lost:
                if await self._link_fault(lost):
                    affinity = self.route.verify
                    continue
                router.failed(lost.address)
                failed.add(lost.address)
                if lost.address == self.route.draft:
                    affinity = self.route.verify       # it keeps the session's KV: continue there
                if self.usage.migrations >= self.serving.max_migrations:
                    log.warning("session %s: %s; giving up", self.turn.session_id, lost.message)
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                       f"the {lost.role} serving this request failed; gave up after "
                                       f"{self.usage.migrations} migrations (the limit per request)") from None
                self.usage.migrations += 1
                metrics.MIGRATIONS.inc()
                telemetry.event("migration", {"tandem.failed_worker": lost.address,
                                              "tandem.delivered_tokens": len(self.delivered)})
                log.warning("session %s: %s; moving it after %d delivered tokens (migration %d)",
                            self.turn.session_id, lost.message, len(self.delivered), self.usage.migrations)
            finally:
                router.release(self.route)

    async def _attempt(self) -> AsyncIterator[Delta]:
        """Streams from one pair of workers, continuing after the tokens already delivered."""
        route, req = self.route, self.req
        done = len(self.delivered)
        params = replace(req.params, max_new_tokens=req.params.max_new_tokens - done,
                         min_new_tokens=max(0, req.params.min_new_tokens - done), resumed=done,
                         prompt_logprobs=req.params.prompt_logprobs and not self.prompt_reported)
        prompt = [*self.turn.prompt_ids, *self.delivered]
        timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        sampling = wire.params_to_proto(params)
        channel = self.serving.router.channel
        if route.draft is None:
            address = route.verify
            call = ipb_grpc.VerifyServiceStub(channel(route.verify)).Decode(
                ipb.DecodeRequest(session_id=self.turn.session_id, prompt_ids=prompt, sampling=sampling,
                                  method=route.method if route.method != "none" else "", num_speculative_tokens=req.k),
                timeout=timeout, metadata=logs.outgoing_metadata())
        else:
            address = route.draft
            call = ipb_grpc.DraftServiceStub(channel(route.draft)).Generate(
                ipb.DraftGenerateRequest(session_id=self.turn.session_id, prompt_ids=prompt, sampling=sampling,
                                         method=route.method, num_speculative_tokens=req.k,
                                         verify_address=route.verify),
                timeout=timeout, metadata=logs.outgoing_metadata())
        try:
            async for chunk in call:
                if not self.delivered:
                    self.usage.cached_prompt_tokens = chunk.cached_tokens
                delta = self._take(chunk, address)
                if delta is not None:
                    yield delta
                await self.serving.conversations.keepalive(self.turn)
                if self.finish:
                    if chunk.stop_reason and telemetry.enabled():
                        await _drain(call)
                    return
                if route.retry_at is not None and time.monotonic() >= route.retry_at:
                    raise _Respeculate()
        except grpc.aio.AioRpcError as e:
            lost = _lost_worker(e, route)
            if lost is None:
                raise _downstream_error(e, address, _role(address, route)) from None
            raise _WorkerLost(lost, _role(lost, route), f"failed: {e.code().name}: {e.details()}") from None
        finally:
            call.cancel()
        raise _WorkerLost(address, _role(address, route), "ended the stream early")

    async def _link_fault(self, lost: _WorkerLost) -> bool:
        """Whether the verify worker the draft worker reported lost still answers this gateway: then
        the link between the two failed (a partition, a stall, a reset), not the worker, which keeps
        the session's KV. Requests there decode on it plainly for a while (Router.link_failed)."""
        route = self.route
        if route.draft is None or lost.address != route.verify:
            return False
        try:
            await ipb_grpc.VerifyServiceStub(self.serving.router.channel(route.verify)).Status(
                ipb.StatusRequest(), timeout=LINK_PROBE_S)
        except grpc.aio.AioRpcError:
            return False
        self.serving.router.link_failed(route.draft, route.verify)
        metrics.LINK_FALLBACKS.labels("fallback").inc()
        telemetry.event("link fault", {"tandem.draft_worker": route.draft, "tandem.verify_worker": route.verify,
                                       "tandem.delivered_tokens": len(self.delivered)})
        log.warning("session %s: the link from draft worker %s to verify worker %s failed (%s); decoding on "
                    "without speculation for %.0fs", self.turn.session_id, route.draft, route.verify, lost.message,
                    self.serving.router.link_seconds)
        return True

    def _take(self, chunk: ipb.TokenChunk, address: str) -> Delta | None:
        ids = self._until_stop_token(list(chunk.token_ids))
        u = self.usage
        u.generated_tokens += len(ids)
        u.draft_tokens += chunk.draft_tokens
        u.accepted_tokens += chunk.accepted_tokens
        u.forced_tokens += chunk.forced_tokens
        u.forced_accepted_tokens += chunk.forced_accepted
        u.verify_rounds += 1
        details, prompt_details = self._reports(chunk, ids, address)
        self.delivered.extend(ids)
        text = self.detok.add(ids)
        if chunk.stop_reason:
            try:
                stopped = Finish.from_wire(chunk.stop_reason)
            except ValueError:
                log.error("worker %s sent unknown stop reason %d", address, chunk.stop_reason)
                raise GatewayError(grpc.StatusCode.INTERNAL, f"a worker sent unknown stop reason {chunk.stop_reason}") from None
            text += self.detok.flush()
        text = self.stops.feed(text)
        if self.stops.matched is not None:
            self.finish = Finish.STOP_SEQUENCE
            text += self.stops.matched if self.req.include_stop_sequence else ""
        elif self.stop_token is not None:
            self.finish = Finish.STOP_TOKEN
            text += self.detok.flush() + self.stops.flush()
        elif chunk.stop_reason:
            self.finish = stopped
            text += self.stops.flush()
        if not (text or ids or prompt_details):
            return None
        return Delta(text, len(ids), details, prompt_details)

    def _until_stop_token(self, ids: list[int]) -> list[int]:
        """ids up to and including the first of the request's stop tokens past min_new_tokens."""
        stops = self.req.stop_token_ids
        if stops:
            first = max(0, self.req.params.min_new_tokens - len(self.delivered))
            for i in range(first, len(ids)):
                if ids[i] in stops:
                    self.stop_token = ids[i]
                    return ids[:i + 1]
        return ids

    def _reports(self, chunk: ipb.TokenChunk, ids: list[int], address: str
                 ) -> tuple[list[TokenReport], list[TokenReport] | None]:
        """The details of the chunk's tokens `ids` (cut at a stop token) and, the first time, the
        prompt's, as the request asked."""
        texts, params = self.serving.texts, self.req.params
        try:
            reports = wire.logprobs_from_proto(chunk.token_ids, chunk.logprobs)[:len(ids)] if params.reports else None
            details = texts.reports(ids, reports) if self.req.token_details else []
            prompt = None
            if not self.prompt_reported:
                asked = self.turn.prompt_ids      # never empty; its first token has nothing before it
                rest = (wire.logprobs_from_proto(asked[1:], chunk.prompt_logprobs) if params.prompt_logprobs
                        else None)
                prompt = [TokenReport(asked[0], texts.text(asked[0])), *texts.reports(asked[1:], rest)]
                self.prompt_reported = True
        except ValueError as e:
            log.error("worker %s sent malformed logprobs: %s", address, e)
            raise GatewayError(grpc.StatusCode.INTERNAL, "a worker sent malformed logprobs") from None
        return details, prompt


async def _drain(call, timeout: float = 1.0) -> None:
    """Reads a worker stream that has sent its last chunk to its end. Only with tracing on: the
    call's client span ends when its stream does, and a cancelled call would leave it to the
    garbage collector. The worker ends the stream right after its last chunk."""
    try:
        async with asyncio.timeout(timeout):
            async for _ in call:
                pass
    except (TimeoutError, grpc.aio.AioRpcError):
        pass


# How long the gateway waits for a verify worker's answer to decide whether it or its link failed.
LINK_PROBE_S = 1.0


class _Respeculate(Exception):
    """Plain decoding after a link fault has lasted its while: try speculation again."""


class _WorkerLost(Exception):
    def __init__(self, address: str, role: str, what: str) -> None:
        self.message = f"{role} {address} {what}"       # for the log; clients hear the role only
        super().__init__(self.message)
        self.address, self.role = address, role


# How a stream ends when its worker died or stopped under it: UNAVAILABLE (connection lost),
# INTERNAL or CANCELLED (the server cut the RPC at the end of its drain), UNKNOWN (an unexpected
# error). A worker's deliberate answers (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) and the
# request's own DEADLINE_EXCEEDED would be the same anywhere, so they are not retried.
_WORKER_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED,
                          grpc.StatusCode.UNKNOWN})


def _lost_worker(e: grpc.aio.AioRpcError, route: Route) -> str | None:
    """The worker to move away from after this error, or None when moving would not help."""
    if e.code() not in _WORKER_LOST:
        return None
    if route.draft is None:
        return route.verify
    trailers = dict(e.trailing_metadata() or ())
    return route.verify if trailers.get(wire.FAILED_HOP) == "verify" else route.draft


def _role(address: str, route: Route) -> str:
    return "draft worker" if address == route.draft else "verify worker"


def _downstream_error(e: grpc.aio.AioRpcError, address: str, role: str) -> GatewayError:
    """The client's error for a worker's: a worker's own answer (a bad request, no room, the
    deadline) passes on; a failure names the kind of worker, not its address, which stays in the
    log (so do gRPC's connection details, which name addresses too)."""
    code = e.code()
    if code in wire.ANSWERS:
        return GatewayError(code, e.details() or code.name)
    log.warning("%s %s failed: %s: %s", role, address, code.name, e.details())
    return GatewayError(grpc.StatusCode.INTERNAL, f"the {role} failed ({code.name})")

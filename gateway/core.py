"""The gateway's core, shared by the tandem.v1 and TGIS faces: tokenize, route, stream text."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import AsyncIterator

import grpc

from gateway.conversation import Conversations, SessionBusy, SessionUnavailable, Turn
from gateway.request import GenRequest, InvalidRequest
from gateway.routing import Route, Router, RoutingError
from gateway.text import IncrementalDetokenizer, StopMatcher
from tandem.engine.kvpool import kv_need
from tandem.service import logs, metrics, telemetry, wire
from tandem.speculation.finish import Finish
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc

log = logging.getLogger(__name__)

_ANSWER_MARK = "\x00tandem-answer\x00"


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def answers(method):
    """Wraps a servicer method (unary or server-streaming): a request that can never work ends
    with INVALID_ARGUMENT and its message, a GatewayError with its own status."""
    async def abort(context, e: Exception) -> None:
        if isinstance(e, InvalidRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await context.abort(e.code, e.message)

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                async for message in method(self, request, context):
                    yield message
            except (InvalidRequest, GatewayError) as e:
                await abort(context, e)
        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except (InvalidRequest, GatewayError) as e:
            await abort(context, e)
    return unary


@dataclass
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_rounds: int = 0
    draft_method: str = "none"
    cached_prompt_tokens: int = 0      # prompt tokens whose KV a verify worker kept from an earlier turn
    migrations: int = 0                # times the request moved after a worker failed

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify round, the bonus token included (1.0 = plain decoding)."""
        return self.generated_tokens / self.verify_rounds if self.verify_rounds else 0.0


@dataclass(frozen=True)
class TokenReport:
    """One token as a client sees it: id, text as the tokenizer decodes it alone, and what the
    target's raw distribution said of it when the request asked (tandem/speculation/logprobs.py)."""
    token_id: int
    text: str
    logprob: float | None = None        # None: not asked, or the first prompt token (nothing before it)
    rank: int = 0
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass
class Delta:
    text: str
    token_count: int
    tokens: list[TokenReport] = field(default_factory=list)   # when the request asked for token details
    prompt_tokens: list[TokenReport] | None = None            # first delta only, when asked


@dataclass
class Final:
    finish_reason: Finish
    usage: Usage
    session_id: str
    stop_sequence: str = ""


class GenerationCore:
    def __init__(self, tokenizer, model_name: str, max_context: int, router: Router,
                 conversations: Conversations | None = None, max_migrations: int = 3,
                 trace_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.router = router
        self.conversations = conversations or Conversations(None)
        self.max_migrations = max_migrations
        self.trace_content = trace_content      # prompt and completion text on request spans
        self._texts: dict[int, str] = {}         # token id -> its text alone, bounded by the vocabulary

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_reports(self, ids, reports) -> list[TokenReport]:
        """ids with their logprob reports (None: ids and text only)."""
        if reports is None:
            return [TokenReport(int(t), self.token_text(int(t))) for t in ids]
        return [TokenReport(r.token_id, self.token_text(r.token_id), r.logprob, r.rank,
                            tuple((t, self.token_text(t), lp) for t, lp in r.top)) for r in reports]

    def observer(self, api: str):
        """A RequestObserver for one generation through the public API `api`."""
        from gateway.observe import RequestObserver
        return RequestObserver(api, self.model_name, self.trace_content)

    # ---- input ----

    def encode_prompt(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequest("prompt must not be empty")
        return list(self.tokenizer(text).input_ids)

    def encode_chat(self, messages: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
        """(ids as a conversation's first turn, ids as a later turn of a session)."""
        if not messages:
            raise InvalidRequest("chat.messages must not be empty")
        for i, (role, _) in enumerate(messages):
            if role not in ("system", "user", "assistant"):
                raise InvalidRequest(f"chat.messages[{i}].role must be system, user or assistant, got {role!r}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(f"model {self.model_name} has no chat template; send a plain prompt")
        msgs = [{"role": r, "content": c} for r, c in messages]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        # A later turn follows the model's last answer: render the messages after a stand-in answer
        # and keep what comes after it. That closes the answer the way the template does (also one
        # cut by max_new_tokens) and does not repeat a default system prompt mid-conversation.
        probe = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _ANSWER_MARK}]
        full = self.tokenizer.apply_chat_template(probe + msgs, tokenize=False, add_generation_prompt=True)
        later = full[full.index(_ANSWER_MARK) + len(_ANSWER_MARK):] if _ANSWER_MARK in full else text
        encode = lambda t: list(self.tokenizer(t, add_special_tokens=False).input_ids)  # noqa: E731
        return encode(text), encode(later)

    def encode_continuation(self, text: str) -> list[int]:
        """A plain prompt as a later turn of a session: no BOS or other special tokens in between."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def check_length(self, prompt_ids: list[int], max_prompt_tokens: int = 0) -> None:
        """max_prompt_tokens: the operator's limit (--max-prompt-tokens), 0 = the context window."""
        if not prompt_ids:
            raise InvalidRequest("prompt must not be empty")
        if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
            raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the limit is {max_prompt_tokens}")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the model's context is "
                                 f"{self.max_context} tokens and at least one must be left to generate")

    # ---- generation ----

    async def stream(self, req: GenRequest, timeout: float | None) -> AsyncIterator[Delta | Final]:
        """Yields text deltas, then one Final. A worker lost mid-stream is replaced: the request is
        re-issued elsewhere with the tokens already delivered appended to its prompt, so the client
        sees every token once (and, under greedy decoding, exactly the uninterrupted output)."""
        self.check_length(req.prompt_ids)
        session_id = req.session_id or uuid.uuid4().hex
        logs.session_id.set(session_id)
        try:
            turn = await self.conversations.begin(session_id, req.prompt_ids,
                                                  req.continuation_ids or req.prompt_ids, fresh=not req.session_id)
        except SessionBusy as e:
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except SessionUnavailable as e:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        finished = False
        try:
            if len(turn.prompt_ids) >= self.max_context:
                raise InvalidRequest(f"session {session_id} would be {len(turn.prompt_ids)} tokens with this turn; "
                                     f"the model's context is {self.max_context} tokens")
            run = _Run(self, req, turn, timeout)
            async for event in run.events():
                yield event
            await self.conversations.finish(turn, run.history(), run.route.verify, run.route.draft,
                                            asdict(req.params))
            finished = True
            yield run.final()
        finally:
            if not finished:
                await self.conversations.release(turn)


class _Run:
    """One request's stream across the workers that serve it, migrations included."""

    def __init__(self, core: GenerationCore, req: GenRequest, turn: Turn, timeout: float | None) -> None:
        self.core, self.req, self.turn = core, req, turn
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.usage = Usage(prompt_tokens=len(turn.prompt_ids), draft_method=req.method)
        self.detok = IncrementalDetokenizer(core.tokenizer, turn.prompt_ids)
        self.stops = StopMatcher(req.stop_sequences)
        self.delivered: list[int] = []          # tokens handed to the client so far, in order
        self.prompt_reported = not req.prompt_details
        self.finish = Finish.NONE
        self.route = Route("", None, "none")

    def history(self) -> list[int]:
        """The conversation after this turn. Without the EOS it ended on, if any: the verify worker's
        kept cache stops before it too, and a chat template's next turn closes the answer itself."""
        return [*self.turn.prompt_ids, *self.delivered]

    def final(self) -> Final:
        return Final(self.finish, self.usage, self.turn.session_id, self.stops.matched or "")

    async def events(self) -> AsyncIterator[Delta]:
        failed: set[str] = set()
        router = self.core.router
        affinity = self.turn.affinity
        while True:
            # the KV the verify worker reserves for the rest of this request (prompt_ids hold the
            # delivered tokens' place: they are prompt to the next worker after a move)
            need = partial(kv_need, len(self.turn.prompt_ids), self.req.params.max_new_tokens,
                           max_context=self.core.max_context)
            try:
                self.route = await router.route(self.req.method, affinity, failed, need)
            except RoutingError as e:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
            self.usage.draft_method = self.route.method
            router.hold(self.route)
            try:
                async for delta in self._attempt():
                    yield delta
                return
            except _WorkerLost as lost:
                router.failed(lost.address)
                failed.add(lost.address)
                if lost.address == self.route.draft:
                    affinity = self.route.verify       # it keeps the session's KV: continue there
                if self.usage.migrations >= self.core.max_migrations:
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
        channel = self.core.router.channel
        if route.draft is None:
            address = route.verify
            call = ipb_grpc.VerifyServiceStub(channel(route.verify)).Decode(
                ipb.DecodeRequest(session_id=self.turn.session_id, prompt_ids=prompt, sampling=sampling),
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
                await self.core.conversations.keepalive(self.turn)
                if self.finish:
                    if chunk.stop_reason and telemetry.enabled():
                        await _drain(call)
                    return
        except grpc.aio.AioRpcError as e:
            lost = _lost_worker(e, route)
            if lost is None:
                raise _downstream_error(e, address, _role(address, route)) from None
            raise _WorkerLost(lost, _role(lost, route), f"failed: {e.code().name}: {e.details()}") from None
        finally:
            call.cancel()
        raise _WorkerLost(address, _role(address, route), "ended the stream early")

    def _take(self, chunk: ipb.TokenChunk, address: str) -> Delta | None:
        u = self.usage
        u.generated_tokens += len(chunk.token_ids)
        u.draft_tokens += chunk.draft_tokens
        u.accepted_tokens += chunk.accepted_tokens
        u.verify_rounds += 1
        details, prompt_details = self._reports(chunk, address)
        self.delivered.extend(chunk.token_ids)
        text = self.detok.add(list(chunk.token_ids))
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
        elif chunk.stop_reason:
            self.finish = stopped
            text += self.stops.flush()
        if not (text or chunk.token_ids or prompt_details):
            return None
        return Delta(text, len(chunk.token_ids), details, prompt_details)

    def _reports(self, chunk: ipb.TokenChunk, address: str) -> tuple[list[TokenReport], list[TokenReport] | None]:
        """The chunk's token details and, the first time, the prompt's, as the request asked."""
        core, params = self.core, self.req.params
        try:
            reports = wire.logprobs_from_proto(chunk.token_ids, chunk.logprobs) if params.reports else None
            details = core.token_reports(chunk.token_ids, reports) if self.req.token_details else []
            prompt = None
            if not self.prompt_reported:
                ids = self.turn.prompt_ids        # never empty; its first token has nothing before it
                rest = (wire.logprobs_from_proto(ids[1:], chunk.prompt_logprobs) if params.prompt_logprobs
                        else None)
                prompt = [TokenReport(ids[0], core.token_text(ids[0])), *core.token_reports(ids[1:], rest)]
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

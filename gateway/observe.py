"""What the gateway records about each generation: its request span (OpenTelemetry GenAI semantic
conventions), the request metrics (outcome, TTFT, inter-token latency, end-to-end latency) and
the request's log context. The public faces wrap each generation in one RequestObserver, so
both APIs are measured the same way and the servicers stay thin.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc

from gateway.events import Delta, Final, GatewayError
from gateway.request import GenRequest, InvalidRequest
from tandem.service import logs, metrics, telemetry

log = logging.getLogger("gateway.requests")

OP_CHAT, OP_TEXT = "chat", "text_completion"      # gen_ai.operation.name values


class Load:
    """The generations this gateway holds now: `running` in all, `waiting` of them with no token
    out yet (routing, a verify worker's queue, prefill). Read by the metrics and GetLoads."""
    running = 0
    waiting = 0

    @property
    def streaming(self) -> int:
        """Those with a token out: what vLLM counts as running."""
        return self.running - self.waiting


LOAD = Load()


def export_load(kv_snapshot) -> None:
    """The load gauges, read at scrape time; kv_snapshot() -> (positions held, budget) of the pool."""
    def kv_usage() -> float:
        used, total = kv_snapshot()
        return used / total if total else 0.0
    metrics.gauge_from(metrics.RUNNING, lambda: LOAD.running)
    metrics.gauge_from(metrics.WAITING, lambda: LOAD.waiting)
    metrics.gauge_from(metrics.VLLM_RUNNING, lambda: LOAD.streaming)
    metrics.gauge_from(metrics.VLLM_WAITING, lambda: LOAD.waiting)
    metrics.gauge_from(metrics.VLLM_KV_USAGE, kv_usage)


def status_of(exc: BaseException) -> tuple[str, grpc.StatusCode]:
    """(outcome, status code) of a generation that ended with `exc`, as its face answers it."""
    if isinstance(exc, InvalidRequest):
        return "error", grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, GatewayError):
        return ("cancelled" if exc.code == grpc.StatusCode.CANCELLED else "error"), exc.code
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled", grpc.StatusCode.CANCELLED      # the client went away or its deadline passed
    return "error", grpc.StatusCode.UNKNOWN


class RequestObserver:
    """One generation, from its arrival at the gateway to its last token (or its error).

    Use as `with observer:`; call begin() once the request is valid and saw() on each event.
    A generation is counted once: at its Final event, or on the exception that ends it. One that
    ends without either (a batch whose validation passed; its jobs count themselves) is not."""

    def __init__(self, api: str, model: str, trace_content: bool = False) -> None:
        self.api, self.model, self.trace_content = api, model, trace_content
        self.arrived = time.perf_counter()
        self.last_token_at: float | None = None
        self.done = False
        self.running = False
        self.waiting = False
        self.span = None
        self._detach = None
        self._parts: list[str] = []

    def __enter__(self) -> "RequestObserver":
        LOAD.running += 1
        LOAD.waiting += 1
        self.running = self.waiting = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.done:
            if exc is not None:
                self._close(*status_of(exc), exc)
            else:
                self._end_span()
        self._not_running()
        return False

    def _not_running(self) -> None:
        self._not_waiting()
        if self.running:
            LOAD.running -= 1
            self.running = False

    def _not_waiting(self) -> None:
        if self.waiting:
            LOAD.waiting -= 1
            self.waiting = False

    def begin(self, req: GenRequest, operation: str, messages: list[tuple[str, str]] | None = None) -> None:
        """The request is valid: starts its span, current so that the worker calls are its children."""
        if not telemetry.enabled():
            return
        from opentelemetry import context, trace
        p = req.params
        attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tandem",
                 "gen_ai.request.model": self.model, "gen_ai.request.max_tokens": p.max_new_tokens,
                 "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
                 "gen_ai.request.top_k": p.top_k, "gen_ai.request.seed": p.seed,
                 "tandem.api": self.api, "tandem.draft_method.requested": req.method,
                 "tandem.spec.num_speculative_tokens": req.k}
        if req.session_id:
            attrs["gen_ai.conversation.id"] = req.session_id
        if logs.request_id.get():
            attrs["tandem.request_id"] = logs.request_id.get()
        if self.trace_content and messages:
            attrs["gen_ai.input.messages"] = json.dumps(
                [{"role": r, "parts": [{"type": "text", "content": c}]} for r, c in messages])
        self.span = telemetry.tracer().start_span(f"{operation} {self.model}", attributes=attrs)
        token = context.attach(trace.set_span_in_context(self.span))
        self._detach = lambda: context.detach(token)

    def saw(self, event: Delta | Final) -> None:
        if isinstance(event, Final):
            self._finish(event)
            return
        if event.token_count <= 0:
            return
        now = time.perf_counter()
        if self.last_token_at is None:
            metrics.TTFT.observe(now - self.arrived)
            self._not_waiting()
        else:
            gap = (now - self.last_token_at) / event.token_count
            for _ in range(event.token_count):
                metrics.ITL.observe(gap)
        self.last_token_at = now
        if self.trace_content:
            self._parts.append(event.text)

    def _finish(self, final: Final) -> None:
        u = final.usage
        metrics.PROMPT_TOKENS.inc(u.prompt_tokens)
        metrics.GENERATION_TOKENS.inc(u.generated_tokens)
        if self.span is not None:
            self.span.set_attributes({
                "gen_ai.response.model": self.model, "gen_ai.response.finish_reasons": [final.finish_reason],
                "gen_ai.conversation.id": final.session_id,
                "gen_ai.usage.input_tokens": u.prompt_tokens, "gen_ai.usage.output_tokens": u.generated_tokens,
                "tandem.usage.draft_tokens": u.draft_tokens, "tandem.usage.accepted_tokens": u.accepted_tokens,
                "tandem.usage.verify_rounds": u.verify_rounds, "tandem.usage.cached_prompt_tokens":
                u.cached_prompt_tokens, "tandem.usage.migrations": u.migrations,
                "tandem.draft_method": u.draft_method})
            if self.trace_content:
                self.span.set_attribute("gen_ai.output.messages", json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": "".join(self._parts)}],
                      "finish_reason": final.finish_reason}]))
        self._close(final.finish_reason, grpc.StatusCode.OK, usage=u)

    def _close(self, outcome: str, code: grpc.StatusCode, exc: BaseException | None = None, usage=None) -> None:
        self.done = True
        self._not_running()
        seconds = time.perf_counter() - self.arrived
        metrics.REQUESTS.labels(self.api, outcome, code.name).inc()
        if code == grpc.StatusCode.OK:
            metrics.E2E.observe(seconds)
        # One access-log line per generation, inside its span so it carries the trace id.
        fields = {"api": self.api, "outcome": outcome, "code": code.name, "seconds": round(seconds, 4)}
        if usage is not None:
            fields.update(prompt_tokens=usage.prompt_tokens, generated_tokens=usage.generated_tokens,
                          draft_tokens=usage.draft_tokens, accepted_tokens=usage.accepted_tokens,
                          draft_method=usage.draft_method, migrations=usage.migrations)
        log.info("generation %s (%s)", outcome, code.name, extra={"fields": fields})
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode
            self.span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                self.span.set_attribute("error.type", code.name)
                self.span.set_status(Status(StatusCode.ERROR, str(exc) if exc else code.name))
        self._end_span()

    def _end_span(self) -> None:
        if self._detach is not None:
            from opentelemetry import trace
            # Detach only in the context that attached it: a generator closed later by the garbage
            # collector runs in another one, where there is nothing of ours to detach.
            if trace.get_current_span() is self.span:
                self._detach()
            self._detach = None
        if self.span is not None:
            self.span.end()
            self.span = None

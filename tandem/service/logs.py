"""Structured logs: one JSON object per line, carrying the request's trace and span ids, its request
id and its session id, so a log line leads to its trace and back.

The request id comes from the client's `x-request-id` metadata (a new one when absent), is echoed
in the response's initial metadata and is forwarded to the workers, whose log lines carry it too.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
import uuid

import grpc

from tandem.service import telemetry
from tandem.service.interceptors import rewrap

REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID = 128

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
session_id: contextvars.ContextVar[str] = contextvars.ContextVar("session_id", default="")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                       + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "service": self.service, "logger": record.name,
               "message": record.getMessage()}
        trace_id, span_id = telemetry.ids()
        for key, value in (("trace_id", trace_id), ("span_id", span_id),
                           ("request_id", request_id.get()), ("session_id", session_id.get())):
            if value:
                out[key] = value
        fields = getattr(record, "fields", None)      # logger.info(..., extra={"fields": {...}})
        if fields:
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)   # kept inside the one line
        return json.dumps(out, ensure_ascii=False)


def setup(level: str, fmt: str = "json", service: str = "tandem") -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    elif fmt == "text":
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise SystemExit(f"--log-format must be json or text, got {fmt!r}")
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def outgoing_metadata() -> tuple[tuple[str, str], ...] | None:
    """Metadata for a call to another worker: the current request id, if any."""
    rid = request_id.get()
    return ((REQUEST_ID_KEY, rid),) if rid else None


def _incoming_id(context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and value:
            return value[:MAX_REQUEST_ID]
    return ""


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Binds each RPC's request id to the context its handler runs in and echoes it back.

    `generate`: make one up when the client sent none (the gateway, where requests enter); the
    workers only carry the one they are given."""

    def __init__(self, generate: bool) -> None:
        self.generate = generate

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method if isinstance(details.method, str) else details.method.decode()
        if handler is None or method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return handler
        return rewrap(handler, self._unary, self._stream)

    async def _bind(self, context) -> None:
        rid = _incoming_id(context) or (uuid.uuid4().hex if self.generate else "")
        request_id.set(rid)
        session_id.set("")
        if rid:
            # Initial metadata reaches the client at once, before the first streamed message, and
            # also on an error status.
            await context.send_initial_metadata(((REQUEST_ID_KEY, rid),))

    def _unary(self, behavior):
        async def run(request, context):
            await self._bind(context)
            return await behavior(request, context)
        return run

    def _stream(self, behavior):
        async def run(request, context):
            await self._bind(context)
            async for response in behavior(request, context):
                yield response
        return run

"""OpenTelemetry tracing, configured only by the standard OTEL_* variables.

OTEL_TRACES_EXPORTER      otlp, console, or both comma-separated; unset or none: nothing is
                          installed, no interceptor and no span is ever made (zero cost)
OTEL_SERVICE_NAME         defaults to the service (gateway, draft_worker, verify_worker)
OTEL_EXPORTER_OTLP_ENDPOINT / _TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL / _TRACES_PROTOCOL
                          grpc (default, as in the Python SDK) or http/protobuf; the exporters
                          read their own variables (headers, timeouts, certificates)
OTEL_TRACES_SAMPLER / _ARG  read by the SDK (e.g. parentbased_traceidratio, 0.1)
OTEL_BSP_*                batch span processor tuning, read by the SDK

One request is one trace: every gRPC server and client carries the instrumentation's aio
interceptors, which pass W3C trace context in the call metadata.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

log = logging.getLogger(__name__)

_provider = None          # the SDK TracerProvider once set up; None: tracing off


def enabled() -> bool:
    return _provider is not None


def _exporter_names() -> list[str]:
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "none")
    return [n.strip().lower() for n in raw.split(",") if n.strip() and n.strip().lower() != "none"]


def _otlp_exporter():
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise SystemExit(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    return OTLPSpanExporter()


def setup(service_name: str, exporter=None) -> bool:
    """Installs the SDK when OTEL_TRACES_EXPORTER asks for it (or `exporter`, a SpanExporter, is
    given: tests pass an in-memory one). Returns whether tracing is on. Idempotent."""
    global _provider
    if _provider is not None:
        return True
    names = _exporter_names()
    if exporter is None and not names:
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    # Resource.create lets explicit attributes win over OTEL_SERVICE_NAME, so only default it.
    named = "OTEL_SERVICE_NAME" in os.environ or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    for name in names:
        if name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        else:
            raise SystemExit(f"OTEL_TRACES_EXPORTER={name!r}: use otlp, console or none")
    if exporter is None:
        trace.set_tracer_provider(provider)     # for any other instrumented library in the process
    _provider = provider
    log.info("tracing on: exporters %s", ",".join(names) or type(exporter).__name__)
    return True


def shutdown() -> None:
    """Flushes spans still queued and turns tracing off; called when a service stops (SIGTERM) so
    none are lost, and by tests. Interceptors already installed keep their provider."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def _not_traced(details) -> bool:
    # Health probes and reflection would fill the trace store with noise.
    method = details.method if isinstance(details.method, str) else details.method.decode()
    return not method.startswith(("/grpc.health.", "/grpc.reflection."))


def server_interceptors() -> list:
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    return [aio_server_interceptor(tracer_provider=_provider, filter_=_not_traced)]


def client_interceptors() -> list:
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors
    return aio_client_interceptors(tracer_provider=_provider, filter_=_not_traced)


def tracer():
    return _provider.get_tracer("tandem")


@contextlib.contextmanager
def span(name: str, attributes: dict | None = None) -> Iterator[object | None]:
    """A child span of the current one, or nothing at all (None) when tracing is off."""
    if _provider is None:
        yield None
        return
    with tracer().start_as_current_span(name, attributes=attributes) as s:
        yield s


def event(name: str, attributes: dict | None = None) -> None:
    """An event on the current span; a no-op when tracing is off."""
    if _provider is None:
        return
    from opentelemetry import trace
    trace.get_current_span().add_event(name, attributes or {})


def ids() -> tuple[str, str]:
    """(trace id, span id) of the current span as hex, or ("", "") outside any recorded span."""
    if _provider is None:
        return "", ""
    from opentelemetry import trace
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def round_attributes(k: int, accepted: int, token_ids, batch_size: int, verify_seconds: float,
                     round_trip_seconds: float | None = None) -> dict:
    """Attributes of one verify round. The bonus token is the target's own token after the accepted
    ones (-1 when the round was cut at a stop before it)."""
    attrs = {"tandem.spec.k": k, "tandem.spec.accepted": accepted,
             "tandem.spec.bonus_token": token_ids[accepted] if len(token_ids) > accepted else -1,
             "tandem.batch_size": batch_size, "tandem.verify_seconds": verify_seconds}
    if round_trip_seconds is not None:
        attrs["tandem.round_trip_seconds"] = round_trip_seconds
    return attrs

"""What every Tandem service shares: an aio gRPC server with health and reflection, logging,
tracing and metrics, and a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.service import logs, metrics, telemetry
from tandem.service.interceptors import MalformedRequestInterceptor
from tandem.service.tls import TlsConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DRAIN_NOTICE_S = 0.5


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    """Larger messages are refused by gRPC itself with RESOURCE_EXHAUSTED, before any parsing."""
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


# A link that stops carrying data (a stalled peer, a partition, a black-holed route) is noticed
# within KEEPALIVE_S + KEEPALIVE_TIMEOUT_S: each side pings the other every KEEPALIVE_S, and a ping
# unanswered for KEEPALIVE_TIMEOUT_S closes the connection, failing its calls with UNAVAILABLE.
# Without this a call on a dead link waits for its deadline, which a generation may not have.
KEEPALIVE_S = 1.0
KEEPALIVE_TIMEOUT_S = 2.0
_KEEPALIVE = [("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
              ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
              ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
              ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
              ("grpc.http2.min_time_between_pings_ms", int(KEEPALIVE_S * 1000)),
              ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000))]
# What a server lets its peers do: ping that often, calls or none, without being told to go away.
_PING_POLICY = [("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 500)),
                ("grpc.http2.max_ping_strikes", 0)]

CHANNEL_OPTIONS = message_options(MAX_MESSAGE_BYTES) + _KEEPALIVE
SERVER_OPTIONS = _KEEPALIVE + _PING_POLICY

# How this process dials the other services: set once at start-up by use_tls (None = plaintext).
_client_tls: TlsConfig | None = None


def use_tls(tls: TlsConfig | None) -> None:
    """Every channel() this process opens from now on uses mutual TLS with `tls` (None: plaintext)."""
    global _client_tls
    _client_tls = tls


def setup_observability(service: str, args) -> None:
    """Logging (--log-level, --log-format), this service's metrics and tracing (OTEL_* variables)
    for one service process."""
    logs.setup(args.log_level, getattr(args, "log_format", "json"), service)
    metrics.register(service)
    telemetry.setup(service)


def channel(address: str) -> grpc.aio.Channel:
    """A channel to another Tandem service (mutual TLS after use_tls), traced when tracing is on."""
    interceptors = telemetry.client_interceptors() or None
    if _client_tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(address, _client_tls.channel_credentials(),
                                   options=CHANNEL_OPTIONS + _client_tls.channel_options(),
                                   interceptors=interceptors)


def service_from_args(service_names: list[str], args, *, entry: bool = False,
                      guard: grpc.aio.ServerInterceptor | None = None) -> "Service":
    """The Service for a process's common flags (add_common_flags); its channels follow the same TLS."""
    from tandem.service.tls import tls_from_args
    tls = tls_from_args(args)
    use_tls(tls)
    return Service(service_names, entry=entry, metrics_host=args.host, metrics_port=args.metrics_port, tls=tls,
                   max_message_bytes=args.max_message_bytes, guard=guard, health_port=args.health_port)


class Service:
    """An aio server with the standard health and reflection services."""

    def __init__(self, service_names: list[str], *, entry: bool = False, metrics_host: str = "127.0.0.1",
                 metrics_port: int = 0, tls: TlsConfig | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 guard: grpc.aio.ServerInterceptor | None = None, health_port: int = 0) -> None:
        """entry: this service is where requests enter (the gateway): it makes up a request id
        for a request that arrives without one, and its TLS asks clients for no certificate.
        tls: None = plaintext. guard: the gateway's authentication and quotas, run before anything
        else so a refused call costs nothing. health_port: a plaintext port serving only the
        health service, for probes that cannot speak TLS (Kubernetes' gRPC probes); 0 = none."""
        # The trace interceptor before the request id, so the request-id binding and the handler run inside its span.
        interceptors = [*([guard] if guard else []), MalformedRequestInterceptor(),
                        *telemetry.server_interceptors(), logs.RequestIdInterceptor(generate=entry)]
        self.server = grpc.aio.server(options=message_options(max_message_bytes) + SERVER_OPTIONS,
                                      interceptors=interceptors)
        self.tls, self.entry, self.health_port = tls, entry, health_port
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.probe_server = None
        if health_port:
            self.probe_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.probe_server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = 0

    def listen(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        if self.tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.tls.server_credentials(public=self.entry))
        if self.port == 0:
            raise SystemExit(f"cannot listen on {address}")
        if self.probe_server is not None and self.probe_server.add_insecure_port(f"{host}:{self.health_port}") == 0:
            raise SystemExit(f"cannot listen on {host}:{self.health_port} (--health-port)")
        log.info("listening on %s (%s)%s", address, "plaintext" if self.tls is None else
                 "TLS" if self.entry else "mutual TLS",
                 f", health only on {self.health_port} (plaintext)" if self.probe_server else "")
        return self.port

    async def _set_all(self, status) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def serve(self, grace_seconds: float, on_ready: Callable[[], None] | None = None,
                    on_started: Callable[[], Awaitable[None]] | None = None,
                    on_stopping: Callable[[], Awaitable[None]] | None = None) -> None:
        """Serves until SIGTERM/SIGINT, then: health NOT_SERVING, on_stopping (a worker leaves the
        registry there, so no new session is routed to it), drain in-flight RPCs for grace_seconds.
        on_started runs once the server listens (a worker joins the registry there)."""
        self.metrics_port = metrics.serve(self.metrics_host, self.metrics_port)
        await self.server.start()
        if self.probe_server is not None:
            await self.probe_server.start()
        if on_started:
            await on_started()
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)
        if on_ready:
            on_ready()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: health NOT_SERVING, draining for up to %.1fs", grace_seconds)
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        if on_stopping:
            await on_stopping()
        # Once draining starts the server refuses every new RPC, health checks included: a short
        # notice first lets probes and balancers read NOT_SERVING instead of a refused connection.
        notice = min(DRAIN_NOTICE_S, grace_seconds)
        await asyncio.sleep(notice)
        await self.server.stop(max(0.0, grace_seconds - notice))
        if self.probe_server is not None:
            await self.probe_server.stop(None)
        telemetry.shutdown()
        log.info("stopped")

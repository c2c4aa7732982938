"""What every Tandem service shares: an aio gRPC server with health and reflection, one inference
thread, logging, tracing and metrics, and a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem import logs, metrics, telemetry

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DRAIN_NOTICE_S = 0.5
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def setup_observability(service: str, args) -> None:
    """Logging (--log-level, --log-format), this service's metrics and tracing (OTEL_* variables)
    for one service process."""
    logs.setup(args.log_level, getattr(args, "log_format", "json"), service)
    metrics.register(service)
    telemetry.setup(service)


def channel(address: str) -> grpc.aio.Channel:
    """A channel to another Tandem service, traced when tracing is on."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                     interceptors=telemetry.client_interceptors() or None)


class InferenceThread:
    """Model work runs here, one job at a time, never on the event loop.

    Every torch op of a worker process belongs on this one thread, model loading and calibration
    included: each thread that runs a parallel op gets its own OpenMP team, and two teams sharing
    the cores made every forward pass of the draft model about 1.6x slower on a 2-core machine."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._waiting = 0         # jobs submitted and not yet started: the queue depth
        self._gauge = metrics.queue_gauge(name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., T], *args) -> tuple[T, float]:
        """(result, seconds the job ran), its wait in the queue excluded."""
        job = _Job(fn, args, self)
        self._move(+1)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)
        finally:
            if not job.started:          # cancelled while waiting: it never left the queue
                self._move(-1)

    def _move(self, n: int) -> None:
        # Changed on the event loop and on the inference thread; += on an int is atomic under the GIL.
        self._waiting += n
        if self._gauge is not None:
            self._gauge.inc(n)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Job:
    """One call to run on the inference thread; it leaves the queue when it starts."""

    def __init__(self, fn: Callable, args: tuple, owner: InferenceThread) -> None:
        self.fn, self.args, self.owner, self.started = fn, args, owner, False

    def __call__(self):
        self.started = True
        self.owner._move(-1)
        t0 = time.perf_counter()
        result = self.fn(*self.args)
        return result, time.perf_counter() - t0


class Service:
    """An aio server with the standard health and reflection services."""

    def __init__(self, service_names: list[str], *, entry: bool = False, metrics_host: str = "127.0.0.1",
                 metrics_port: int = 0) -> None:
        """entry: this service is where requests enter (the gateway): it makes up a request id
        for a request that arrives without one."""
        # The trace interceptor first, so the request-id binding and the handler run inside its span.
        interceptors = [*telemetry.server_interceptors(), logs.RequestIdInterceptor(generate=entry)]
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=interceptors)
        self.metrics_host, self.metrics_port = metrics_host, metrics_port
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = service_names
        reflection.enable_server_reflection(
            [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = 0

    def listen(self, host: str, port: int) -> int:
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise SystemExit(f"cannot listen on {host}:{port}")
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
        telemetry.shutdown()
        log.info("stopped")

"""What every Tandem service shares: an aio gRPC server with health and reflection, one inference
thread, logging, and a graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DRAIN_NOTICE_S = 0.5
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class InferenceThread:
    """Model work runs here, one job at a time, never on the event loop."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Service:
    """An aio server with the standard health and reflection services."""

    def __init__(self, service_names: list[str]) -> None:
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
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
        log.info("stopped")

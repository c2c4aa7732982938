"""Who may call the gateway, and how much: bearer tokens, concurrent streams and a request rate
per client. Everything here runs before a request is parsed, so a refused call costs nothing.

Tokens come from --auth-tokens (a static list) and --auth-tokens-file, one per line:

    TOKEN [NAME [SERVICE ...]]        # SERVICE: tandem, tgis, reflection; none = all of them

The file is re-read when it changes (a rotated Kubernetes Secret), so tokens are added and
revoked without a restart. Tokens are held as SHA-256 digests and never logged: a client is
known by its NAME (or the first characters of its token's digest). Without tokens, a client is
its peer address. Health checks are always open, for probes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from tandem.service.interceptors import rewrap

log = logging.getLogger(__name__)

SERVICES = {"tandem": ("tandem.v1.GenerationService",), "tgis": ("fmaas.GenerationService",),
            "reflection": ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")}
OPEN_PREFIX = "/grpc.health.v1.Health/"
UNAUTHENTICATED = "a valid bearer token is required (metadata authorization: Bearer <token>)"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Client:
    name: str
    services: frozenset[str] = frozenset()     # full gRPC service names; empty = all

    def may_call(self, service: str) -> bool:
        return not self.services or service in self.services


def parse_tokens(text: str, source: str) -> dict[str, Client]:
    """token digest -> Client, from the file format above; raises ValueError naming the line."""
    clients: dict[str, Client] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        token, *rest = fields
        key = digest(token)
        name = rest[0] if rest else f"token-{key[:8]}"
        unknown = [s for s in rest[1:] if s not in SERVICES]
        if unknown:
            raise ValueError(f"{source} line {n}: unknown service {unknown[0]!r}; use {', '.join(SERVICES)}")
        clients[key] = Client(name, frozenset(full for s in rest[1:] for full in SERVICES[s]))
    return clients


class TokenSet:
    """The accepted tokens: a static list plus a file checked for changes at most once a second."""

    def __init__(self, static: list[str], path: str = "", recheck_seconds: float = 1.0) -> None:
        self.static = parse_tokens("\n".join(static), "--auth-tokens")
        self.path, self.recheck_seconds = path, recheck_seconds
        self._from_file: dict[str, Client] = {}
        self._stat: tuple | None = None
        self._checked = float("-inf")
        if path:
            self._reload(strict=True)

    @property
    def enabled(self) -> bool:
        return bool(self.static or self.path)

    def lookup(self, token: str) -> Client | None:
        if self.path and time.monotonic() - self._checked >= self.recheck_seconds:
            self._reload(strict=False)
        key = digest(token)
        return self.static.get(key) or self._from_file.get(key)

    def _reload(self, strict: bool) -> None:
        self._checked = time.monotonic()
        try:
            st = os.stat(self.path)
            stat = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stat == self._stat:
                return
            with open(self.path, encoding="utf-8") as f:
                self._from_file = parse_tokens(f.read(), self.path)
            self._stat = stat
            log.info("loaded %d tokens from %s", len(self._from_file), self.path)
        except (OSError, ValueError) as e:
            if strict:
                raise SystemExit(f"--auth-tokens-file: {e}") from None
            # Mid-rotation the file may be briefly missing or half written: keep the last good set.
            log.warning("keeping the previous tokens: %s", e)


class RateLimiter:
    """A token bucket per client: `rate` requests a second on average, bursts of `burst`."""

    MAX_CLIENTS = 10_000

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, max(1, burst)
        self._buckets: dict[str, tuple[float, float]] = {}     # client -> (tokens, at)

    def allow(self, client: str) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic()
        if len(self._buckets) > self.MAX_CLIENTS:     # forget clients whose bucket is full again
            full = self.burst / self.rate
            self._buckets = {c: v for c, v in self._buckets.items() if now - v[1] < full}
        tokens, at = self._buckets.get(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1:
            self._buckets[client] = (tokens, now)
            return False
        self._buckets[client] = (tokens - 1, now)
        return True


class ClientGuard(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenSet, max_streams_per_client: int = 0, rate: float = 0.0,
                 burst: int = 1) -> None:
        self.tokens = tokens
        self.max_streams = max_streams_per_client     # 0 = unlimited
        self.limiter = RateLimiter(rate, burst)
        self.active: Counter[str] = Counter()          # RPCs in flight per client

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method if isinstance(details.method, str) else details.method.decode()
        if handler is None or method.startswith(OPEN_PREFIX):
            return handler
        service = method.split("/")[1] if method.count("/") >= 2 else method

        async def admit(context) -> str:
            """The client's name, or aborts: UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED."""
            client = self._identify(context, service)
            if isinstance(client, tuple):
                await context.abort(*client)
            if not self.limiter.allow(client):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"request rate limit reached ({self.limiter.rate:g}/s); retry later")
            if self.max_streams and self.active[client] >= self.max_streams:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"at most {self.max_streams} concurrent requests per client")
            self.active[client] += 1
            return client

        def unary(behavior):
            async def run(request, context):
                client = await admit(context)
                try:
                    return await behavior(request, context)
                finally:
                    self._leave(client)
            return run

        def stream(behavior):
            async def run(request, context):
                client = await admit(context)
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    self._leave(client)
            return run

        return rewrap(handler, unary, stream)

    def _identify(self, context, service: str) -> str | tuple[grpc.StatusCode, str]:
        if not self.tokens.enabled:
            peer = context.peer() or "unknown"
            return peer.rsplit(":", 1)[0]          # the address without the port: one client per host
        auth = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        client = self.tokens.lookup(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if client is None:
            return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED
        if not client.may_call(service):
            return grpc.StatusCode.PERMISSION_DENIED, f"this token may not call {service}"
        return client.name

    def _leave(self, client: str) -> None:
        self.active[client] -= 1
        if self.active[client] <= 0:
            del self.active[client]

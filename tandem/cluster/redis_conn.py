"""The Redis connection every service shares, and a private redis-server for local runs and tests.

REDIS_URL (or --redis-url) takes the standard forms: redis://[[user]:password@]host:port/db,
rediss://... for TLS (the server certificate is checked against the system CA store, or against
a private CA with `?ssl_ca_certs=/path/ca.pem`), unix:///path.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix")
# Short timeouts: a Redis outage must turn into a clear UNAVAILABLE within a couple of seconds,
# not stall a request for the client library's default of retries with backoff.
TIMEOUT_S = 2.0


def default_url() -> str:
    return os.environ.get("REDIS_URL") or DEFAULT_URL


def check_url(url: str) -> str:
    """Returns url, or raises ValueError saying what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"Redis URL {redacted(url)!r} must start with redis://, rediss:// or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"Redis URL {redacted(url)!r} has no host")
    return url


def redacted(url: str) -> str:
    """The URL with its password hidden, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    return url.replace(f"{user}:{parts.password}@", f"{user}:***@", 1)


def connect(url: str) -> aioredis.Redis:
    return aioredis.from_url(check_url(url), decode_responses=True, socket_timeout=TIMEOUT_S,
                             socket_connect_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 0))


def answers(url: str, timeout: float = 1.0) -> bool:
    """Whether a Redis server answers PING at url (synchronous: for launchers, before any loop)."""
    import redis
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A private redis-server on a loopback port: no persistence, its own scratch folder."""

    port: int = 0
    password: str = ""
    username: str = ""      # with a password: an ACL user with access to Tandem's keys; default user off
    tls_files: tuple[str, str, str] | None = None    # (cert, key, CA) PEM paths: TLS only, clients need a cert
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f"{self.username}:{self.password}@" if self.password else ""
        if self.tls_files is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        cert, key, ca = self.tls_files
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={ca}&ssl_certfile={cert}&ssl_keyfile={key}"

    def start(self, timeout: float = 10) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; install Redis or set REDIS_URL")
        self.port = self.port or free_port()
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", tempfile.gettempdir(), "--loglevel", "warning"]
        if self.username:
            args += ["--user", "default", "off", "--user", self.username, "on", f">{self.password}",
                     "~tandem:*", "&*", "+@all", "-@dangerous"]
        elif self.password:
            args += ["--requirepass", self.password]
        if self.tls_files is not None:
            cert, key, ca = self.tls_files
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", ca]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not answers(self.url, timeout=0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def ensure_redis() -> tuple[str, RedisServer | None]:
    """For local runs: REDIS_URL if set, else a server answering on 127.0.0.1:6379, else a private
    redis-server on a free port (returned, so the caller stops it on exit)."""
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"], None
    if answers(DEFAULT_URL):
        return DEFAULT_URL, None
    server = RedisServer().start()
    return server.url, server

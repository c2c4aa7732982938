"""The worker registry in Redis: every draft and verify worker announces itself with a heartbeat key
that expires, so a worker that dies vanishes by itself and one that stops cleanly leaves at once.

Keys (prefix `tandem:`):
  worker:{pool}:{address}  JSON WorkerInfo, expires after `ttl` (about three heartbeat intervals)
  workers:{pool}           set of addresses ever announced; members whose key expired are pruned
                           when listed (the set is an index, the heartbeat key is the truth)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

PREFIX = "tandem:"
DRAFT, VERIFY = "draft", "verify"
# The draft methods by the pool that drafts them: a draft worker's, or a verify worker's own, served
# with no draft worker ("none" by every verify worker, the others by those that register them).
DRAFT_POOL_METHODS = ("model", "ngram")
VERIFY_METHODS = ("none", "head")


@dataclass
class WorkerInfo:
    address: str                     # host:port the gateway dials
    pool: str                        # DRAFT or VERIFY
    model: str                       # verify: its target model; draft: the target it drafts for
    methods: list[str] = field(default_factory=list)   # draft methods served: a draft worker's, or
                                                       # a verify worker's own beside "none"
    capacity: int = 0                # KV budget in tokens (0 = not budgeted)
    load: int = 0                    # sessions being served right now
    kv_free: int = 0                 # budget tokens not held by live sessions
    kv_margin: int = 0               # what a session reserves beyond its prompt and new tokens: the
                                     # room of a proposal (tandem.engine.kvpool.proposal_room)
    started_at: float = 0.0          # a restarted worker at the same address has a new value
    links_down: list[str] = field(default_factory=list)   # draft: verify workers its link to is down
    # verify: its --dtype, and what decides its numbers besides the weights
    # (tandem.engine.modeling.CausalLM.numerics): workers of equal numerics give the same tokens
    dtype: str = ""
    numerics: str = ""
    heartbeat_at: float = 0.0


_FIELDS = set(WorkerInfo.__dataclass_fields__)


def _key(pool: str, address: str) -> str:
    return f"{PREFIX}worker:{pool}:{address}"


def _index(pool: str) -> str:
    return f"{PREFIX}workers:{pool}"


class Registry:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def register(self, info: WorkerInfo, ttl: float) -> None:
        info.heartbeat_at = time.time()
        async with self.client.pipeline(transaction=True) as p:
            p.set(_key(info.pool, info.address), json.dumps(asdict(info)), px=int(ttl * 1000))
            p.sadd(_index(info.pool), info.address)
            await p.execute()

    async def deregister(self, pool: str, address: str) -> None:
        async with self.client.pipeline(transaction=True) as p:
            p.delete(_key(pool, address))
            p.srem(_index(pool), address)
            await p.execute()

    async def workers(self, pool: str) -> list[WorkerInfo]:
        """Live workers of a pool (raises RedisError when Redis cannot be reached)."""
        addresses = sorted(await self.client.smembers(_index(pool)))
        if not addresses:
            return []
        values = await self.client.mget([_key(pool, a) for a in addresses])
        live, gone = [], []
        for address, value in zip(addresses, values):
            if value is None:
                gone.append(address)
            else:
                # Fields a newer worker added are skipped, so a gateway can be upgraded after its workers.
                fields = json.loads(value)
                live.append(WorkerInfo(**{k: v for k, v in fields.items() if k in _FIELDS}))
        if gone:
            await self.client.srem(_index(pool), *gone)
        return live


STOP_TIMEOUT_S = 5.0           # longest wait for a beat in flight, and for the deregistration


class Heartbeat:
    """Re-announces a worker every `interval` seconds until stopped; Redis outages are logged and
    ridden out (the worker keeps serving the streams it has, and re-appears when Redis is back)."""

    def __init__(self, registry: Registry, describe: Callable[[], WorkerInfo], interval: float) -> None:
        self.registry = registry
        self.describe = describe
        self.interval = interval
        self.ttl = 3 * interval
        self._task: asyncio.Task | None = None
        self._info: WorkerInfo | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        self._stopping.clear()
        healthy = await self._beat(healthy=True)
        self._task = asyncio.create_task(self._run(healthy))

    async def _beat(self, healthy: bool) -> bool:
        """One announcement; logs only when Redis is lost or back, not at every beat."""
        self._info = self.describe()
        try:
            await self.registry.register(self._info, self.ttl)
        except (RedisError, OSError) as e:
            if healthy:
                log.warning("cannot announce %s worker %s to Redis (retrying every %.1fs): %s",
                            self._info.pool, self._info.address, self.interval, e)
            return False
        if not healthy:
            log.info("Redis answers again; %s worker %s announced", self._info.pool, self._info.address)
        return True

    async def _run(self, healthy: bool) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self.interval)
                return
            except asyncio.TimeoutError:
                healthy = await self._beat(healthy)

    async def stop(self) -> None:
        """Stops announcing and removes the worker from the registry, so no new session is routed here."""
        # The loop is asked to end between beats rather than cancelled: a Redis command cancelled
        # half-way can leave its connection waiting for a reply, and the deregistration after it
        # then never returned, which held up a worker's drain. Both waits are bounded all the same.
        if self._task is not None:
            self._stopping.set()
            try:
                await asyncio.wait_for(self._task, self.interval + STOP_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            self._task = None
        if self._info is not None:
            try:
                await asyncio.wait_for(self.registry.deregister(self._info.pool, self._info.address),
                                       STOP_TIMEOUT_S)
            except (RedisError, OSError, asyncio.TimeoutError) as e:
                log.warning("cannot deregister from Redis (the key expires in %.0fs): %r", self.ttl, e)


def advertise_address(host: str, port: int, override: str = "") -> str:
    """What the gateway should dial: the override, else host:port, with a wildcard host replaced by
    this machine's name (which resolves to its address inside a cluster)."""
    if override:
        return override
    if host in ("0.0.0.0", "::", "[::]", ""):
        import socket
        host = socket.gethostname()
    return f"{host}:{port}"


def heartbeat_for(args, describe: Callable[[], WorkerInfo]) -> Heartbeat:
    """A worker's heartbeat from its flags (--redis-url, --heartbeat-seconds). An unreachable Redis
    is logged, not fatal: the worker serves anyway and is announced once Redis answers."""
    from tandem.cluster.redis_conn import connect
    return Heartbeat(Registry(connect(args.redis_url)), describe, args.heartbeat_seconds)

"""Which workers serve a request: discovered from the Redis registry (or a static list, the fallback
for running without Redis), least-loaded first, the session's own verify worker before any other.
A request that moves after a failure goes on at a verify worker of its first one's numerics (dtype
and kernels) where one is left, so that its later tokens are the ones the first would have given.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from redis.exceptions import RedisError

from tandem.cluster.redis_conn import redacted
from tandem.cluster.registry import DRAFT, VERIFY, VERIFY_METHODS, Registry, WorkerInfo
from tandem.engine.kvpool import proposal_room
from tandem.service import metrics, telemetry
from tandem.service.server import channel as open_channel

log = logging.getLogger(__name__)


class RoutingError(Exception):
    """No worker can take the request now (UNAVAILABLE); the message says why."""


@dataclass(frozen=True)
class Route:
    verify: str
    draft: str | None          # None: the verify worker decodes alone
    method: str                # what runs: "model", "ngram", "head" or "none"
    kv: int = 0                # KV positions the session reserves on its verify worker
    # Decoding plainly because the link from the draft pool to this verify worker failed: the
    # time.monotonic() at which to try speculation again; None otherwise.
    retry_at: float | None = None
    numerics: str = ""         # the verify worker's, as registered ("" where not known)


def no_kv(room: int) -> int:
    return 0


class Router:
    """Shared by both kinds of directory: channels, in-flight counts and recently failed workers."""

    def __init__(self, suspect_seconds: float = 10.0, link_seconds: float = 2.0) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.inflight: Counter[str] = Counter()      # this gateway's streams per worker
        # KV positions this gateway's streams reserve per verify worker. A registry entry's free
        # budget lags by up to a heartbeat; without this, requests sent within one heartbeat would
        # all see the same free budget and pile onto one worker. Once a heartbeat has counted a
        # stream it is subtracted twice, which errs toward routing by load.
        self.reserved: Counter[str] = Counter()
        # A worker that just failed is skipped for a while: its registry entry outlives it until the
        # heartbeat key expires, and a request must not be sent to it again in the meantime.
        self._failed_at: dict[str, float] = {}
        self.suspect_seconds = suspect_seconds
        # (draft, verify) -> when its link failed while both workers answered: that draft worker is
        # not paired with that verify worker for link_seconds (requests there decode plainly).
        self._links_down: dict[tuple[str, str], float] = {}
        self.link_seconds = link_seconds
        self.pool: list[WorkerInfo] = []      # the target's verify workers as last read

    async def verify_pool(self) -> list[WorkerInfo]:
        """The target's verify workers now (RoutingError when they cannot be read)."""
        return self.pool

    def kv_snapshot(self) -> tuple[int, int]:
        """(KV positions held, KV budget) over the verify pool as last read; budgets left unset
        count as neither."""
        budgeted = [w for w in self.pool if w.capacity]
        return sum(w.capacity - w.kv_free for w in budgeted), sum(w.capacity for w in budgeted)

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address)
        return ch

    def failed(self, address: str) -> None:
        self._failed_at[address] = time.monotonic()

    def link_failed(self, draft: str, verify: str) -> None:
        self._links_down[(draft, verify)] = time.monotonic() + self.link_seconds

    async def draft_pool(self) -> list[WorkerInfo] | None:
        """The draft pool as a registry lists it, read once per route and handed to down_links and
        pick_draft; None where the router keeps no registry."""
        return None

    async def down_links(self, verify: str, drafts: list[WorkerInfo] | None = None) -> dict[str, float]:
        """Draft workers whose link to `verify` failed lately, with when each may be tried again."""
        now = time.monotonic()
        for key in [k for k, until in self._links_down.items() if until <= now]:
            del self._links_down[key]
        return {d: until for (d, v), until in self._links_down.items() if v == verify}

    def _usable(self, address: str, exclude: set[str]) -> bool:
        if address in exclude:
            return False
        at = self._failed_at.get(address)
        return at is None or time.monotonic() - at > self.suspect_seconds

    async def route(self, method: str, affinity: str = "", exclude: frozenset[str] | set[str] = frozenset(),
                    need: Callable[[int], int] = no_kv, numerics: str = "") -> Route:
        """need(room): KV positions the session will reserve on a verify worker that keeps `room`
        positions for a proposal (tandem.engine.kvpool.kv_need with the request's lengths).
        numerics: the request's first verify worker's, once it has had one (see pick_verify)."""
        if method in VERIFY_METHODS:        # served by a verify worker alone, no draft worker involved
            wants = "" if method == "none" else method                 # "none": any verify worker
            try:
                verify = await self.pick_verify(affinity, set(exclude), need, method=wants, numerics=numerics)
            except RoutingError:
                if not wants:
                    raise
                verify, method = await self.pick_verify(affinity, set(exclude), need, numerics=numerics), "none"
                self._fell_back(wants, verify, f"no verify worker serving draft method {wants} is available")
            return Route(verify, None, method, need(self.room(verify)), numerics=self.numerics_of(verify))
        verify = await self.pick_verify(affinity, set(exclude), need, numerics=numerics)
        drafts = await self.draft_pool()
        down = await self.down_links(verify, drafts)
        draft = await self.pick_draft(method, set(exclude) | set(down), drafts)
        retry_at = None
        if draft is None:
            if down:
                retry_at = min(down.values())
                self._fell_back(method, verify, f"the link from every {method} draft worker to verify worker "
                                                f"{verify} failed lately")
            else:
                self._fell_back(method, verify, f"no {method} draft worker available")
        return Route(verify, draft, method if draft else "none", need(self.room(verify)), retry_at,
                     self.numerics_of(verify))

    def numerics_of(self, verify: str) -> str:
        return next((w.numerics for w in self.pool if w.address == verify), "")

    @staticmethod
    def _fell_back(method: str, verify: str, why: str) -> None:
        log.warning("%s; decoding with the target alone", why)
        metrics.FALLBACKS.labels(method).inc()
        telemetry.event("fallback", {"tandem.draft_method.requested": method, "tandem.verify_worker": verify})

    def hold(self, route: Route) -> None:
        """Counts a stream on its workers and its KV reservation until release()."""
        self.inflight.update([route.verify, *([route.draft] if route.draft else [])])
        self.reserved[route.verify] += route.kv

    def release(self, route: Route) -> None:
        self.inflight.subtract([route.verify, *([route.draft] if route.draft else [])])
        self.reserved[route.verify] -= route.kv

    def room(self, verify: str) -> int:
        """The proposal room a verify worker keeps per session."""
        return proposal_room()

    async def pick_verify(self, affinity: str, exclude: set[str], need: Callable[[int], int] = no_kv,
                          method: str = "", numerics: str = "") -> str:
        """method: a draft method the worker must serve itself (registered in its methods); "" for
        any. numerics: where given, workers of these numerics come before all others (a move to
        other numerics is counted, tandem_numerics_switches_total)."""
        raise NotImplementedError

    async def pick_draft(self, method: str, exclude: set[str], drafts: list[WorkerInfo] | None = None) -> str | None:
        """drafts: the draft pool as draft_pool() read it (None: the router reads it itself)."""
        raise NotImplementedError

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class StaticRouter(Router):
    """Fixed address lists (--verify-workers / --draft-workers), taken least-busy first."""

    def __init__(self, verify: list[str], draft: list[str]) -> None:
        super().__init__()
        self.verify = [a for a in verify if a]
        self.draft = [a for a in draft if a]

    async def verify_pool(self) -> list[WorkerInfo]:
        """The configured verify workers not recently failed (a static list knows no loads or budgets)."""
        self.pool = [WorkerInfo(a, VERIFY, "", load=self.inflight[a]) for a in self.verify if self._usable(a, set())]
        return self.pool

    def _least_busy(self, addresses: list[str], exclude: set[str]) -> str | None:
        usable = [a for a in addresses if self._usable(a, exclude)]
        return min(usable, key=lambda a: (self.inflight[a], random.random())) if usable else None

    async def pick_verify(self, affinity: str, exclude: set[str], need: Callable[[int], int] = no_kv,
                          method: str = "", numerics: str = "") -> str:
        # A static list says nothing of heads (a worker without one answers FAILED_PRECONDITION) nor of numerics.
        if affinity in self.verify and self._usable(affinity, exclude):
            return affinity
        address = self._least_busy(self.verify, exclude)
        if address is None:
            raise RoutingError("no verify worker is configured" if not self.verify
                               else "every configured verify worker has failed")
        return address

    async def pick_draft(self, method: str, exclude: set[str], drafts: list[WorkerInfo] | None = None) -> str | None:
        return self._least_busy(self.draft, exclude)


class RedisRouter(Router):
    """Workers discovered in the Redis registry, only those serving this gateway's model (at `dtype`,
    where given)."""

    def __init__(self, registry: Registry, model: str, redis_url: str, suspect_seconds: float = 10.0,
                 dtype: str = "") -> None:
        super().__init__(suspect_seconds)
        self.registry = registry
        self.model = model
        self.dtype = dtype
        self._mixed: frozenset[str] = frozenset()     # the numerics last warned of
        self.redis_url = redacted(redis_url)
        self._rooms: dict[str, int] = {}     # verify worker -> its registered proposal room

    async def _workers(self, pool: str) -> list[WorkerInfo]:
        try:
            return await self.registry.workers(pool)
        except (RedisError, OSError) as e:
            raise RoutingError(f"Redis at {self.redis_url} is unreachable, so no worker can be "
                               f"discovered; retry shortly ({e})") from None

    def _least_loaded(self, workers: list[WorkerInfo]) -> WorkerInfo | None:
        # Registered load lags by up to a heartbeat; this gateway's own in-flight count does not.
        return min(workers, key=lambda w: (w.load + self.inflight[w.address], random.random()),
                   default=None)

    def room(self, verify: str) -> int:
        return self._rooms.get(verify, proposal_room())

    async def draft_pool(self) -> list[WorkerInfo]:
        return await self._workers(DRAFT)

    async def down_links(self, verify: str, drafts: list[WorkerInfo] | None = None) -> dict[str, float]:
        """Besides this gateway's own, the links to `verify` that draft workers list as down in the
        registry (found by any gateway, or by the draft worker itself): each is tried again once the
        draft worker's probe finds it up, or after link_seconds at most."""
        own = await super().down_links(verify)
        drafts = await self.draft_pool() if drafts is None else drafts
        listed = [w.address for w in drafts if verify in w.links_down and w.address not in own]
        return own | dict.fromkeys(listed, time.monotonic() + self.link_seconds)

    async def verify_pool(self) -> list[WorkerInfo]:
        self.pool = [w for w in await self._workers(VERIFY)
                     if w.model == self.model and (not self.dtype or w.dtype == self.dtype)]
        mixed = frozenset(w.numerics for w in self.pool)
        if len(mixed) > 1 and mixed != self._mixed:
            log.warning("the verify workers of %s differ in numerics (%s): requests' tokens depend on the "
                        "worker they land on; give them one --dtype and one kind of node, or the gateway "
                        "--verify-dtype", self.model, "; ".join(sorted(n or "not registered" for n in mixed)))
        self._mixed = mixed
        return self.pool

    async def pick_verify(self, affinity: str, exclude: set[str], need: Callable[[int], int] = no_kv,
                          method: str = "", numerics: str = "") -> str:
        workers = [w for w in await self.verify_pool() if not method or method in w.methods]
        self._rooms.update((w.address, w.kv_margin) for w in workers)
        usable = [w for w in workers if self._usable(w.address, exclude)]
        if numerics and usable:
            alike = [w for w in usable if w.numerics == numerics]
            if not alike:
                log.warning("no verify worker of numerics %r is left for this request; it goes on at other "
                            "numerics, so its later tokens may differ from what the first worker would give",
                            numerics)
                metrics.NUMERICS_SWITCHES.inc()
            usable = alike or usable
        # Workers whose KV budget has room for the session (as of their last heartbeat) come first,
        # even before the one holding the session's cache; if none has room, the least loaded one
        # answers for itself (RESOURCE_EXHAUSTED if it is still full).
        usable = [w for w in usable
                  if not w.capacity or w.kv_free - self.reserved[w.address] >= need(w.kv_margin)] or usable
        for w in usable:
            if w.address == affinity:
                return w.address
        best = self._least_loaded(usable)
        if best is None:
            raise RoutingError(f"no verify worker for model {self.model!r}{f' serving {method}' if method else ''}"
                               f"{f' at dtype {self.dtype}' if self.dtype else ''} is registered in Redis"
                               if not workers else
                               f"every verify worker for model {self.model!r} has failed for this request")
        return best.address

    async def pick_draft(self, method: str, exclude: set[str], drafts: list[WorkerInfo] | None = None) -> str | None:
        # A draft worker registered without a target model can only offer model-free n-gram drafting.
        drafts = await self.draft_pool() if drafts is None else drafts
        workers = [w for w in drafts if method in w.methods
                   and (w.model == self.model or (method == "ngram" and not w.model))]
        best = self._least_loaded([w for w in workers if self._usable(w.address, exclude)])
        return best.address if best else None

"""The verify worker's KV budget, in tokens, and the finished sessions kept for their next turn.

A live session reserves prompt + max_new_tokens + one proposal's positions (capped at the context
window) up front, so it can never run out mid-stream. A session that does not fit waits in the
admission queue until space frees or its wait times out. A finished session stays idle with its cache, keyed by session
id, until its next turn takes it back or the space is needed: then the least recently used idle
session is evicted (its next turn is rebuilt from the token history the gateway keeps in Redis).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tandem.engine.kvpool import KVPool, KVPoolFull
from tandem.engine.lru import KeptCaches
from tandem.service import metrics, telemetry
from verify_worker.engine import TargetSession


class KVBudgetExceeded(Exception):
    """A request that does not fit in the KV budget now (RESOURCE_EXHAUSTED after its wait), or
    ever (`never`: RESOURCE_EXHAUSTED at once)."""

    def __init__(self, message: str, never: bool = False) -> None:
        super().__init__(message)
        self.never = never


class SessionKeeper:
    def __init__(self, budget_tokens: int, admission_timeout: float = 0.0) -> None:
        self.budget = budget_tokens           # 0 = unbounded
        self.admission_timeout = admission_timeout
        self.waiting = 0                      # requests in the admission queue
        self._space = asyncio.Event()         # set when a reservation ends or an idle session goes
        self.live: dict[int, int] = {}        # reserved tokens by stream
        self.live_ids: dict[str, int] = {}    # the stream that owns each live session id
        self.idle: KeptCaches[TargetSession] = KeptCaches(lambda s: s.cache, self._evicted)
        self.evictions = 0

    def used(self) -> int:
        return sum(self.live.values()) + self.idle.tokens()

    def free(self) -> int:
        return max(0, self.budget - sum(self.live.values())) if self.budget else 0

    def admit(self, stream: int, session_id: str, need: int) -> TargetSession | None:
        """Reserves `need` tokens for a stream; returns the idle earlier turn of session_id, if kept,
        for its cache to be reused. Raises KVBudgetExceeded.

        A session opened again while a stream still holds it (a migration that outran the news of
        the old draft worker's death) moves to the new stream: the old one no longer owns it
        (see owns) and is refused on its next message, so the two never both extend it."""
        if self.budget and need > self.budget:
            raise KVBudgetExceeded(f"the request needs {need} tokens of KV cache (prompt + max_new_tokens "
                                   f"+ one proposal); this worker's budget is {self.budget}", never=True)
        reserved = sum(self.live.values())
        if self.budget and reserved + need > self.budget:     # checked first: evict nothing in vain
            raise KVBudgetExceeded(f"KV budget full: {len(self.live)} live sessions hold {reserved} of "
                                   f"{self.budget} tokens; the request needs {need}")
        reuse = self.idle.take(session_id) if session_id else None
        if self.budget:
            self.idle.trim(self.budget - reserved - need)
        self.live[stream] = need
        if session_id:
            self.live_ids[session_id] = stream
        return reuse

    async def place(self, stream: int, session_id: str, need: int,
                    open_session: Callable[[TargetSession | None], Awaitable[TargetSession]],
                    pool: KVPool, between_passes: Callable[..., Awaitable]) -> TargetSession:
        """Admits a stream's session and gives it a run of `need` KV slots: `open_session(reuse)`
        builds it, reusing the earlier turn `reuse` when one is kept, and raises KVPoolFull when no
        run of free slots is long enough. Waits in the admission queue while the budget is full;
        raises KVBudgetExceeded when it stays full past the admission timeout (or never could fit).

        Within the budget but fragmented: an earlier turn whose run could not grow gives it up (this
        turn prefills the history instead: reusing it would need its run and a longer one at once).
        Then the idle turns that make a run are evicted (no copy), else the pool is compacted once
        (`between_passes`: no pass may run while runs move), then idle turns are evicted, then the
        request waits like any that does not fit."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.admission_timeout
        compacted = False
        while True:
            try:
                reuse = self.admit(stream, session_id, need)
                try:
                    return await open_session(reuse)
                except KVPoolFull:
                    self.release(stream, None, keep=False)
                    if reuse is not None:
                        self._evicted(session_id, reuse)
                        continue
                    if self.evict_for(pool, need):
                        continue
                    if not compacted:
                        compacted = True
                        await between_passes(pool.compact)
                        continue
                    if self.evict_one():
                        continue
                    raise KVBudgetExceeded(f"KV pool fragmented: no free run of {need} positions") from None
            except KVBudgetExceeded as e:
                left = deadline - loop.time()
                if e.never or left <= 0:
                    raise
                compacted = False
                await self.wait_for_space(left)

    def evict_one(self) -> bool:
        """Drops the least recently used idle session and frees its KV; False when none is idle."""
        return self.idle.evict_oldest()

    def _evicted(self, evicted: str, session: TargetSession) -> None:
        """Frees an idle session's KV (one no longer in `idle`), counted as an eviction."""
        self.evictions += 1
        metrics.EVICTIONS.inc()
        telemetry.event("evict", {"gen_ai.conversation.id": evicted, "tandem.kv.tokens": session.cache.length})
        session.cache.release()

    def evict_for(self, pool, need: int) -> bool:
        """Makes one run of `need` free slots in a fragmented pool by evicting the fewest idle
        sessions whose runs, with the free runs around them, lie next to each other (least recently
        used first among equals). A copy-free alternative to compacting the pool, which moves every
        live run. False when no such set of idle sessions exists."""
        runs = [(start, n, None) for start, n in pool.free_runs()]
        runs += [(s.cache.start, s.cache.capacity, sid) for sid, s in self.idle.items() if s.cache.capacity]
        runs.sort()
        order = {sid: i for i, sid in enumerate(self.idle)}          # least recently used first
        best, window, total = None, [], 0
        for run in runs:
            if window and window[-1][0] + window[-1][1] != run[0]:   # a live run in between
                window, total = [], 0
            window.append(run)
            total += run[1]
            while total - window[0][1] >= need:
                total -= window.pop(0)[1]
            if total >= need:
                evict = [sid for _, _, sid in window if sid is not None]
                cost = (len(evict), sum(order[sid] for sid in evict))
                if best is None or cost < best[0]:
                    best = (cost, evict)
        if best is None or not best[1]:
            return False
        for sid in best[1]:
            self.idle.evict(sid)
        return True

    async def wait_for_space(self, timeout: float) -> None:
        """Waits in the admission queue until some reservation ends (or `timeout` seconds pass)."""
        self.waiting += 1
        metrics.ADMISSION_WAITING.inc()
        try:
            self._space.clear()
            await asyncio.wait_for(self._space.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiting -= 1
            metrics.ADMISSION_WAITING.dec()

    def owns(self, stream: int, session_id: str) -> bool:
        return not session_id or self.live_ids.get(session_id) == stream

    def release(self, stream: int, session: TargetSession | None, keep: bool) -> None:
        """Ends a stream's reservation; a kept session stays idle for its next turn or its
        continuation, unless another stream has taken it over."""
        keep = keep and session is not None and self.owns(stream, session.session_id)
        if self.live.pop(stream, None) is not None:
            for sid in [s for s, owner in self.live_ids.items() if owner == stream]:
                del self.live_ids[sid]
            self._space.set()
        if keep and session is not None and session.session_id:
            self.idle.put(session.session_id, session)

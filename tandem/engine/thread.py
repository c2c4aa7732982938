"""The one thread of a worker process that runs model work."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

# Seconds the jobs of this process's inference threads have run, by thread name; only ever grows, so
# it reads as a counter (tandem.service.metrics exports it). Each thread adds its own jobs' time.
_busy: dict[str, float] = {}


def busy_seconds() -> dict[str, float]:
    """Seconds the jobs of each name's inference threads have run so far in this process."""
    return dict(_busy)


class InferenceThread:
    """Model work runs here, one job at a time, never on the event loop.

    Every torch op of a worker process belongs on this one thread, model loading and calibration
    included: each thread that runs a parallel op gets its own OpenMP team, and two teams sharing
    the cores slow every forward pass down (measured in docs/benchmarks.md, "Measurements behind
    the code's rules")."""

    def __init__(self, name: str, gauge=None) -> None:
        """gauge: a Prometheus gauge that follows the queue depth, if any."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._gauge = gauge
        self.name = name
        _busy.setdefault(name, 0.0)     # exported at 0 before the first job

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
        """The queue depth (jobs submitted and not yet started) moves by n: on the event loop and on
        the inference thread, which a Prometheus gauge takes from any thread."""
        if self._gauge is not None:
            self._gauge.inc(n)

    def _ran(self, seconds: float) -> None:
        # Only inference threads call this; two threads of one name (tests) could lose an addition
        # to the race of this read-modify-write, nothing that a utilisation figure would show.
        _busy[self.name] += seconds

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
        try:
            result = self.fn(*self.args)
        finally:
            seconds = time.perf_counter() - t0
            self.owner._ran(seconds)        # a job that raised kept the thread busy too
        return result, seconds

"""Continuous batching: forward passes asked for by many sessions run together.

Sessions queue work on the event loop. Whenever the inference thread is free, everything queued
(up to a token budget) becomes one forward pass; each step's follow-up (verification, sampling)
runs on the inference thread right after, and its result goes back to the session that asked.

Two scheduling rules. Rounds and decode steps go before prefill chunks, which fill what is left
of the token budget, so that a wave of new prompts does not hold up every running session's next
token. And after a pass, the next one waits a moment (at most `gather` of the last pass's time,
capped at `max_wait`) for the sessions of that pass to queue their next step: they get their
results a moment after the pass ends, and without the wait each pass would start with whichever
few were back first. It waits for sessions that said they would queue their next step at once
(decoding on here), and for those that came back from elsewhere within that time the last time:
one whose step goes through another worker (drafting a proposal with a model) is not waited for.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.kvpool import KVPoolFull, SessionCache
from tandem.engine.modeling import CausalLM
from tandem.engine.thread import InferenceThread


@dataclass
class Ran:
    value: Any           # what the step's follow-up returned (its logits when it had none)
    seconds: float       # the batch's forward pass and the follow-ups up to this step's own
    batch_size: int      # sessions taken into that pass
    fed: int             # tokens of this step the pass took (fewer than given when it was cut)
    positions: int = 0   # tokens the pass fed, all sessions together


@dataclass
class Step:
    """One session's work for the next forward pass: `tokens` fed after `cache`'s.

    last: the logits rows to keep, counted from the end (None: every row).
    then: a follow-up run on the inference thread right after the pass, given the rows; what it
        returns (or raises) is the step's result.
    prefill: a prompt chunk, which yields to rounds and decode steps.
    least: the step may be cut to its first `least` tokens when the token budget cannot hold every
        queued round whole (a proposal to verify: `then` gets the rows of what was fed, `Ran.fed`
        says how many). None: never cut.
    returns: the session's next step follows this one at once (decoding on in this process), so
        the next pass waits for it; otherwise the wait depends on how long it was away before.
    taps: `then` gets (rows, features) with the batcher's tapped hidden states of every token fed
        (see CausalLM.forward_batch), for a trained head beside the target.
    tree: the tokens are a token tree, tree[i] the parent of token i among them (-1 for the first;
        see CausalLM.forward_batch); cut with the tokens, parents first, so a cut one is a tree."""
    cache: SessionCache
    tokens: list[int]
    last: int | None = None
    then: Callable | None = None
    prefill: bool = False
    least: int | None = None
    returns: bool = False
    taps: bool = False
    tree: list[int] | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)      # the batcher cuts its own copy, never the caller's list
        if self.tree is not None:
            self.tree = list(self.tree)


@dataclass
class _Queued:
    step: Step
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _cut(step: Step, cap: int | None) -> int:
    """How many of the step's tokens go into a pass whose rounds are cut to `cap`."""
    if cap is None or step.least is None:
        return len(step.tokens)
    return max(step.least, min(len(step.tokens), cap))


class Batcher:
    def __init__(self, model: CausalLM, inference: InferenceThread, max_tokens: int = 512,
                 gather: float = 0.3, max_wait: float = 0.25, taps: tuple[int, ...] = ()) -> None:
        self.model, self.inference, self.max_tokens = model, inference, max_tokens
        self.taps = taps        # hidden states a pass returns to the steps that ask (Step.taps)
        self.gather, self.max_wait = gather, max_wait
        self._last: list[Step] = []                  # the rounds of the last pass
        self._last_seconds = 0.0
        self._queue: deque[_Queued] = deque()
        # By cache, forgotten with it: when its last result was given and whether it said it would
        # return at once; how long it took to queue again from elsewhere.
        self._answered: weakref.WeakKeyDictionary[SessionCache, tuple[float, bool]] = weakref.WeakKeyDictionary()
        self._away: weakref.WeakKeyDictionary[SessionCache, float] = weakref.WeakKeyDictionary()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # per pass: (sessions, round tokens, prefill tokens, seconds of its forward pass), on the
        # event loop before any of its steps' results
        self.observers: list[Callable[[int, int, int, float], None]] = []

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def between_passes(self, fn: Callable, *args) -> Any:
        """Runs fn on the inference thread between two forward passes."""
        return await self.inference.run(fn, *args)

    def leave(self, cache: SessionCache) -> None:
        """The session of `cache` queues nothing more: the next pass need not wait for it."""
        self._last = [s for s in self._last if s.cache is not cache]
        self._answered.pop(cache, None)
        self._away.pop(cache, None)

    async def forward(self, step: Step) -> Ran:
        """Runs `step` in the next pass with room. Exceptions from the pass or from its follow-up
        are raised here."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="batcher")
        queued = _Queued(step)
        answered = self._answered.pop(step.cache, None)
        if answered is not None and not answered[1]:
            self._away[step.cache] = asyncio.get_running_loop().time() - answered[0]
        self._queue.append(queued)
        self._wake.set()
        return await queued.future

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._gather()
                batch = self._take()
                if not batch:
                    continue
                steps = [q.step for q in batch]
                prefill = sum(len(s.tokens) for s in steps if s.prefill)
                tokens = sum(len(s.tokens) for s in steps) - prefill
                try:
                    _, seconds = await self.inference.run_timed(self._run, batch, tokens, prefill,
                                                                asyncio.get_running_loop())
                except Exception as e:           # the pass itself failed: every step hears of it
                    for queued in batch:
                        self._settle(queued, e, None)
                    self._observe(len(batch), tokens, prefill, 0.0)
                    seconds = 0.0
                self._last, self._last_seconds = [s for s in steps if not s.prefill], seconds

    async def _gather(self) -> None:
        """Waits, briefly, until every session of the last pass has queued its next step."""
        loop = asyncio.get_running_loop()
        wait = min(self.max_wait, self.gather * self._last_seconds)
        deadline = loop.time() + wait
        while True:
            queued = {id(q.step.cache) for q in self._queue}
            missing = [s for s in self._last if s.cache.capacity and id(s.cache) not in queued
                       and (s.returns or self._away.get(s.cache, 0.0) < wait)]
            left = deadline - loop.time()
            if not missing or left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Queued]:
        """Rounds and decode steps first, then prefill chunks, each in arrival order, up to the token
        budget (the first step always goes); one step per session, so a session's second step
        waits for the pass after its first. When the rounds do not fit whole, the longest proposals
        are cut to a common length first, so that every session gets its round."""
        batch: list[_Queued] = []
        tokens = 0
        seen: set[int] = set()
        rounds = []
        for queued in self._queue:
            step = queued.step
            if not step.prefill and not queued.future.done() and id(step.cache) not in seen:
                seen.add(id(step.cache))
                rounds.append(queued)
        cap = self._cap([q.step for q in rounds])
        for queued in rounds:
            n = _cut(queued.step, cap)
            if batch and tokens + n > self.max_tokens:
                continue
            del queued.step.tokens[n:]
            if queued.step.tree is not None:
                del queued.step.tree[n:]
            batch.append(queued)
            tokens += n
        for queued in self._queue:
            step = queued.step
            if not step.prefill or queued.future.done() or id(step.cache) in seen:
                continue
            if batch and tokens + len(step.tokens) > self.max_tokens:
                break
            seen.add(id(step.cache))
            batch.append(queued)
            tokens += len(step.tokens)
        taken = {id(q) for q in batch}
        self._queue = deque(q for q in self._queue if id(q) not in taken and not q.future.done())
        return batch

    def _cap(self, rounds: list[Step]) -> int | None:
        """The longest length to cut proposals to so that all rounds fit the budget (None: they fit
        whole; 1 when even that is too much, and the rounds that do not fit wait)."""
        longest = max((len(i.tokens) for i in rounds), default=0)
        if sum(_cut(i, longest) for i in rounds) <= self.max_tokens:
            return None
        low, high = 1, longest          # the largest cap that fits, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            if sum(_cut(i, mid) for i in rounds) <= self.max_tokens:
                low = mid
            else:
                high = mid - 1
        return low

    def _observe(self, sessions: int, tokens: int, prefill: int, seconds: float) -> None:
        for observe in self.observers:
            observe(sessions, tokens, prefill, seconds)

    def _run(self, batch: list[_Queued], tokens: int, prefill: int, loop: asyncio.AbstractEventLoop) -> None:
        """On the inference thread: room for every step first (a step that cannot get it fails
        alone), one forward pass, then each follow-up, whose result goes back to its session the
        moment it is there: a verdict is not held up by the other sessions' follow-ups."""
        start = time.perf_counter()
        steps = [q.step for q in batch]
        outcomes: list[Any] = [None] * len(steps)

        def settle(i: int) -> None:
            ran = Ran(None, time.perf_counter() - start, len(batch), len(steps[i].tokens), tokens + prefill)
            loop.call_soon_threadsafe(self._settle, batch[i], outcomes[i], ran)

        ready = []
        for i, step in enumerate(steps):
            total = step.cache.length + len(step.tokens)
            try:
                self.model.check_feed(step.cache, step.tokens)
                try:
                    step.cache.reserve(total)
                except KVPoolFull:
                    self.model.pool.compact()        # between passes: safe to move runs
                    step.cache.reserve(total)
                ready.append(i)
            except (ValueError, KVPoolFull) as e:
                outcomes[i] = e
                settle(i)
        if ready:
            tapped = self.taps and any(steps[i].taps for i in ready)
            logits = self.model.forward_batch([(steps[i].cache, steps[i].tokens, steps[i].last, steps[i].tree)
                                               for i in ready],
                                              self.taps if tapped else ())
            # observed first (callbacks run in order): a verdict built from the price sees this pass
            loop.call_soon_threadsafe(self._observe, len(batch), tokens, prefill, time.perf_counter() - start)
            for i, rows in zip(ready, logits):
                if tapped and not steps[i].taps:
                    rows = rows[0]
                then = steps[i].then
                try:
                    outcomes[i] = then(rows) if then is not None else rows
                except Exception as e:           # one session's bad step fails that session only
                    outcomes[i] = e
                settle(i)

    def _settle(self, queued: _Queued, outcome: Any, ran: Ran | None) -> None:
        """On the event loop: a step's result (`ran`, its value still to fill) or exception."""
        step = queued.step
        self._answered[step.cache] = (asyncio.get_running_loop().time(), step.returns)
        if queued.future.done():             # the session gave up (cancelled) meanwhile
            return
        if isinstance(outcome, BaseException):
            queued.future.set_exception(outcome)
        else:
            ran.value = outcome
            queued.future.set_result(ran)

"""Continuous batching: forward passes asked for by many sessions run together.

Sessions queue work on the event loop. Whenever the inference thread is free, everything queued
(up to a token budget) becomes one forward pass; each item's follow-up (verification, sampling)
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.kvpool import KVPoolFull, SessionCache
from tandem.engine.modeling import CausalLM
from tandem.engine.thread import InferenceThread


@dataclass
class Ran:
    value: Any           # what the item's follow-up returned (its logits when it had none)
    seconds: float       # the whole batch's forward pass and follow-ups
    batch_size: int      # sessions taken into that pass
    fed: int             # tokens of this item the pass took (fewer than given when it was cut)
    positions: int = 0   # tokens the pass fed, all sessions together


@dataclass
class _Item:
    cache: SessionCache
    tokens: list[int]
    last: int | None
    then: Callable | None
    prefill: bool
    least: int | None    # may be cut to this many tokens when the budget is short (None: never)
    returns: bool        # the session queues its next step as soon as it has this result
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


def _cut(item: _Item, cap: int | None) -> int:
    """How many of the item's tokens go into a pass whose rounds are cut to `cap`."""
    if cap is None or item.least is None:
        return len(item.tokens)
    return max(item.least, min(len(item.tokens), cap))


class Batcher:
    def __init__(self, model: CausalLM, inference: InferenceThread, max_tokens: int = 512,
                 gather: float = 0.3, max_wait: float = 0.25) -> None:
        self.model, self.inference, self.max_tokens = model, inference, max_tokens
        self.gather, self.max_wait = gather, max_wait
        self._last: list[_Item] = []                 # the rounds of the last pass
        self._last_seconds = 0.0
        self._queue: deque[_Item] = deque()
        self._answered: dict[int, tuple[float, bool]] = {}   # by cache: when its last result was given,
                                                             # and whether it said it would return at once
        self._away: dict[int, float] = {}              # by cache: how long it took to queue again from elsewhere
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # per pass: (sessions, round tokens, prefill tokens, seconds)
        self.observers: list[Callable[[int, int, int, float], None]] = []

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def between_passes(self, fn: Callable, *args) -> Any:
        """Runs fn on the inference thread between two forward passes."""
        return await self.inference.run(fn, *args)

    def leave(self, cache: SessionCache) -> None:
        """The session of `cache` queues nothing more: the next pass need not wait for it."""
        self._last = [i for i in self._last if i.cache is not cache]
        self._answered.pop(id(cache), None)
        self._away.pop(id(cache), None)

    async def forward(self, cache: SessionCache, tokens: list[int], last: int | None = None,
                      then: Callable | None = None, prefill: bool = False, least: int | None = None,
                      returns: bool = False) -> Ran:
        """Feeds `tokens` after `cache`'s in the next batch with room; `then(logits)` runs on the
        inference thread after the pass. Exceptions from the pass or from `then` are raised here.
        `prefill`: a prompt chunk, which yields to rounds and decode steps. `least`: the round may
        be cut to its first `least` tokens when the token budget cannot hold every queued round
        whole (a proposal to verify: `then` gets the rows of what was fed, `Ran.fed` says how many).
        `returns`: the session's next step follows this one at once (decoding on in this process),
        so the next pass waits for it; otherwise the wait depends on how long it was away before."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="batcher")
        item = _Item(cache, tokens, last, then, prefill, least, returns)
        answered = self._answered.pop(id(cache), None)
        if answered is not None and not answered[1]:
            self._away[id(cache)] = asyncio.get_running_loop().time() - answered[0]
        self._queue.append(item)
        self._wake.set()
        return await item.future

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._gather()
                batch = self._take()
                if not batch:
                    continue
                try:
                    outcomes, seconds = await self.inference.run_timed(self._run, batch)
                except Exception as e:           # the pass itself failed: every item hears of it
                    outcomes, seconds = [e] * len(batch), 0.0
                prefill = sum(len(i.tokens) for i in batch if i.prefill)
                tokens = sum(len(i.tokens) for i in batch) - prefill
                for observe in self.observers:
                    observe(len(batch), tokens, prefill, seconds)
                self._last, self._last_seconds = [i for i in batch if not i.prefill], seconds
                now = asyncio.get_running_loop().time()
                if len(self._answered) > 10_000:   # sessions that ended without leave(): forget them
                    self._answered.clear()
                    self._away.clear()
                for item, outcome in zip(batch, outcomes):
                    self._answered[id(item.cache)] = (now, item.returns)
                    if item.future.done():       # the session gave up (cancelled) meanwhile
                        continue
                    if isinstance(outcome, Exception):
                        item.future.set_exception(outcome)
                    else:
                        item.future.set_result(Ran(outcome, seconds, len(batch), len(item.tokens), tokens + prefill))

    async def _gather(self) -> None:
        """Waits, briefly, until every session of the last pass has queued its next step."""
        loop = asyncio.get_running_loop()
        wait = min(self.max_wait, self.gather * self._last_seconds)
        deadline = loop.time() + wait
        while True:
            queued = {id(i.cache) for i in self._queue}
            missing = [i for i in self._last if i.cache.capacity and id(i.cache) not in queued
                       and (i.returns or self._away.get(id(i.cache), 0.0) < wait)]
            left = deadline - loop.time()
            if not missing or left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Item]:
        """Rounds and decode steps first, then prefill chunks, each in arrival order, up to the token
        budget (the first item always goes); one item per session, so a session's second request
        waits for the pass after its first. When the rounds do not fit whole, the longest proposals
        are cut to a common length first, so that every session gets its round."""
        batch: list[_Item] = []
        tokens = 0
        seen: set[int] = set()
        rounds = []
        for item in self._queue:
            if not item.prefill and not item.future.done() and id(item.cache) not in seen:
                seen.add(id(item.cache))
                rounds.append(item)
        cap = self._cap(rounds)
        for item in rounds:
            n = _cut(item, cap)
            if batch and tokens + n > self.max_tokens:
                continue
            del item.tokens[n:]
            batch.append(item)
            tokens += n
        for item in self._queue:
            if not item.prefill or item.future.done() or id(item.cache) in seen:
                continue
            if batch and tokens + len(item.tokens) > self.max_tokens:
                break
            seen.add(id(item.cache))
            batch.append(item)
            tokens += len(item.tokens)
        taken = {id(i) for i in batch}
        self._queue = deque(i for i in self._queue if id(i) not in taken and not i.future.done())
        return batch

    def _cap(self, rounds: list[_Item]) -> int | None:
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

    def _run(self, batch: list[_Item]) -> list[Any]:
        """On the inference thread: room for every item first (an item that cannot get it fails
        alone), one forward pass, then each follow-up."""
        outcomes: list[Any] = [None] * len(batch)
        ready = []
        for i, item in enumerate(batch):
            total = item.cache.length + len(item.tokens)
            try:
                self.model.check_feed(item.cache, item.tokens)
                try:
                    item.cache.reserve(total)
                except KVPoolFull:
                    self.model.pool.compact()        # between passes: safe to move runs
                    item.cache.reserve(total)
                ready.append(i)
            except (ValueError, KVPoolFull) as e:
                outcomes[i] = e
        if ready:
            logits = self.model.forward_batch([(batch[i].cache, batch[i].tokens, batch[i].last) for i in ready])
            for i, rows in zip(ready, logits):
                then = batch[i].then
                try:
                    outcomes[i] = then(rows) if then is not None else rows
                except Exception as e:           # one session's bad proposal fails that session only
                    outcomes[i] = e
        return outcomes

"""The vLLM face's event stream (gateway.vllm._until) closes its worker call however it ends: an
abort, or the caller cancelled while it waits for the next event (its client went away)."""

import asyncio

import pytest

from gateway.vllm import _until

pytestmark = pytest.mark.unit


def waiting_events(started: asyncio.Event, closed: asyncio.Event):
    async def events():
        try:
            yield 1
            started.set()
            await asyncio.Event().wait()         # a worker with nothing to say yet
        finally:
            closed.set()                         # the worker call ends here, freeing its session
    return events()


async def test_a_caller_cancelled_mid_wait_closes_the_events():
    started, closed = asyncio.Event(), asyncio.Event()

    async def consume():
        async for _ in _until(waiting_events(started, closed), asyncio.Event()):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert closed.is_set()


async def test_an_abort_yields_none_and_closes_the_events():
    started, closed, aborted = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen = []

    async def consume():
        async for event in _until(waiting_events(started, closed), aborted):
            seen.append(event)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    aborted.set()
    await asyncio.wait_for(task, 5)
    assert seen == [1, None] and closed.is_set()

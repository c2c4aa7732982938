"""Multi-turn sessions at the gateway: a turn's prompt is the session's token history plus the new
tokens; when the turn ends, its output joins the history in Redis for the next turn.

Only the start of a turn needs Redis. Its end is best effort: a stream that is running when Redis
goes away still finishes for the client (the turn is then missing from the history, and logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from tandem.cluster.sessions import DONE, SessionRecord, SessionStore

log = logging.getLogger(__name__)


class SessionBusy(Exception):
    """Another request of the same session is still running."""


class SessionUnavailable(Exception):
    """Redis cannot be reached to load the session."""


@dataclass
class Turn:
    session_id: str
    prompt_ids: list[int]          # history + this turn's new tokens
    affinity: str = ""             # verify worker that held the session's KV after the last turn
    record: SessionRecord | None = None
    locked: bool = False
    owner: str = field(default_factory=lambda: uuid.uuid4().hex)
    _refreshed: float = field(default_factory=time.monotonic)


class Conversations:
    def __init__(self, store: SessionStore | None, redis_url: str = "") -> None:
        self.store = store            # None: no Redis (static routing); every request stands alone
        self.redis_url = redis_url

    async def begin(self, session_id: str, new_ids: list[int], continuation_ids: list[int],
                    fresh: bool = False) -> Turn:
        """Locks the session and returns the turn to run. new_ids: the prompt as a first turn;
        continuation_ids: the same input encoded to follow an existing history. fresh: the gateway
        made the id up just now, so there is nothing to load or lock (its record is still saved, so
        the client can continue the conversation with the id it gets back)."""
        turn = Turn(session_id, list(new_ids), record=SessionRecord(session_id))
        if self.store is None or fresh:
            return turn
        try:
            if not await self.store.lock(session_id, turn.owner):
                raise SessionBusy(f"session {session_id} has another request in flight; "
                                  "send its next turn when that one has finished")
            turn.locked = True
            record = await self.store.get(session_id)
        except (RedisError, OSError) as e:
            raise SessionUnavailable(f"Redis at {self.redis_url} is unreachable, so session "
                                     f"{session_id} cannot be loaded; retry shortly ({e})") from None
        if record is not None and record.tokens:
            turn.prompt_ids = [*record.tokens, *continuation_ids]
            turn.affinity = record.verify
        turn.record = record or SessionRecord(session_id)
        return turn

    async def keepalive(self, turn: Turn) -> None:
        """Keeps the session's lock while a long stream runs (best effort, at most every few seconds)."""
        if not turn.locked or time.monotonic() - turn._refreshed < self.store.lock_ttl / 3:
            return
        turn._refreshed = time.monotonic()
        try:
            await self.store.refresh_lock(turn.session_id, turn.owner)
        except (RedisError, OSError) as e:
            log.warning("cannot refresh the lock of session %s: %s", turn.session_id, e)

    async def finish(self, turn: Turn, tokens: list[int], verify: str, draft: str | None, params: dict) -> None:
        """Records the finished turn (history = tokens) and releases the session."""
        if self.store is None:
            return
        record = turn.record
        record.tokens, record.verify, record.draft, record.params = tokens, verify, draft or "", params
        record.status, record.turns = DONE, record.turns + 1
        try:
            await self.store.save(record)
        except (RedisError, OSError) as e:
            log.warning("session %s: the turn finished but could not be recorded in Redis: %s", turn.session_id, e)
        await self.release(turn)

    async def release(self, turn: Turn) -> None:
        if self.store is None or not turn.locked:
            return
        try:
            await asyncio.shield(self.store.unlock(turn.session_id, turn.owner))
        except (RedisError, OSError) as e:
            log.warning("cannot unlock session %s (its lock expires by itself): %s", turn.session_id, e)

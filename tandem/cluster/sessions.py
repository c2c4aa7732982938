"""Session records in Redis: what a conversation has said so far and where its KV cache lives.

Keys (prefix `tandem:`):
  session:{id}       JSON SessionRecord, expires `ttl` seconds after its last use
  session-lock:{id}  the gateway request serving the session now; a second request for the same
                     session is refused while it is held. Expires by itself if that gateway dies.

The token history is the source of truth for a conversation: a verify worker that lost the KV
cache (evicted, restarted, died) rebuilds it from these tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

from tandem.cluster.registry import PREFIX

RUNNING, DONE = "running", "done"   # a turn in flight also holds session-lock:{id}

# Deletes the lock only when it is still ours, so a lock that expired and was taken by another
# request is left alone.
_UNLOCK = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


@dataclass
class SessionRecord:
    session_id: str
    tokens: list[int] = field(default_factory=list)   # the whole conversation: prompts and outputs
    verify: str = ""                                   # verify worker holding (or last holding) the KV
    draft: str = ""                                    # draft worker of the last turn ("" = verify-only)
    params: dict = field(default_factory=dict)         # sampling parameters of the last turn
    status: str = RUNNING
    turns: int = 0
    updated_at: float = 0.0


class SessionStore:
    def __init__(self, client: aioredis.Redis, ttl: float = 3600, lock_ttl: float = 30) -> None:
        self.client = client
        self.ttl = ttl
        self.lock_ttl = lock_ttl

    @staticmethod
    def _key(session_id: str) -> str:
        return f"{PREFIX}session:{session_id}"

    @staticmethod
    def _lock(session_id: str) -> str:
        return f"{PREFIX}session-lock:{session_id}"

    async def get(self, session_id: str) -> SessionRecord | None:
        """The record, its TTL refreshed; None when there is none (never created, or expired)."""
        value = await self.client.getex(self._key(session_id), px=int(self.ttl * 1000))
        return SessionRecord(**json.loads(value)) if value is not None else None

    async def save(self, record: SessionRecord) -> None:
        record.updated_at = time.time()
        await self.client.set(self._key(record.session_id), json.dumps(asdict(record)),
                              px=int(self.ttl * 1000))

    async def lock(self, session_id: str, owner: str) -> bool:
        return bool(await self.client.set(self._lock(session_id), owner, nx=True,
                                          px=int(self.lock_ttl * 1000)))

    async def refresh_lock(self, session_id: str, owner: str) -> None:
        await self.client.set(self._lock(session_id), owner, xx=True, px=int(self.lock_ttl * 1000))

    async def unlock(self, session_id: str, owner: str) -> None:
        await self.client.eval(_UNLOCK, 1, self._lock(session_id), owner)

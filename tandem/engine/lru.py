"""Finished sessions' caches kept for reuse, least recently used first out.

Both workers keep them: the verify worker for a session's next turn (or its continuation after a
draft worker is lost), the model drafter to lend a prompt prefix to later sessions. A value holds
one SessionCache, found by `cache_of`; a value that leaves by eviction goes to `on_evict`, which
by default releases its cache's KV. A value taken back (`take`) keeps its cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from tandem.engine.kvpool import SessionCache

V = TypeVar("V")


class KeptCaches(Generic[V]):
    def __init__(self, cache_of: Callable[[V], SessionCache],
                 on_evict: Callable[[Hashable, V], None] | None = None) -> None:
        self.cache_of = cache_of
        self.on_evict = on_evict or (lambda key, value: cache_of(value).release())
        self._items: OrderedDict[Hashable, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._items))

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> V | None:
        return self._items.get(key)

    def items(self) -> list[tuple[Hashable, V]]:
        return list(self._items.items())

    def values(self) -> list[V]:
        """A copy (one step under the GIL), safe to read from another thread."""
        return list(self._items.values())

    def tokens(self) -> int:
        """KV positions the kept caches hold reserved."""
        return sum(self.cache_of(v).capacity for v in self.values())

    def put(self, key: Hashable, value: V) -> None:
        """Keeps value as the most recently used; a value kept under the same key is replaced."""
        self._items.pop(key, None)
        self._items[key] = value

    def take(self, key: Hashable) -> V | None:
        """Takes a value back for reuse (its cache is not released)."""
        return self._items.pop(key, None)

    def evict(self, key: Hashable) -> None:
        self.on_evict(key, self._items.pop(key))

    def evict_oldest(self) -> bool:
        """Evicts the least recently used value; False when none is kept."""
        if not self._items:
            return False
        self.on_evict(*self._items.popitem(last=False))
        return True

    def trim(self, tokens: int) -> None:
        """Evicts the least recently used values until the rest hold at most `tokens` positions."""
        while self._items and self.tokens() > tokens:
            self.evict_oldest()

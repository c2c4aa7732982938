"""One preallocated KV cache pool per model, shared by all its sessions, and the rule for how
much of it a session reserves (`kv_need`).

Per layer the pool holds keys and values as [kv_heads, slots, head_dim]. A session owns one
contiguous run of slots (its `SessionCache`); its keys for attention are a strided view of that
run, so a forward pass copies nothing but the new tokens' keys and values. Rolling back is moving
the session's length back. A session that outgrows its run moves to a run twice as long, once.
The attention that reads and writes the pool in place is in `tandem/engine/attention.py`.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch



MAX_PROPOSAL = 16      # the verify worker's default --max-proposal: the largest k it accepts


def proposal_room(max_proposal: int = MAX_PROPOSAL) -> int:
    """KV positions a session keeps beyond its prompt and output for the proposal in flight: the
    proposed tokens and the last committed token fed with them."""
    return max_proposal + 1


def kv_need(prompt_len: int, max_new_tokens: int, room: int, max_context: int) -> int:
    """KV positions a session reserves on a worker: its prompt, every token it may generate, and
    `room` (proposal_room) for a proposal beyond them, capped at the context window. The one rule
    the gateway routes by, the verify worker admits by and the draft worker sizes its cache by."""
    return min(prompt_len + max_new_tokens + room, max_context)


class KVPoolFull(Exception):
    """No run of free slots is long enough (RESOURCE_EXHAUSTED for the request that asked)."""


class KVPool:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        if slots <= 0:
            raise ValueError(f"a KV pool needs at least one slot, got {slots}")
        shape = (layers, kv_heads, slots, head_dim)
        # never read before written: attention only reads a session's filled positions
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.slots = slots
        self.bytes_per_token = _bytes_per_token(layers, kv_heads, head_dim, dtype)
        self._free: list[tuple[int, int]] = [(0, slots)]     # (start, length), sorted by start
        self._lock = threading.RLock()    # a cache's finalizer may release on any thread
        self._caches: weakref.WeakSet[SessionCache] = weakref.WeakSet()   # holders of runs, for compact

    @classmethod
    def for_model(cls, model, slots: int, nbytes: int = 0) -> KVPool:
        """A pool for `model`'s sessions: `slots` positions, or as many as fit in `nbytes` when given."""
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        dtype = model.get_input_embeddings().weight.dtype
        if nbytes:
            slots = nbytes // _bytes_per_token(c.num_hidden_layers, kv_heads, head_dim, dtype)
        return cls(c.num_hidden_layers, kv_heads, head_dim, slots, dtype, str(model.device))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def free_slots(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every run of free slots, by start."""
        with self._lock:
            return list(self._free)

    def allocate(self, n: int) -> int:
        """The start of a run of n free slots (first fit). Raises KVPoolFull."""
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= n:
                    self._take(i, n)
                    return start
        raise KVPoolFull(f"KV pool full: no run of {n} free slots ({self.free_slots()} of {self.slots} "
                         f"free, fragmented)")

    def grow(self, start: int, n: int, more: int) -> bool:
        """Extends the run of n slots at `start` by `more` when the free run right after it has them."""
        with self._lock:
            for i, (s, length) in enumerate(self._free):
                if s == start + n and length >= more:
                    self._take(i, more)
                    return True
            return False

    def _take(self, i: int, n: int) -> None:
        """Takes the first n slots of the i-th free run."""
        start, length = self._free[i]
        if length == n:
            del self._free[i]
        else:
            self._free[i] = (start + n, length - n)

    def compact(self) -> int:
        """Slides every run down to the start of the pool, so all free slots form one run at the end;
        returns the positions copied. Only between forward passes (on the inference thread): a pass
        in flight would write to the old places."""
        with self._lock:
            moved, at = 0, 0
            for cache in sorted((c for c in self._caches if c.capacity), key=lambda c: c.start):
                if cache.start != at:
                    src, dst = slice(cache.start, cache.start + cache.length), slice(at, at + cache.length)
                    self.keys[:, :, dst] = self.keys[:, :, src].clone()
                    self.values[:, :, dst] = self.values[:, :, src].clone()
                    cache.start = at
                    cache._run[0] = at
                    moved += cache.length
                at += cache.capacity
            self._free = [(at, self.slots - at)] if at < self.slots else []
            return moved

    def release(self, start: int, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            free = sorted([*self._free, (start, n)])
            merged: list[tuple[int, int]] = []
            for s, length in free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((s, length))
            self._free = merged


def _bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Keys and values of one position, every layer."""
    return 2 * layers * kv_heads * head_dim * dtype.itemsize


class SessionCache:
    """The KV cache of one session: `length` leading slots of its run in the pool hold keys and
    values. `crop` rolls back without touching the pool. The run goes back to the pool on `release`
    or when the cache is garbage-collected."""

    def __init__(self, pool: KVPool, capacity: int = 64) -> None:
        self.pool = pool
        self.capacity = max(1, capacity)
        self.length = 0
        # Where the bits of the leading positions came from, so that sessions holding copies of one
        # prompt prefix read it once per pass (see `prefix_key`): `_origin` (source, positions) after
        # copy_prefix; `uid` names this cache's own positions, renamed when positions it lent are
        # rewritten; `_lent`: how many of them were copied under the current uid.
        self.uid = next(_uids)
        self._origin: tuple[int, int] | None = None
        self._lent = 0
        with pool._lock:                                  # compact must see every run it does not own
            self.start = pool.allocate(self.capacity)
            pool._caches.add(self)
        self._run = [self.start, self.capacity]          # read by the finalizer when it fires
        self._finalizer = weakref.finalize(self, _release_run, pool, self._run)

    def crop(self, length: int) -> None:
        if length < self.length:
            self.length = length
            self._rewrite_from(length)

    def keep_path(self, base: int, nodes: list[int]) -> None:
        """Keeps of the positions after the first `base` those at base + i for i in `nodes`
        (increasing: a token tree's accepted path), moved up to base, base + 1, ... in that order;
        the rest are dropped. Copies only the positions that move."""
        moves = [(base + i, base + j) for j, i in enumerate(nodes) if i != j]
        if not moves:
            self.crop(base + len(nodes))
            return
        src = torch.tensor([self.start + a for a, _ in moves], device=self.pool.keys.device)
        dst = torch.tensor([self.start + b for _, b in moves], device=self.pool.keys.device)
        with self.pool._lock:
            for held in (self.pool.keys, self.pool.values):
                held.index_copy_(2, dst, held.index_select(2, src))
        self.length = base + len(nodes)
        self._rewrite_from(moves[0][1])

    def prefix_key(self) -> tuple[int, int]:
        """(source, n): this cache's first n positions hold, bit for bit, the keys and values of
        every other cache's first n positions with the same source."""
        return self._origin if self._origin is not None else (self.uid, self.length)

    def _rewrite_from(self, position: int) -> None:
        """Positions from `position` on will be written anew."""
        if self._origin is not None and position < self._origin[1]:
            self._origin = (self._origin[0], position) if position > 0 else None
        if position < self._lent:
            self.uid, self._lent = next(_uids), 0

    def reserve(self, total: int, spare: bool = True) -> None:
        """Makes room for `total` positions: in place when the slots after the run are free, else by
        moving to a longer run (one copy). With `spare`, to twice the capacity where the pool has
        it, so that a cache growing a little at a time rarely grows again (a budgeted session asks
        for exactly its reservation). Raises KVPoolFull."""
        if total <= self.capacity:
            return
        sizes = list(dict.fromkeys((max(total, 2 * self.capacity), total) if spare else (total,)))
        with self.pool._lock:
            if self._finalizer.alive:
                for capacity in sizes:
                    if self.pool.grow(self.start, self.capacity, capacity - self.capacity):
                        self.capacity = self._run[1] = capacity
                        return
            for capacity in sizes:
                try:
                    start = self.pool.allocate(capacity)
                    break
                except KVPoolFull:
                    if capacity == sizes[-1]:
                        raise
            old = slice(self.start, self.start + self.length)
            new = slice(start, start + self.length)
            self.pool.keys[:, :, new] = self.pool.keys[:, :, old]
            self.pool.values[:, :, new] = self.pool.values[:, :, old]
            self.pool.release(self.start, self.capacity)
            self.start, self.capacity = start, capacity
            self._run[:] = [start, capacity]
            if not self._finalizer.alive:                  # reserved again after release()
                self._finalizer = weakref.finalize(self, _release_run, self.pool, self._run)
            self.pool._caches.add(self)

    def copy_prefix(self, other: SessionCache, n: int) -> None:
        """Fills this cache's first n positions with `other`'s (a prompt prefix both share): one
        copy instead of recomputing them. Between passes only, like every change to the pool."""
        with self.pool._lock:
            n = min(n, other.length, self.capacity)
            src, dst = slice(other.start, other.start + n), slice(self.start, self.start + n)
            self.pool.keys[:, :, dst] = self.pool.keys[:, :, src]
            self.pool.values[:, :, dst] = self.pool.values[:, :, src]
            self._rewrite_from(0)
            self.length = n
            if n <= 0:
                return
            source, shared = other.prefix_key()
            if n > shared:                        # beyond other's origin: other's own positions
                source = other.uid
            if source == other.uid:
                other._lent = max(other._lent, n)
            self._origin = (source, n)

    def release(self) -> None:
        with self.pool._lock:
            self._finalizer()
            self.length = self.capacity = 0
            self.pool._caches.discard(self)

    def nbytes(self) -> int:
        return self.length * self.pool.bytes_per_token


_uids = itertools.count(1)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def copy_longest_prefix(cache: SessionCache, tokens: list[int], donors, least: int) -> SessionCache | None:
    """Copies into `cache` the longest prefix of `tokens` that one of `donors` ((token ids, cache)
    pairs whose cache holds those ids' KV) holds, if it is at least `least` positions longer than
    what `cache` holds already; returns the donor's cache it copied from, if any. Between passes,
    like every change to the pool; a donor released meanwhile is skipped."""
    best, n = None, cache.length + least - 1
    for ids, donor in donors:
        if donor is cache or not donor.capacity:
            continue
        m = min(common_prefix(ids, tokens), donor.length)
        if m > n:
            best, n = donor, m
    if best is not None:
        cache.copy_prefix(best, n)
    return best


def _release_run(pool: KVPool, run: list[int]) -> None:
    if run[1]:
        pool.release(run[0], run[1])
        run[1] = 0

"""One preallocated KV cache pool per model, shared by all its sessions, and the attention that
reads and writes it in place.

Per layer the pool holds keys and values as [kv_heads, slots, head_dim]. A session owns one
contiguous run of slots (its `SessionCache`); its keys for attention are a strided view of that
run, so a forward pass copies nothing but the new tokens' keys and values. Rolling back is moving
the session's length back. A session that outgrows its run moves to a run twice as long, once.

A batched forward pass feeds the new tokens of many sessions as one flat sequence; the model's
linear layers see them all at once, and `pool_attention` (registered with transformers as the
"tandem_pool" attention) attends each session's queries to that session's keys only.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION = "tandem_pool"


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

    def allocate(self, n: int) -> int:
        """The start of a run of n free slots (first fit). Raises KVPoolFull."""
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (start + n, length - n)
                    return start
        raise KVPoolFull(f"KV pool full: no run of {n} free slots ({self.free_slots()} of {self.slots} "
                         f"free, fragmented)")

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
        with pool._lock:                                  # compact must see every run it does not own
            self.start = pool.allocate(self.capacity)
            pool._caches.add(self)
        self._run = [self.start, self.capacity]          # read by the finalizer when it fires
        self._finalizer = weakref.finalize(self, _release_run, pool, self._run)

    def crop(self, length: int) -> None:
        if length < self.length:
            self.length = length

    def reserve(self, total: int) -> None:
        """Makes room for `total` positions, moving to a longer run (one copy) when needed."""
        if total <= self.capacity:
            return
        capacity = max(total, 2 * self.capacity)
        with self.pool._lock:
            start = self.pool.allocate(capacity)
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
            self.length = n

    def release(self) -> None:
        with self.pool._lock:
            self._finalizer()
            self.length = self.capacity = 0
            self.pool._caches.discard(self)

    def nbytes(self) -> int:
        return self.length * self.pool.bytes_per_token


def _release_run(pool: KVPool, run: list[int]) -> None:
    if run[1]:
        pool.release(run[0], run[1])
        run[1] = 0


@dataclass
class Segment:
    """One session's new tokens inside a batched forward pass."""
    offset: int          # first index in the flat sequence
    n: int               # new tokens
    start: int           # the session's first slot in the pool
    past: int            # positions already cached
    mask: torch.Tensor | None    # [n, past + n] causal mask; None when n == 1


@dataclass
class ForwardBatch:
    pool: KVPool
    segments: list[Segment]

    @classmethod
    def build(cls, pool: KVPool, parts: list[tuple[int, int, int]]) -> ForwardBatch:
        """parts: (start slot, past length, new tokens) per session, in flat-sequence order."""
        segments, offset = [], 0
        for start, past, n in parts:
            mask = None if n == 1 else torch.ones(n, past + n, dtype=torch.bool).tril(past)
            segments.append(Segment(offset, n, start, past, mask))
            offset += n
        return cls(pool, segments)


def pool_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] for the T new tokens of the batch; writes the
    new keys and values into each session's run and returns [1, T, Hq, D]."""
    batch: ForwardBatch = kwargs["tandem_batch"]
    keys, values = batch.pool.keys[module.layer_idx], batch.pool.values[module.layer_idx]
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    for s in batch.segments:
        new = slice(s.offset, s.offset + s.n)
        run = slice(s.start, s.start + s.past + s.n)
        keys[:, s.start + s.past:run.stop] = key[0, :, new]
        values[:, s.start + s.past:run.stop] = value[0, :, new]
        out[:, :, new] = F.scaled_dot_product_attention(
            query[:, :, new], keys[None, :, run], values[None, :, run], attn_mask=s.mask,
            scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, pool_attention)

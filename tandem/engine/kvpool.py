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

import itertools
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION = "tandem_pool"


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


def copy_longest_prefix(cache: SessionCache, tokens: list[int], donors, least: int) -> bool:
    """Copies into `cache` the longest prefix of `tokens` that one of `donors` ((token ids, cache)
    pairs whose cache holds those ids' KV) holds, if it is at least `least` positions longer than
    what `cache` holds already; True when it copied. Between passes, like every change to the pool;
    a donor released meanwhile is skipped."""
    best, n = None, cache.length + least - 1
    for ids, donor in donors:
        if donor is cache or not donor.capacity:
            continue
        m = min(common_prefix(ids, tokens), donor.length)
        if m > n:
            best, n = donor, m
    if best is not None:
        cache.copy_prefix(best, n)
    return best is not None


def _release_run(pool: KVPool, run: list[int]) -> None:
    if run[1]:
        pool.release(run[0], run[1])
        run[1] = 0


@dataclass
class Segment:
    """One session's new tokens inside a batched forward pass, and the positions they attend."""
    new: slice           # their place in the flat sequence
    keys: torch.Tensor   # [layers, 1, Hkv, positions, D]: a view of the session's run, every layer
    values: torch.Tensor
    mask: torch.Tensor | None    # [n, positions] additive causal mask; None when n == 1


@dataclass
class Shared:
    """Sessions of one pass whose runs begin with copies of the same prompt prefix. Their queries
    attend that prefix together, read once from one of the runs, and their own positions after it
    in one padded call (gathered: they are short); the two partial attentions are merged by their
    log-sum-exp, as one attention over all positions would weigh them. Padded as [B, N] queries and
    [B, L] own positions, each row repeating its last real entry, masked."""
    queries: torch.Tensor        # [B * N] flat index of each (session, new token), padded
    own: torch.Tensor            # [B * L] pool slot of each (session, position after the prefix), padded
    mask: torch.Tensor           # [B, 1, N, L] additive
    real: torch.Tensor           # indices into B * N of the real queries, in flat order of the sessions
    keys: torch.Tensor           # [layers, 1, Hkv, prefix, D]: the prefix, from one of the runs
    values: torch.Tensor
    shape: tuple[int, int, int]  # B, N, L

    @classmethod
    def build(cls, pool: KVPool, parts: list[tuple[int, int, int, int]], prefix: int) -> Shared:
        """parts: (flat offset, start slot, past, new tokens) per session."""
        offset, start, past, n = (torch.tensor(x) for x in zip(*parts))
        own_n = past + n - prefix
        b, width, length = len(parts), int(n.max()), int(own_n.max())
        i, j = torch.arange(width), torch.arange(length)
        queries = offset[:, None] + torch.minimum(i[None], n[:, None] - 1)                  # [B, N]
        own = (start + prefix)[:, None] + torch.minimum(j[None], own_n[:, None] - 1)        # [B, L]
        real = i[None] < n[:, None]
        # query i of a session sees its own positions up to past - prefix + i; a padded row sees
        # the first only (a row with nothing to see would be NaN)
        limit = torch.where(real, (past - prefix)[:, None] + i[None], 0)
        mask = torch.zeros(b, 1, width, length, dtype=pool.keys.dtype)
        mask.masked_fill_(j[None, None, None] > limit[:, None, :, None], float("-inf"))
        first, device = int(start[0]), pool.keys.device
        return cls(queries.flatten().to(device), own.flatten().to(device), mask.to(device),
                   real.flatten().nonzero().flatten().to(device), pool.keys[:, None, :, first:first + prefix],
                   pool.values[:, None, :, first:first + prefix], (b, width, length))


@dataclass
class ForwardBatch:
    """What attention needs of a batch, built once per pass: per layer it then costs one write of
    all new keys and values and one attention call per session or shared prefix (slicing the pool
    per layer and session cost as much as the attention itself)."""
    pool: KVPool
    slots: torch.Tensor          # [T] the pool slot each new token's key and value go to
    segments: list[Segment]      # sessions attended alone
    shared: list[Shared]
    order: torch.Tensor | None   # flat index -> place in the computed output, None when the same

    MIN_SHARED = 16              # a shorter common prefix is attended per session
    SHORT = 32                   # sessions feeding more new tokens (prefill chunks) attend alone
    # Shared prefixes need attention's log-sum-exp, which torch exposes on the CPU; elsewhere
    # each session attends alone.

    @classmethod
    def build(cls, pool: KVPool, parts: list[tuple[int, int, int, tuple[int, int]]]) -> ForwardBatch:
        """parts: (start slot, past length, new tokens, the cache's prefix_key) per session, in
        flat-sequence order."""
        slots, offsets, by_source = [], [], {}
        for i, (start, past, n, (source, shared)) in enumerate(parts):
            slots.extend(range(start + past, start + past + n))
            offsets.append(offsets[-1] + parts[i - 1][2] if i else 0)
            # Grouped by prefix and by new tokens: a group pads every member's queries to its
            # longest, so one long proposal among single tokens would make the whole group pay for
            # its length (see docs/benchmarks.md, "Measurements behind the code's rules").
            # A prefill chunk (longer than SHORT) attends alone.
            if n <= cls.SHORT:
                by_source.setdefault((source, n), []).append(i)
        alone, groups = [i for i, p in enumerate(parts) if p[2] > cls.SHORT], []
        for members in by_source.values():
            prefix = min(min(parts[i][3][1], parts[i][1]) for i in members)
            if len(members) > 1 and prefix >= cls.MIN_SHARED and pool.keys.device.type == "cpu":
                groups.append((members, prefix))
            else:
                alone.extend(members)
        alone.sort()

        def segment(i: int) -> Segment:
            start, past, n, _ = parts[i]
            run = slice(start, start + past + n)
            mask = None
            if n > 1:
                mask = torch.zeros(n, past + n, dtype=pool.keys.dtype, device=pool.keys.device)
                mask.masked_fill_(~torch.ones(n, past + n, dtype=torch.bool, device=pool.keys.device).tril(past),
                                  float("-inf"))
            return Segment(slice(offsets[i], offsets[i] + n), pool.keys[:, None, :, run],
                           pool.values[:, None, :, run], mask)

        shared, computed = [], list(alone)
        for members, prefix in groups:
            shared.append(Shared.build(pool, [(offsets[i], *parts[i][:3]) for i in members], prefix))
            computed.extend(members)
        order = None
        if shared:
            place = [j for i in computed for j in range(offsets[i], offsets[i] + parts[i][2])]
            order = torch.empty(len(place), dtype=torch.long)
            order[torch.tensor(place)] = torch.arange(len(place))
        return cls(pool, torch.tensor(slots, device=pool.keys.device), [segment(i) for i in alone],
                   shared, order)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def pool_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] for the T new tokens of the batch; writes the
    new keys and values into each session's run and returns [1, T, Hq, D]."""
    batch: ForwardBatch = kwargs["tandem_batch"]
    layer = module.layer_idx
    batch.pool.keys[layer].index_copy_(1, batch.slots, key[0])
    batch.pool.values[layer].index_copy_(1, batch.slots, value[0])
    gqa = query.shape[1] != key.shape[1]
    out = [F.scaled_dot_product_attention(query[:, :, s.new], s.keys[layer], s.values[layer], attn_mask=s.mask,
                                          scale=scaling, enable_gqa=gqa) for s in batch.segments]
    keys, values = batch.pool.keys[layer], batch.pool.values[layer]
    hq, hkv, d = query.shape[1], key.shape[1], query.shape[3]
    for g in batch.shared:
        b, n, length = g.shape
        q = query[0].index_select(1, g.queries)                                  # [Hq, B * N, D]
        o_pre, lse_pre = _flash(q[None], g.keys[layer], g.values[layer], scale=scaling)
        k = keys.index_select(1, g.own).view(hkv, b, length, d).transpose(0, 1)
        v = values.index_select(1, g.own).view(hkv, b, length, d).transpose(0, 1)
        o_own, lse_own = _flash(q.view(hq, b, n, d).transpose(0, 1), k, v, attn_mask=g.mask, scale=scaling)
        o_own = o_own.transpose(0, 1).reshape(1, hq, b * n, d)
        lse_own = lse_own.transpose(0, 1).reshape(1, hq, b * n)
        top = torch.maximum(lse_pre, lse_own)
        w_pre, w_own = (lse_pre - top).exp_().unsqueeze_(-1), (lse_own - top).exp_().unsqueeze_(-1)
        out.append(((o_pre * w_pre + o_own * w_own) / (w_pre + w_own)).index_select(2, g.real))
    out = torch.cat(out, dim=2) if len(out) > 1 else out[0]
    if batch.order is not None:
        out = out.index_select(2, batch.order)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, pool_attention)

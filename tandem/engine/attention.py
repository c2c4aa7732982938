"""The attention that reads and writes the KV pool in place (tandem/engine/kvpool.py).

A batched forward pass feeds the new tokens of many sessions as one flat sequence; the model's
linear layers see them all at once, and `pool_attention` (registered with transformers as the
"tandem_pool" attention when this module is imported) attends each session's queries to that
session's keys only.

A batch-invariant pass (the target's; see tandem/engine/gemm.py for the linear layers) attends
every new token in a call of its own: its query heads against its own keys, exactly as when it
is decoded alone, whichever other tokens of its session or of other sessions share the pass. The
other passes attend a session's new tokens together under a causal mask, and sessions whose runs
begin with copies of one prompt prefix read that prefix once (`Shared`): faster, but a token's
logits then depend on the other rows of its call in the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from tandem.engine.kvpool import KVPool
from tandem.speculation.tree import ancestors_mask

ATTENTION = "tandem_pool"


@dataclass
class Segment:
    """One session's new tokens inside a batched forward pass, and the positions they attend."""
    new: slice           # their place in the flat sequence
    keys: torch.Tensor   # [layers, 1, Hkv, positions, D]: a view of the session's run, every layer
    values: torch.Tensor
    mask: torch.Tensor | None    # [n, positions] additive causal mask; None when n == 1


@dataclass
class Row:
    """A new token attending alone: its own keys, in order (a run of the pool, or a tree node's
    committed positions and ancestors gathered)."""
    at: int                              # its place in the flat sequence
    slots: slice | torch.Tensor


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
    rows: list[Row]              # batch-invariant: every new token alone, in flat order (nothing else)

    MIN_SHARED = 16              # a shorter common prefix is attended per session
    SHORT = 32                   # sessions feeding more new tokens (prefill chunks) attend alone
    # Shared prefixes need attention's log-sum-exp, which torch exposes on the CPU; elsewhere
    # each session attends alone.

    @classmethod
    def build(cls, pool: KVPool, parts: list[tuple], invariant: bool = False) -> ForwardBatch:
        """parts: (start slot, past length, new tokens, the cache's prefix_key, tree) per session,
        in flat-sequence order; tree: None, or the new tokens' parents (tandem.speculation.tree),
        which then attend alone. invariant: every new token attends in a call of its own."""
        slots = torch.tensor([s for start, past, n, *_ in parts for s in range(start + past, start + past + n)],
                             device=pool.keys.device)
        if invariant:
            return cls(pool, slots, [], [], None, _rows(parts, pool.keys.device))
        offsets, by_source = [], {}
        for i, (start, past, n, (source, shared), tree) in enumerate(parts):
            offsets.append(offsets[-1] + parts[i - 1][2] if i else 0)
            # Grouped by prefix and by new tokens: a group pads every member's queries to its
            # longest, so one long proposal among single tokens would make the whole group pay for
            # its length (see docs/benchmarks.md, "Measurements behind the code's rules").
            # A prefill chunk (longer than SHORT) attends alone.
            if n <= cls.SHORT and tree is None:
                by_source.setdefault((source, n), []).append(i)
        alone, groups = [i for i, p in enumerate(parts) if p[2] > cls.SHORT or p[4] is not None], []
        for members in by_source.values():
            prefix = min(min(parts[i][3][1], parts[i][1]) for i in members)
            if len(members) > 1 and prefix >= cls.MIN_SHARED and pool.keys.device.type == "cpu":
                groups.append((members, prefix))
            else:
                alone.extend(members)
        alone.sort()

        def segment(i: int) -> Segment:
            start, past, n, _, tree = parts[i]
            run = slice(start, start + past + n)
            mask = None
            if n > 1:
                seen = torch.ones(n, past + n, dtype=torch.bool).tril(past)
                if tree is not None:
                    seen[:, past:] = ancestors_mask(tree)
                mask = torch.zeros(n, past + n, dtype=pool.keys.dtype)
                mask = mask.masked_fill_(~seen, float("-inf")).to(pool.keys.device)
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
        return cls(pool, slots, [segment(i) for i in alone], shared, order, [])


def _rows(parts: list[tuple], device) -> list[Row]:
    """Each new token of each session, attending its session's positions up to its own, or, in a
    tree, the committed positions and its ancestors: a slice of the run where those are every
    position before it (a chain's nodes, and the tree's first line), else gathered."""
    rows: list[Row] = []
    for start, past, n, _, tree in parts:
        if tree is None:
            rows.extend(Row(len(rows), slice(start, start + past + i + 1)) for i in range(n))
            continue
        committed = torch.arange(start, start + past)
        for i, mine in enumerate(ancestors_mask(tree)):
            if mine[:i + 1].all() and not mine[i + 1:].any():
                rows.append(Row(len(rows), slice(start, start + past + i + 1)))
                continue
            own = start + past + mine.nonzero().flatten()
            rows.append(Row(len(rows), torch.cat([committed, own]).to(device)))
    return rows


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def pool_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] for the T new tokens of the batch; writes the
    new keys and values into each session's run and returns [1, T, Hq, D]."""
    batch: ForwardBatch = kwargs["tandem_batch"]
    layer = module.layer_idx
    batch.pool.keys[layer].index_copy_(1, batch.slots, key[0])
    batch.pool.values[layer].index_copy_(1, batch.slots, value[0])
    if batch.rows:
        return _attend_rows(batch, layer, query, scaling), None
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
        # the weights are float32 (log-sum-exp is); the merged output returns to the model's dtype
        out.append(((o_pre * w_pre + o_own * w_own) / (w_pre + w_own)).to(query.dtype).index_select(2, g.real))
    out = torch.cat(out, dim=2) if len(out) > 1 else out[0]
    if batch.order is not None:
        out = out.index_select(2, batch.order)
    return out.transpose(1, 2), None


def _attend_rows(batch: ForwardBatch, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Each new token in a call of its own, the query heads of one key head as the rows of its
    call (no mask: the token attends all of its keys). [1, T, Hq, D]."""
    keys, values = batch.pool.keys[layer], batch.pool.values[layer]          # [Hkv, slots, D]
    hq, hkv, d = query.shape[1], keys.shape[0], query.shape[3]
    out = []
    for r in batch.rows:
        q = query[0, :, r.at].reshape(1, hkv, hq // hkv, d)
        if isinstance(r.slots, slice):
            k, v = keys[None, :, r.slots], values[None, :, r.slots]
        else:
            k, v = keys.index_select(1, r.slots)[None], values.index_select(1, r.slots)[None]
        out.append(F.scaled_dot_product_attention(q, k, v, scale=scaling).reshape(1, 1, hq, d))
    return torch.cat(out, dim=1)


AttentionInterface.register(ATTENTION, pool_attention)

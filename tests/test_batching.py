"""The KV pool, batched forward passes, and continuous batching across sessions stay lossless
(through the services as real processes: tests/test_batching_system.py)."""

import asyncio
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.engine.batcher import Batcher, Step
from tandem.engine.attention import ForwardBatch
from tandem.engine.kvpool import KVPool, KVPoolFull, SessionCache
from tandem.engine.modeling import CausalLM
from tandem.engine.thread import InferenceThread
from tandem.speculation.sampling import SamplingParams
from tests.local import reference

pytestmark = pytest.mark.unit


def test_pool_allocates_first_fit_coalesces_and_frees_on_collection():
    pool = KVPool(layers=1, kv_heads=1, head_dim=1, slots=10)
    a, b, c = SessionCache(pool, 3), SessionCache(pool, 3), SessionCache(pool, 4)
    assert (a.start, b.start, c.start, pool.free_slots()) == (0, 3, 6, 0)
    with pytest.raises(KVPoolFull, match="no run of 1 free slots"):
        SessionCache(pool, 1)
    a.release()
    c.release()
    with pytest.raises(KVPoolFull):
        SessionCache(pool, 5)                      # 7 free, but in runs of 3 and 4
    del b
    gc.collect()
    assert pool.free_slots() == 10 and SessionCache(pool, 10).start == 0


def test_compact_gathers_free_slots_into_one_run_and_keeps_contents():
    pool = KVPool(layers=2, kv_heads=1, head_dim=2, slots=10)
    a, b, c = SessionCache(pool, 3), SessionCache(pool, 3), SessionCache(pool, 4)
    c.length = 2
    pool.keys[:, :, 6:8] = 7.0
    a.release()
    with pytest.raises(KVPoolFull):
        SessionCache(pool, 4)
    assert pool.compact() == 2                      # c's two filled positions moved; b had none
    assert (b.start, c.start, pool.free_slots()) == (0, 3, 3)
    assert torch.equal(pool.keys[:, :, 3:5], torch.full((2, 1, 2, 2), 7.0))
    assert SessionCache(pool, 3).start == 7


def test_cache_grows_by_moving_once_and_keeps_its_contents(tiny_pair):
    model = CausalLM(str(tiny_pair[0]), kv_tokens=64)
    grown, fresh = model.new_cache(4), model.new_cache(40)
    ids = list(range(3, 23))
    model.forward(ids[:3], grown)
    start = grown.start
    tail = model.forward(ids[3:], grown)           # 20 positions do not fit in 4: moves
    assert grown.start != start and grown.capacity >= 20
    assert torch.allclose(tail, model.forward(ids, fresh)[3:], atol=1e-5)


def test_cache_grows_in_place_into_free_slots_and_moves_only_when_it_must():
    pool = KVPool(layers=1, kv_heads=1, head_dim=1, slots=10)
    a = SessionCache(pool, 3)
    pool.keys[0, 0, 0:3, 0] = torch.arange(1.0, 4.0)
    a.length = 3
    a.reserve(4)                                   # in place, with room to spare: twice the capacity
    assert (a.start, a.capacity) == (0, 6) and pool.free_runs() == [(6, 4)]
    a.reserve(8, spare=False)                      # in place, exactly
    assert (a.start, a.capacity) == (0, 8) and pool.free_runs() == [(8, 2)]
    b = SessionCache(pool, 1)                      # [8, 9): in the way, and no free run of 9
    with pytest.raises(KVPoolFull):
        a.reserve(9)
    assert (a.start, a.capacity) == (0, 8) and pool.free_runs() == [(9, 1)]
    b.release()
    a.reserve(10)                                  # in place; twice would not fit, 10 does
    assert (a.start, a.capacity) == (0, 10) and not pool.free_runs()
    assert pool.keys[0, 0, 0:3, 0].tolist() == [1.0, 2.0, 3.0]

    pool = KVPool(layers=1, kv_heads=1, head_dim=1, slots=12)
    a, b = SessionCache(pool, 4), SessionCache(pool, 2)
    pool.keys[0, 0, 0:2, 0] = torch.tensor([5.0, 6.0])
    a.length = 2
    a.reserve(5)                                   # moves; twice the capacity (8) does not fit, 5 does
    assert (a.start, a.capacity) == (6, 5) and pool.keys[0, 0, 6:8, 0].tolist() == [5.0, 6.0]
    assert pool.free_runs() == [(0, 4), (11, 1)]


def test_batched_forward_equals_transformers_on_each_sequence(tiny_pair):
    model = CausalLM(str(tiny_pair[0]), kv_tokens=256)
    ref = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()  # transformers' own attention
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (6, 11, 17)]
    with torch.no_grad():
        full = [ref(torch.tensor([s])).logits[0] for s in seqs]
    caches = [model.new_cache(8) for _ in seqs]
    out = model.forward_batch([(c, s[:3], None) for c, s in zip(caches, seqs)])
    for o, f in zip(out, full):
        assert torch.allclose(o, f[:3], atol=1e-4)
    # different lengths and new-token counts in one pass, one item asking for its last row only
    out = model.forward_batch([(caches[0], seqs[0][3:4], None), (caches[1], seqs[1][3:9], None),
                               (caches[2], seqs[2][3:17], 1)])
    assert torch.allclose(out[0], full[0][3:4], atol=1e-4)
    assert torch.allclose(out[1], full[1][3:9], atol=1e-4)
    assert out[2].shape == (1, model.vocab_size) and torch.allclose(out[2], full[2][16:17], atol=1e-4)
    caches[1].crop(5)                              # rollback: positions 5.. are recomputed
    out = model.forward_batch([(caches[1], seqs[1][5:11], None), (caches[0], seqs[0][4:6], None)])
    assert torch.allclose(out[0], full[1][5:11], atol=1e-4)
    assert torch.allclose(out[1], full[0][4:6], atol=1e-4)


# bfloat16 keeps 8 bits of mantissa: the pool's kernels and transformers' sum in other orders
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_sessions_with_a_copied_prefix_attend_it_together_and_stay_exact(tiny_pair, dtype):
    """Three sessions whose runs begin with copies of one prompt prefix (plus one that computed the
    same tokens itself) in one pass: the two feeding as many new tokens (at different lengths)
    attend the prefix once, together, merged with each one's own positions; the one feeding more
    attends alone (a group pads its queries to its longest member). Every session's logits equal
    transformers' on its own sequence, at the same precision (bfloat16: the merge of the two
    partial attentions, weighed in float32, comes back in bfloat16). Only a pass that need not be
    batch-invariant groups them."""
    model = CausalLM(str(tiny_pair[0]), kv_tokens=512, dtype=dtype, batch_invariant=False)
    ref = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=getattr(torch, dtype)).eval()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, model.vocab_size, (24,), generator=g).tolist()
    seqs = [prefix + torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 14, 5)]
    with torch.no_grad():
        full = [ref(torch.tensor([s])).logits[0] for s in seqs]
    donor = model.new_cache(64)
    model.forward(prefix, donor)
    caches = [model.new_cache(64) for _ in range(3)] + [model.new_cache(64)]
    for c in caches[:3]:
        c.copy_prefix(donor, len(prefix))
    assert len({c.prefix_key()[0] for c in caches[:3]}) == 1 != len({c.prefix_key()[0] for c in caches})
    model.forward(seqs[3][:24], caches[3])          # same tokens, own computation: attended alone
    model.forward(seqs[1][24:25], caches[1])        # one position more of its own than the first
    # two new tokens for two sessions, more for the others (a proposal, a prefill chunk)
    feeds = [(24, 26), (25, 27), (24, 38), (24, 29)]
    batch = [(c, s[a:b], None) for c, s, (a, b) in zip(caches, seqs, feeds)]
    parts = [(c.start, c.length, len(ids), c.prefix_key(), None) for c, ids, _ in batch]
    shared = ForwardBatch.build(model.pool, parts).shared
    assert [g.shape for g in shared] == [(2, 2, 3)]     # 2 sessions, 2 queries each, up to 3 own positions
    out = model.forward_batch(batch)
    for o, f, (a, b) in zip(out, full, feeds):
        assert torch.allclose(o.float(), f[a:b].float(), atol=TOLERANCE[dtype]), (o - f[a:b]).abs().max()


def test_a_donor_that_rewrites_lent_positions_takes_a_new_identity():
    pool = KVPool(layers=1, kv_heads=1, head_dim=1, slots=100)
    donor, taker, late = SessionCache(pool, 30), SessionCache(pool, 30), SessionCache(pool, 30)
    donor.length = 20
    taker.copy_prefix(donor, 18)
    assert taker.prefix_key() == (donor.uid, 18) and donor.prefix_key() == (donor.uid, 20)
    donor.crop(19)                                  # above what it lent: still the same bits
    assert donor.prefix_key()[0] == taker.prefix_key()[0]
    donor.crop(10)                                  # positions 10..17 will be written anew
    assert donor.prefix_key()[0] != taker.prefix_key()[0]
    taker.crop(12)                                  # a copy cropped keeps the rest of its origin
    assert taker.prefix_key()[1] == 12
    late.copy_prefix(taker, 12)                     # a copy of a copy names the first source
    assert late.prefix_key() == taker.prefix_key()


def test_batcher_runs_concurrent_sessions_in_shared_passes(tiny_models):
    """Sessions of different prompt lengths decode at once; each gets its own greedy output, and
    the passes really were shared."""
    model = tiny_models[0]
    params = SamplingParams(max_new_tokens=12)
    prompts = [[3, 17, 42, 9], [100, 101, 7, 8, 9, 10, 11], [5], list(range(20, 45))]
    sizes: list[int] = []

    async def decode(batcher, prompt):
        cache = model.new_cache(len(prompt) + params.max_new_tokens)
        logits = (await batcher.forward(Step(cache, prompt, 1))).value
        out = []
        while len(out) < params.max_new_tokens:
            t = int(logits[0].argmax())
            if t in model.eos_ids:
                break
            out.append(t)
            logits = (await batcher.forward(Step(cache, [t], 1))).value
        return out

    async def main():
        thread = InferenceThread("test-batcher")
        batcher = Batcher(model, thread)
        batcher.observers.append(lambda sessions, tokens, prefill, seconds: sizes.append(sessions))
        try:
            return await asyncio.gather(*(decode(batcher, p) for p in prompts))
        finally:
            thread.shutdown()

    outputs = asyncio.run(main())
    for prompt, out in zip(prompts, outputs):
        assert out == reference(model, prompt, params)
    assert max(sizes) == len(prompts)


def test_batcher_fails_only_the_item_that_breaks(tiny_models):
    model = tiny_models[0]

    async def main():
        thread = InferenceThread("test-batcher-errors")
        batcher = Batcher(model, thread)
        good, bad, raising = model.new_cache(8), model.new_cache(8), model.new_cache(8)
        bad.length = model.max_context - 1           # two more tokens would pass the context

        def boom(logits):
            raise RuntimeError("a bad follow-up")
        try:
            return await asyncio.gather(batcher.forward(Step(good, [1, 2], 1)), batcher.forward(Step(bad, [1, 2], 1)),
                                        batcher.forward(Step(raising, [1, 2], 1, boom)), return_exceptions=True)
        finally:
            thread.shutdown()

    ok, too_long, failed = asyncio.run(main())
    assert ok.value.shape == (1, model.vocab_size) and ok.batch_size == 3
    assert isinstance(too_long, ValueError) and "context" in str(too_long)
    assert isinstance(failed, RuntimeError)


def test_a_short_budget_cuts_the_longest_proposals_so_every_round_goes(tiny_models):
    """Rounds of 10, 10 and 2 tokens against a budget of 12: all three go in one pass, the two long
    ones cut to 5, and a round that may not be cut (least None) keeps all its tokens."""
    model = tiny_models[0]

    async def main():
        thread = InferenceThread("test-batcher-cut")
        batcher = Batcher(model, thread, max_tokens=12)
        caches = [model.new_cache(32) for _ in range(4)]
        for c in caches:
            model.forward([1, 2, 3], c)
        try:
            first = await asyncio.gather(*(batcher.forward(Step(c, list(range(4, 4 + n)), None, least=1))
                                           for c, n in zip(caches, (10, 10, 2))))
            whole = await asyncio.gather(batcher.forward(Step(caches[3], list(range(4, 14)), None)),
                                         batcher.forward(Step(caches[0], [5, 6, 7, 8], None, least=1)))
            return first, whole
        finally:
            thread.shutdown()

    first, whole = asyncio.run(main())
    assert [r.fed for r in first] == [5, 5, 2] and {r.batch_size for r in first} == {3}
    assert [r.value.shape[0] for r in first] == [5, 5, 2]
    assert whole[0].fed == 10 and whole[1].fed == 2 and whole[0].batch_size == 2   # 12 - 10 left


def test_a_fragmented_pool_evicts_the_fewest_idle_sessions_that_make_a_run():
    """Runs: live [0,3), idle b [3,5), free [5,6), idle c [6,8), live [8,10). Four slots take both
    idle sessions; three take one, the least recently used (b, kept first)."""
    from verify_worker.engine import TargetSession
    from verify_worker.kvstore import SessionKeeper

    def layout():
        pool = KVPool(layers=1, kv_heads=1, head_dim=1, slots=10)
        caches = [SessionCache(pool, n) for n in (3, 2, 1, 2, 2)]
        caches[2].release()
        keeper = SessionKeeper(10)
        for sid, c in (("b", caches[1]), ("c", caches[3])):
            keeper.idle.put(sid, TargetSession(sid, SamplingParams(), 1, [1], c))
        return pool, keeper, caches

    pool, keeper, caches = layout()
    assert keeper.evict_for(pool, 3) and list(keeper.idle) == ["c"] and SessionCache(pool, 3).start == 3
    pool, keeper, caches = layout()
    assert keeper.evict_for(pool, 4) and not keeper.idle and SessionCache(pool, 4).start == 3
    pool, keeper, caches = layout()
    assert not keeper.evict_for(pool, 6) and len(keeper.idle) == 2      # a live run is in the way

"""Model loading options and the padded forward pass keep the model's outputs."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from draft_worker.model import ModelDrafter
from tandem.engine.gemm import Int8Linear
from tandem.engine.modeling import CausalLM
from tandem.speculation.sampling import SamplingParams
from tests.local import reference, speculate
from verify_worker.engine import VerifyEngine

pytestmark = pytest.mark.unit


def test_padded_forward_keeps_logits_and_cache(tiny_pair):
    plain, padded = CausalLM(str(tiny_pair[0])), CausalLM(str(tiny_pair[0]))
    padded.padded_length = {1: 4, 2: 8, 3: 4}
    a, b = plain.new_cache(), padded.new_cache()
    full = []
    for feed in ([5, 6, 7], [8], [9, 10], [11]):
        la, lb = plain.forward(feed, a), padded.forward(feed, b)
        full.append(la)
        assert lb.shape == la.shape == (len(feed), plain.vocab_size)
        assert torch.allclose(la, lb, atol=1e-4), feed
        assert b.length == a.length
    c = padded.new_cache()
    for i, feed in enumerate(([5, 6, 7], [8], [9, 10])):      # only the last row, padded or not
        tail = padded.forward(feed, c, last=1)
        assert tail.shape == (1, plain.vocab_size)
        assert torch.allclose(tail, full[i][-1:], atol=1e-4)
    assert c.length == a.length - 1


def test_calibrate_only_pads_to_longer_lengths(tiny_pair):
    model = CausalLM(str(tiny_pair[0]))
    model.calibrate(6, repeats=1)
    assert all(n < m <= 6 for n, m in model.padded_length.items())


def test_pass_calibration_times_doubling_sizes_and_gives_the_pool_back(tiny_pair):
    model = CausalLM(str(tiny_pair[0]), kv_tokens=4096)
    model.calibrate_passes(64, context=16)
    assert [s for s, _ in model.pass_ms] == [1, 2, 4, 8, 16, 32, 64]
    assert all(ms > 0 for _, ms in model.pass_ms)
    assert model.pool.free_slots() == 4096
    model.calibrate_passes(64, context=16, budget_s=1e-9)       # no time: the first size only
    assert len(model.pass_ms) == 1
    small = CausalLM(str(tiny_pair[0]), kv_tokens=100)          # room for 2 sessions: no curve
    small.calibrate_passes(64, context=16)
    assert small.pass_ms == [] and small.pool.free_slots() == 100


def test_padding_everywhere_keeps_greedy_output(tiny_pair, tiny_models):
    target, draft = tiny_models
    padded = CausalLM(str(tiny_pair[0]))
    padded.padded_length = {n: n + 3 for n in range(1, 10)}
    params = SamplingParams(max_new_tokens=30)
    prompt = [3, 17, 42, 9]
    out, drafted, _ = speculate(VerifyEngine(padded), ModelDrafter(draft), prompt, params, 4)
    assert drafted > 0
    assert out == reference(target, prompt, params)


def test_int8_draft_is_lossless(tiny_pair, tiny_models):
    target = tiny_models[0]
    draft = CausalLM(str(tiny_pair[1]), dtype="int8")
    assert any(isinstance(m, Int8Linear) for m in draft.model.modules())
    params = SamplingParams(max_new_tokens=30)
    for prompt in ([3, 17, 42, 9], [100, 101, 7]):
        out, drafted, accepted = speculate(VerifyEngine(target), ModelDrafter(draft), prompt, params, 4)
        assert out == reference(target, prompt, params)
        assert drafted > 0


def test_confidence_stops_a_proposal_early(tiny_models):
    target, draft = tiny_models
    params = SamplingParams(max_new_tokens=30)
    prompt = [3, 17, 42, 9]
    eager = ModelDrafter(draft, confidence=0.0).start(params, target.eos_ids, len(prompt))
    wary = ModelDrafter(draft, confidence=1.01).start(params, target.eos_ids, len(prompt))
    assert len(eager.propose(prompt, 6).tokens) == 6
    assert len(wary.propose(prompt, 6).tokens) == 1          # no token is certain enough to go on
    out, _, _ = speculate(VerifyEngine(target), ModelDrafter(draft, confidence=0.5), prompt, params, 6)
    assert out == reference(target, prompt, params)


def test_draft_sessions_copy_a_shared_prompt_prefix_from_live_and_finished_ones(tiny_models):
    """A second session with the same 30-token prompt copies the first's KV instead of computing
    it, while the first is live and after it finished (its cache is kept), and proposes the same
    greedy tokens; a prompt sharing fewer than 16 tokens computes its own."""
    target, draft = tiny_models
    params = SamplingParams(max_new_tokens=8)
    prompt = list(range(5, 35))
    drafter = ModelDrafter(draft)
    first = drafter.start(params, target.eos_ids, len(prompt))
    alone = first.propose(prompt, 4).tokens
    second = drafter.start(params, target.eos_ids, len(prompt))
    assert second.propose(prompt, 4).tokens == alone
    assert second.cache.prefix_key()[0] == first.cache.prefix_key()[0]      # copied, not computed
    first.close()
    second.close()
    third = drafter.start(params, target.eos_ids, len(prompt))
    assert third.propose(prompt, 4).tokens == alone
    assert third.cache.prefix_key()[1] >= 16
    other = drafter.start(params, target.eos_ids, len(prompt))
    other.propose(prompt[:10] + [7] * 20, 4)
    assert other.cache.prefix_key() == (other.cache.uid, other.cache.length)  # nothing to copy


@pytest.mark.parametrize("dtype, device, message", [
    ("int2", "cpu", "dtype must be one of"),
    ("int8", "cuda", "CPU only"),
    ("int4", "cuda", "CPU only"),
    ("float16", "cpu", "GPU only"),
])
def test_bad_dtype_is_refused(tiny_pair, dtype, device, message):
    with pytest.raises(ValueError, match=message):
        CausalLM(str(tiny_pair[1]), device=device, dtype=dtype)


def test_no_padding_past_the_context_window(tiny_pair):
    model = CausalLM(str(tiny_pair[0]), lean=False)          # transformers' forward, whose inputs it records
    model.padded_length = {1: 8}
    fed = []
    inner = model.model
    model.model = lambda **kw: fed.append(kw["input_ids"].shape[1]) or inner(**kw)    # records input lengths
    cache = model.new_cache()
    model.forward([7] * 100, cache, last=1)
    model.forward([8], cache)                 # room to spare: padded
    model.forward([7] * (model.max_context - 104), cache, last=1)
    model.forward([8], cache)                 # 8 positions would run past the window: fed as 1
    assert fed == [100, 8, model.max_context - 104, 1]
    assert cache.length == model.max_context - 2


def test_packed_linear_matches_the_stock_kernel():
    from tandem.engine.gemm import PackedLinear
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    packed = PackedLinear(linear)
    assert packed.weight is None                              # the original is not kept
    for rows in (1, 9):
        x = torch.randn(1, rows, 64)
        assert packed(x).shape == (1, rows, 96)
        assert torch.allclose(packed(x), linear(x), atol=1e-5)


def tied_copy(folder: Path, to: Path) -> Path:
    """The model in `folder` with its output layer tied to the input embedding (lm_head's own
    matrix dropped from the weights, or transformers would not tie them)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(to / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_packing_swaps_float32_linears_only(tiny_pair, tmp_path):
    from tandem.engine.gemm import PackedLinear
    packed, stock = CausalLM(str(tiny_pair[0])), CausalLM(str(tiny_pair[0]), packed_gemm=False)
    assert packed.packed and not stock.packed
    kinds = {type(m) for m in packed.model.modules()}
    assert PackedLinear in kinds and torch.nn.Linear not in kinds
    # The tiny models' output layer is a matrix of its own: packed, its original freed like the rest.
    assert not packed.model.config.tie_word_embeddings
    assert isinstance(packed.model.get_output_embeddings(), PackedLinear)
    assert all(m.weight is None for m in packed.model.modules() if isinstance(m, PackedLinear))
    a, b = packed.new_cache(), stock.new_cache()
    for feed in ([5, 6, 7, 8, 9], [10], [11, 12, 13]):
        assert torch.allclose(packed.forward(feed, a), stock.forward(feed, b), atol=1e-4)
    # A tied output layer is packed too but keeps referring to the embedding's weight, still shared.
    tied_folder = tied_copy(tiny_pair[0], tmp_path / "tied")
    tied, tied_stock = CausalLM(str(tied_folder)), CausalLM(str(tied_folder), packed_gemm=False)
    head = tied.model.get_output_embeddings()
    assert tied.model.config.tie_word_embeddings and isinstance(head, PackedLinear)
    assert head.weight is tied.model.get_input_embeddings().weight
    assert all(m.weight is None for m in tied.model.modules() if isinstance(m, PackedLinear) and m is not head)
    a, b = tied.new_cache(), tied_stock.new_cache()
    assert torch.allclose(tied.forward([5, 6, 7], a), tied_stock.forward([5, 6, 7], b), atol=1e-4)
    int8 = CausalLM(str(tiny_pair[1]), dtype="int8")
    assert not int8.packed and PackedLinear not in {type(m) for m in int8.model.modules()}
    bf16 = CausalLM(str(tiny_pair[1]), dtype="bfloat16")
    assert bf16.packed and torch.nn.Linear not in {type(m) for m in bf16.model.modules()}
    # invariant only on the packed or per-row int8 kernels, and when asked for
    assert packed.invariant and int8.invariant and bf16.invariant and not stock.invariant
    assert CausalLM(str(tiny_pair[1]), dtype="int8", packed_gemm=False).invariant
    assert not CausalLM(str(tiny_pair[1]), batch_invariant=False).invariant


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=60),
                                    SamplingParams(max_new_tokens=60, temperature=0.8, seed=7)], ids=["greedy", "sampled"])
def test_lookup_seeded_steps_propose_the_same_tokens_in_fewer_passes(tiny_models, params):
    """A draft step that also feeds what a prompt lookup predicts takes as many of its next tokens
    from that one pass as agree with the lookup: along one session's growing context (each
    proposal's first half kept, then a token of its own), the proposals equal a token-a-step
    draft's, sampled ones drawn with the same random numbers, in fewer forward passes."""
    target, draft = tiny_models
    prompt = [3, 17, 42, 9, 3, 17, 42, 9, 3, 17]
    passes = {}
    counted = draft.forward_batch

    def proposals(lookup_tokens: int) -> list[list[int]]:
        state = ModelDrafter(draft, lookup_tokens=lookup_tokens).start(params, target.eos_ids, len(prompt))
        context, out, n = list(prompt), [], 0

        def counting(items, *a):
            nonlocal n
            n += 1
            return counted(items, *a)
        draft.forward_batch = counting
        try:
            for i in range(12):
                tokens = state.propose(context, 8).tokens
                out.append(tokens)
                context += tokens[:len(tokens) // 2] + [(i * 7) % 50 if i % 3 else tokens[-1]]
            assert state.cache.length == len(state.cached)
        finally:
            del draft.forward_batch
            state.close()
        passes[lookup_tokens] = n
        return out

    plain = proposals(0)
    assert proposals(4) == plain
    assert sum(map(len, plain)) > 40
    assert passes[4] < passes[0]


def test_a_proposal_of_one_step_takes_one_pass_and_the_tokens_it_agrees_with(tiny_models):
    """steps=1 (a streamed run's step): one token without a lookup, and with one as many as the
    pass agrees with, the start of the same proposal drafted without a limit."""
    target, draft = tiny_models
    params = SamplingParams(max_new_tokens=40)
    prompt = [3, 17, 42, 9, 3, 17, 42, 9, 3, 17]
    whole = ModelDrafter(draft, confidence=0.0).start(params, target.eos_ids, len(prompt)).propose(prompt, 8).tokens
    assert len(ModelDrafter(draft).start(params, target.eos_ids, len(prompt)).propose(prompt, 8, steps=1).tokens) == 1
    seeded = ModelDrafter(draft, confidence=0.0, lookup_tokens=4).start(params, target.eos_ids, len(prompt))
    context, drafted, steps = list(prompt), [], 0
    while len(drafted) < len(whole):
        step = seeded.propose(context, len(whole) - len(drafted), steps=1).tokens
        assert 1 <= len(step) <= 5
        drafted += step
        context += step
        steps += 1
    assert drafted == whole
    assert steps < len(whole)

"""The lean decoder (tandem/engine/decoder.py) gives transformers' own numbers, bit for bit, for
every kind of pass CausalLM runs, at every precision, and leaves other architectures to
transformers."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tandem.engine import rowgemm
from tandem.engine.decoder import Decoder
from tandem.engine.modeling import CausalLM
from tandem.testing import build_tokenizer

pytestmark = pytest.mark.unit

DTYPES = ["float32", "bfloat16", "int8"] + (["int4"] if rowgemm.int4() else [])


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A 2-layer Qwen2 with biased q/k/v projections and a tied output layer."""
    folder = tmp_path_factory.mktemp("qwen")
    tokenizer = build_tokenizer(folder, 320)
    config = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)          # Qwen2's biases, which Llama's layers lack
    model.save_pretrained(folder)
    return folder


def passes(model: CausalLM, taps: tuple[int, ...]) -> list:
    """Every kind of pass: a prefill, a step, a chain, a tree and two sessions batched (one of them
    sharing the first's prompt), returning all their outputs."""
    a, b = model.new_cache(), model.new_cache()
    prompt = [3, 17, 42, 9, 100, 7, 250, 31, 8, 64, 5, 77, 12, 200, 19, 40, 2]
    out = [model.forward(prompt, a, taps=taps), model.forward([11], a, last=1, taps=taps),
           model.forward([12, 13, 14, 15], a, taps=taps)]
    b.copy_prefix(a, len(prompt))
    out += model.forward_batch([(a, [16, 17, 18, 19], None, [-1, 0, 0, 2]), (b, [21, 22], None)], taps)
    out += model.forward_batch([(a, [5], 1), (b, [6], 1)], taps)
    for cache in (a, b):
        cache.release()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_lean_decoder_equals_transformers_forward(which, invariant, dtype, tiny_pair, tiny_qwen):
    folder = str(tiny_pair[0] if which == "llama" else tiny_qwen)
    lean, hf = (CausalLM(folder, dtype=dtype, batch_invariant=invariant, lean=on) for on in (True, False))
    assert lean.decoder is not None and hf.decoder is None
    layers = lean.model.config.num_hidden_layers
    for taps in ((), (0, 1, layers)):
        got, want = passes(lean, taps), passes(hf, taps)
        assert len(got) == len(want) == 7
        for g, w in zip(got, want):
            for gt, wt in zip(*((g, w) if taps else ((g,), (w,)))):
                assert gt.shape == wt.shape and torch.equal(gt, wt)


def test_lean_decoder_can_tell_a_wrong_pass(tiny_pair):
    """The comparison above can fail: a decoder whose rotary embedding is off by one position
    gives other logits."""
    lean, hf = CausalLM(str(tiny_pair[0])), CausalLM(str(tiny_pair[0]), lean=False)
    right = lean.decoder
    lean.decoder = lambda ids, positions, *rest: right(ids, positions + 1, *rest)
    assert not torch.equal(passes(lean, ())[0], passes(hf, ())[0])


def test_other_architectures_run_through_transformers():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert Decoder.of(LlamaForCausalLM(config)) is None            # its rotary frequencies change with length
    plain = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert Decoder.of(plain) is not None
    plain.config.model_type = "qwen3"
    assert Decoder.of(plain) is None

"""A draft's output layer trimmed to part of its vocabulary (tandem.engine.vocab): the kept tokens'
logits are the whole layer's, the others are never proposed, and speculation stays lossless."""

import pytest
import torch

from draft_worker.model import ModelDrafter
from tandem.engine import vocab
from tandem.engine.modeling import CausalLM
from tandem.engine.vocab import kept_ids, trim_output
from tandem.speculation.sampling import SamplingParams
from tests.local import reference, speculate
from verify_worker.engine import VerifyEngine

pytestmark = pytest.mark.unit

KEEP = 160          # of the tiny models' 320 tokens


def test_the_first_ids_and_the_special_ones_are_kept():
    assert kept_ids(4, 10, [8, 2, 12, -1]).tolist() == [0, 1, 2, 3, 8]
    assert kept_ids(20, 10, []).tolist() == list(range(10))


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_kept_logits_are_the_whole_layers_and_the_rest_minus_infinity(tiny_pair, dtype):
    draft = tiny_pair[1]
    full = CausalLM(str(draft), dtype=dtype, batch_invariant=False)
    trimmed = CausalLM(str(draft), dtype=dtype, batch_invariant=False, vocab=KEEP)
    ids = [5, 17, 42, 250, 7]
    a = full.forward(ids, full.new_cache())
    b = trimmed.forward(ids, trimmed.new_cache())
    assert b.shape == a.shape == (len(ids), full.vocab_size)
    assert torch.equal(b[:, :KEEP], a[:, :KEEP])
    assert torch.isneginf(b[:, KEEP:]).all()


def test_a_token_seen_is_scored_from_then_on_up_to_the_cap(tiny_pair):
    """Code repeats its own identifiers, whose tokens rank low: every token fed to the draft is
    scored from the next pass on, from the full layer's row."""
    draft = tiny_pair[1]
    full = CausalLM(str(draft), batch_invariant=False)
    trimmed = CausalLM(str(draft), batch_invariant=False, vocab=KEEP)
    ids = [5, 17, 300]
    assert torch.isneginf(trimmed.forward(ids, trimmed.new_cache())[:, 300]).all()
    vocab.see(trimmed.model, [300, 301, 5])
    a, b = full.forward(ids, full.new_cache()), trimmed.forward(ids, trimmed.new_cache())
    assert torch.allclose(b[:, [300, 301]], a[:, [300, 301]], atol=1e-5)
    assert torch.isneginf(b[:, 302:]).all() and torch.equal(b[:, :KEEP], a[:, :KEEP])
    head = trimmed.model.get_output_embeddings()
    head.max_seen = 3
    vocab.see(trimmed.model, [310, 311, 312])
    b = trimmed.forward(ids, trimmed.new_cache())
    assert torch.isfinite(b[:, 310]).all() and torch.isneginf(b[:, 311:313]).all()


def test_a_special_token_past_the_kept_ids_is_kept(tiny_pair):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1])
    assert trim_output(model, KEEP, [300]) == KEEP + 1
    logits = model(torch.tensor([[5, 17]])).logits[0, -1]
    assert torch.isfinite(logits[300]) and torch.isneginf(logits[KEEP:300]).all()


def test_nothing_is_trimmed_when_the_size_covers_the_vocabulary(tiny_pair):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[1])
    head = model.get_output_embeddings()
    assert trim_output(model, 0, []) == trim_output(model, 320, []) == 320
    assert model.get_output_embeddings() is head


@pytest.mark.parametrize("prompt", [[5, 17, 42], [250, 251, 7, 9, 300]])
def test_greedy_speculation_with_a_trimmed_draft_equals_the_target(tiny_models, tiny_pair, prompt):
    """The target alone is the oracle (tests/local.reference: its own greedy decode). The trimmed
    draft proposes kept ids and ids it was fed only, and some of its proposals are rejected where
    the target's token is one it left out, or another."""
    target = tiny_models[0]
    trimmed = CausalLM(str(tiny_pair[1]), batch_invariant=False, vocab=KEEP)
    drafts: list = []
    params = SamplingParams(max_new_tokens=40)
    out, drafted, accepted = speculate(VerifyEngine(target), ModelDrafter(trimmed), prompt, params, 4, drafts=drafts)
    assert out == reference(target, prompt, params)
    fed = set(prompt + out)
    assert drafted > 0 and all(t < KEEP or t in fed for d in drafts for t in d.tokens)
    assert any(t >= KEEP for t in out), "the target must go where the draft cannot for this test to mean much"

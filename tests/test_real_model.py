"""A real pretrained model (SmolLM2-135M-Instruct, fetched as a preset): greedy speculative output
equals the model's own greedy decode, with the n-gram drafter and with the model as its own draft."""

import pytest

from draft_worker.drafters import ModelDrafter, NgramDrafter
from draft_worker.local import reference, speculate
from tandem.modeling import CausalLM, load_tokenizer
from tandem.sampling import SamplingParams
from verify_worker.engine import VerifyEngine

PRESET = "smollm2-135m-instruct"
PROMPTS = ["def fibonacci(n):", "import os\n\nfor name in os.listdir('.'):\n    print(name)\n\n# again\nfor name in"]


@pytest.fixture(scope="module")
def smollm():
    return CausalLM(PRESET, threads=2), load_tokenizer(PRESET)


@pytest.mark.parametrize("method,k", [("ngram", 4), ("ngram", 8), ("model", 3)])
def test_real_model_greedy_is_lossless(smollm, method, k):
    model, tok = smollm
    engine = VerifyEngine(model)
    drafter = NgramDrafter() if method == "ngram" else ModelDrafter(model)
    accepted_total = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        params = SamplingParams(max_new_tokens=40)
        out, drafted, accepted = speculate(engine, drafter, ids, params, k)
        assert out == reference(model, ids, params), prompt
        accepted_total += accepted
    assert accepted_total > 0

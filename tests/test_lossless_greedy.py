"""Greedy speculative output equals the target's own greedy decode, token for token."""

import pytest

from draft_worker.drafters import NgramDrafter
from draft_worker.model import ModelDrafter
from tandem.speculation.sampling import SamplingParams
from tests.local import reference, speculate
from verify_worker.engine import VerifyEngine

pytestmark = pytest.mark.unit

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "The quick brown fox", "Grüße 🙂"]


@pytest.mark.parametrize("method", ["model", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 4, 8])
def test_greedy_equals_target(tiny_models, tiny_pair, method, k):
    from transformers import AutoTokenizer
    target, draft = tiny_models
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    engine = VerifyEngine(target)
    drafter = ModelDrafter(draft) if method == "model" else NgramDrafter()
    total_drafted = total_accepted = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        params = SamplingParams(max_new_tokens=40)
        out, drafted, accepted = speculate(engine, drafter, ids, params, k)
        assert out == reference(target, ids, params), (prompt, k)
        total_drafted += drafted
        total_accepted += accepted
    assert total_drafted > 0
    if method == "model":
        # the noisy draft agrees often but not always: both paths of the verdict are exercised
        assert 0 < total_accepted < total_drafted

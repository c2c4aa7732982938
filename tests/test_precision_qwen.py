"""The slow tier of tests/test_invariance.py, on the Qwen pair the benchmarks serve
(Qwen2.5-Coder-1.5B-Instruct, its 0.5B sibling in int8 as the draft): at float32, bfloat16 and int8
the same tokens' logits are equal every way a pass can hold them, and greedy speculation equals the
same worker's plain decoding. Several minutes on 2 cores: run by `make test-slow` (TANDEM_SLOW_TESTS=1),
skipped otherwise."""


import pytest
import torch

from draft_worker.drafters import NgramDrafter
from draft_worker.model import ModelDrafter
from tandem.engine.modeling import CausalLM, load_tokenizer
from tandem.speculation.sampling import SamplingParams
from tests.local import reference, speculate
from tests.test_invariance import CHAT, every_way
from verify_worker.engine import VerifyEngine

pytestmark = [pytest.mark.unit, pytest.mark.slow]

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8"])
def target(request):
    torch.set_num_threads(2)
    return CausalLM(TARGET, threads=2, dtype=request.param)


@pytest.fixture(scope="module")
def draft():
    return CausalLM(DRAFT, threads=2, dtype="int8", batch_invariant=False)


def test_qwen_logits_do_not_depend_on_the_pass(target):
    tok = load_tokenizer(TARGET)
    prompt = tok("def read_config(path):\n    \"\"\"Reads a TOML file and returns a dict.\"\"\"\n").input_ids
    ways = every_way(target, prompt, tok("    with open(path) as f:").input_ids[:4])
    for name, logits in ways.items():
        assert torch.equal(logits, ways["one at a time"]), (target.dtype, name)


def test_qwen_speculation_equals_plain_decoding(target, draft):
    tok = load_tokenizer(TARGET)
    engine, params = VerifyEngine(target), SamplingParams(max_new_tokens=64)
    for question in CHAT:
        ids = tok(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                          add_generation_prompt=True), add_special_tokens=False).input_ids
        want = reference(target, ids, params)
        for drafter, k in ((ModelDrafter(draft), 8), (NgramDrafter(), 8)):
            out, drafted, _ = speculate(engine, drafter, ids, params, k)
            assert out == want, (target.dtype, question, type(drafter).__name__)

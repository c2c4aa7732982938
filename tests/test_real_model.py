"""A real pretrained model (SmolLM2-135M-Instruct, fetched as a preset): greedy speculative output
equals the model's own greedy decode, with the n-gram drafter and with the model as its own draft;
with a repetition penalty it equals transformers' generate, logprobs included."""

import pytest

from draft_worker.drafters import NgramDrafter
from draft_worker.model import ModelDrafter
from tandem.engine.modeling import CausalLM, load_tokenizer
from tandem.speculation.sampling import SamplingParams
from tests.local import reference, speculate
from verify_worker.engine import VerifyEngine

pytestmark = pytest.mark.unit

PRESET = "smollm2-135m-instruct"
PROMPTS = ["def fibonacci(n):", "import os\n\nfor name in os.listdir('.'):\n    print(name)\n\n# again\nfor name in"]


@pytest.fixture(scope="module")
def smollm():
    return CausalLM(PRESET, threads=2), load_tokenizer(PRESET)


@pytest.mark.parametrize("method,k", [pytest.param("ngram", 4, marks=pytest.mark.slow), ("ngram", 8), ("model", 3)])
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


def test_real_model_penalty_and_logprobs_equal_transformers(smollm):
    """Speculative greedy decoding with repetition_penalty 1.2 against transformers' generate on a
    model loaded apart from the service's (whose linears are repacked): the same tokens, and each
    token's raw logprob within 1e-3 of output_logits'."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.modeling import resolve
    model, tok = smollm
    oracle = AutoModelForCausalLM.from_pretrained(resolve(PRESET), dtype=torch.float32).eval()
    engine = VerifyEngine(model)
    params = SamplingParams(max_new_tokens=40, repetition_penalty=1.2, logprobs=True)
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        reports: list = []
        out, drafted, _ = speculate(engine, NgramDrafter(), ids, params, 4, reports)
        with torch.no_grad():
            ref = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=40, repetition_penalty=1.2, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        want = ref.sequences[0, len(ids):].tolist()
        assert out == want[:len(out)] and len(out) == len(want) - (want[-1] in model.eos_ids), prompt
        logp = torch.log_softmax(torch.cat(ref.logits)[:len(out)].float(), dim=-1)
        errors = [abs(r.logprob - float(row[t])) for r, row, t in zip(reports, logp, out)]
        assert len(errors) == len(out) and max(errors) < 1e-3, max(errors)
        assert drafted > 0


def test_real_model_with_the_shipped_head_equals_transformers(smollm):
    """The head shipped for SmolLM2 drafts beside it (chat prompts, as it was trained): greedy
    output equals transformers' generate on a model loaded apart from the service's, and the head
    is right often enough to matter (it was trained; an untrained one is tested in test_head)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.modeling import resolve
    from tandem.head.checkpoint import load_drafter
    from tests.local import speculate_head
    from verify_worker.headspec import HeadSpeculation
    model, tok = smollm
    oracle = AutoModelForCausalLM.from_pretrained(resolve(PRESET), dtype=torch.float32).eval()
    spec = HeadSpeculation(load_drafter("shipped", model, PRESET), VerifyEngine(model))
    drafted = accepted = generated = 0
    for question in ("Write a Python function that returns the largest of three numbers.",
                     "What is the difference between a list and a tuple?"):
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        out, d, a = speculate_head(VerifyEngine(model), spec, ids, SamplingParams(max_new_tokens=48))
        with torch.no_grad():
            ref = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=48, pad_token_id=tok.eos_token_id)
        want = ref[0, len(ids):].tolist()
        assert out == want[:len(out)] and len(out) == len(want) - (want[-1] in model.eos_ids), question
        drafted, accepted, generated = drafted + d, accepted + a, generated + len(out)
    # a round gives its accepted tokens and one of the target's: over half a token accepted a round
    # (an untrained head gets about none; trees propose more tokens than they can accept, so per
    # proposed token the rate says less)
    rounds = generated - accepted
    assert drafted > 0 and accepted > rounds / 2, (accepted, rounds, drafted)


def test_the_head_proposes_a_prompt_lookup_where_the_answer_copies_the_prompt(smollm):
    """Asked to repeat a text, the head's rounds propose what followed the context's end earlier in
    it (prompt lookup) where that promises more than the head's block: the output is still the
    target's own greedy output, lookups were proposed, and they were accepted more often than the
    head's blocks."""
    from tandem.head.checkpoint import load_drafter
    from tests.local import open_head_session
    from verify_worker.headspec import HeadSpeculation
    model, tok = smollm
    engine = VerifyEngine(model)
    spec = HeadSpeculation(load_drafter("shipped", model, PRESET), engine)
    text = ("Repeat this sentence three times: the committee will meet on Tuesday at nine in the "
            "small room on the second floor.")
    ids = tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False).input_ids
    params = SamplingParams(max_new_tokens=60)
    s = open_head_session(engine, spec, ids, params)
    spec.draft(s, s.drafting)
    by_source = {True: [0, 0], False: [0, 0]}          # lookup? -> [proposed, accepted]
    while not s.stop_reason:
        looked_up = s.drafting.proposal is not None and s.drafting.proposal.ngram > 0
        step, proposed = spec.step(s, s.drafting)
        verdict = step.then(engine.model.forward(step.tokens, s.cache, taps=spec.taps))
        by_source[looked_up][0] += len(proposed)
        by_source[looked_up][1] += verdict.accepted
    assert s.tokens[len(ids):] == reference(model, ids, params)
    (lookup_proposed, lookup_accepted), (head_proposed, head_accepted) = by_source[True], by_source[False]
    assert lookup_proposed > 0 and s.drafting.lookups, by_source
    assert lookup_accepted / lookup_proposed > head_accepted / max(1, head_proposed), by_source


@pytest.mark.parametrize("method", ["model", pytest.param("ngram", marks=pytest.mark.slow)])
def test_real_model_trees_equal_transformers(smollm, method):
    """Trees on real weights: SmolLM2 verifies the trees of its own int8 copy (branches at the
    copy's second choices, leaves where it is unsure) or of prompt lookup, with repetition_penalty
    1.2; the output is transformers' generate on a model loaded apart, and some rounds take a
    branch."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.engine.modeling import resolve
    from tandem.speculation.tree import TreeBudget
    model, tok = smollm
    oracle = AutoModelForCausalLM.from_pretrained(resolve(PRESET), dtype=torch.float32).eval()
    drafter = ModelDrafter(CausalLM(PRESET, threads=2, dtype="int8")) if method == "model" else NgramDrafter()
    params = SamplingParams(max_new_tokens=48, repetition_penalty=1.2)
    taken = 0
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        drafts: list = []
        out, _, _ = speculate(VerifyEngine(model), drafter, ids, params, 8, budget=TreeBudget(12, 2, 0.02),
                              drafts=drafts)
        with torch.no_grad():
            ref = oracle.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=48, repetition_penalty=1.2,
                                  pad_token_id=tok.eos_token_id)
        want = ref[0, len(ids):].tolist()
        assert out == want[:len(out)] and len(out) == len(want) - (want[-1] in model.eos_ids), prompt
        taken += sum(d.parents is not None for d in drafts)
    assert taken > 0

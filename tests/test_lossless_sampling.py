"""Speculative sampling produces the target's distribution, end to end through the engine and
the drafters (tiny models, in process). The exact target distribution of the first two tokens is
computed by enumeration and compared with a chi-square test."""

import math

import pytest
import torch

from draft_worker.drafters import NgramDrafter
from draft_worker.model import ModelDrafter
from tandem.engine.modeling import CausalLM
from tandem.speculation.sampling import SamplingParams, probabilities
from tests.local import speculate
from verify_worker.engine import VerifyEngine

pytestmark = pytest.mark.unit

N_SAMPLES = 1500


def chi2_threshold(dof: int, z: float = 3.09) -> float:
    """99.9% quantile of chi-square (Wilson-Hilferty approximation)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


def exact_two_token_distribution(model, prompt, params) -> dict[tuple[int, int], float]:
    cache = model.new_cache()
    p1 = probabilities(model.forward(prompt, cache)[-1:], params)[0]
    joint = {}
    for t1 in p1.nonzero().flatten().tolist():
        if t1 in model.eos_ids:
            joint[(t1, t1)] = float(p1[t1])
            continue
        p2 = probabilities(model.forward(prompt + [t1], model.new_cache())[-1:], params)[0]
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def chi2(observed: dict, expected: dict, n: int) -> tuple[float, int]:
    big = {c for c, p in expected.items() if p * n >= 5}
    stat, dof = 0.0, len(big)
    rest_obs = sum(v for c, v in observed.items() if c not in big)
    rest_exp = n * sum(p for c, p in expected.items() if c not in big)
    for c in big:
        stat += (observed.get(c, 0) - expected[c] * n) ** 2 / (expected[c] * n)
    if rest_exp >= 1:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        dof += 1
    return stat, dof - 1


def lookup_friendly_prompt(model, params) -> list[int]:
    """A prompt 'r + r[:6]' where prompt lookup proposes r[6] and the target gives it >= 15%, so
    that with random weights some proposals are accepted and some rejected."""
    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        r = torch.randint(1, model.vocab_size, (12,), generator=g).tolist()
        prompt = r + r[:6]
        p = probabilities(model.forward(prompt, model.new_cache())[-1:], params)[0]
        if 0.15 <= float(p[r[6]]) <= 0.85:
            return prompt
    raise AssertionError("no prompt found where the lookup proposal is plausible")


CASES = [   # the first a variant (top-k is in tests/test_distribution.py's configs too)
    pytest.param("model", SamplingParams(temperature=1.0, top_k=4, max_new_tokens=2), marks=pytest.mark.slow),
    ("model", SamplingParams(temperature=1.5, top_p=0.8, max_new_tokens=2)),
    ("ngram", SamplingParams(temperature=3.0, top_k=5, max_new_tokens=2)),
    # a draft scoring half the vocabulary (tandem.engine.vocab): q is 0 where p is not
    ("trimmed", SamplingParams(temperature=1.5, top_p=0.8, max_new_tokens=2)),
]
TRIMMED = 160


@pytest.mark.parametrize("method,params", CASES)
def test_speculative_sampling_matches_target(tiny_models, tiny_pair, method, params):
    from dataclasses import replace

    from transformers import AutoTokenizer
    target, draft = tiny_models
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompt = lookup_friendly_prompt(target, params) if method == "ngram" else tok("def add(a, b):").input_ids
    expected = exact_two_token_distribution(target, prompt, params)
    engine = VerifyEngine(target)
    if method == "trimmed":
        draft = CausalLM(str(tiny_pair[1]), batch_invariant=False, vocab=TRIMMED)
    drafter = NgramDrafter() if method == "ngram" else ModelDrafter(draft)
    observed: dict = {}
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        out, d, a = speculate(engine, drafter, prompt, replace(params, seed=seed), k=2)
        drafted, accepted = drafted + d, accepted + a
        key = tuple((out + target.eos_ids * 2)[:2])    # an end-of-sequence counts as a token
        observed[key] = observed.get(key, 0) + 1
    assert drafted > 0 and 0 < accepted < drafted
    if method == "trimmed":
        assert sum(c for key, c in observed.items() if key[0] >= TRIMMED) > 50   # drawn from the residual
    n = sum(observed.values())
    stat, dof = chi2(observed, expected, n)
    assert dof >= 2
    assert stat < chi2_threshold(dof), (stat, dof, observed)


def test_same_seed_same_output(tiny_models, tiny_pair):
    from transformers import AutoTokenizer
    target, draft = tiny_models
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompt = tok("def add(a, b):").input_ids
    engine, drafter = VerifyEngine(target), ModelDrafter(draft)
    runs = {}
    for seed in (7, 7, 8, 9):
        params = SamplingParams(temperature=2.0, top_p=0.95, seed=seed, max_new_tokens=24)
        runs.setdefault(seed, []).append(speculate(engine, drafter, prompt, params, k=3)[0])
    assert runs[7][0] == runs[7][1]
    assert len({tuple(r[0]) for r in runs.values()}) > 1

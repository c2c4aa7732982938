"""Token trees on the verify side: one pass over a tree attends each node to its own ancestors, and
the verdict keeps the accepted path's KV in order, so that trees carrying the target's own tokens
on any branch, among decoys, give exactly what transformers' generate gives on the target alone,
with penalties, min_new_tokens and a guide (xgrammar's own processor as the guide's oracle)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tandem.speculation import tree
from tandem.speculation.sampling import SamplingParams
from verify_worker.engine import ProtocolError, VerifyEngine

pytestmark = pytest.mark.unit

PROMPT = "def add(a, b):"
PARENTS = [-1, 0, 1, -1, 3, 0, 2, 4]     # three branches of different depths


def test_a_tree_pass_gives_each_node_the_rows_of_its_path_fed_as_a_chain(tiny_models, oracle):
    model = tiny_models[0]
    prompt = oracle[1](PROMPT).input_ids
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, model.vocab_size, (len(PARENTS),), generator=g).tolist()
    other = model.new_cache(64)
    model.forward(prompt, other)
    cache = model.new_cache(64)
    model.forward(prompt[:-1], cache)
    # a tree and another session's chain in one pass
    rows, _ = model.forward_batch([(cache, [prompt[-1], *tokens], None, tree.fed(PARENTS)), (other, tokens[:3], None)])
    assert cache.length == len(prompt) + len(PARENTS)
    for path in tree.paths(PARENTS):
        alone = model.new_cache(64)
        want = model.forward(prompt + [tokens[j] for j in path], alone)[len(prompt) - 1:]
        got = rows[[0, *(j + 1 for j in path)]]
        # batch-invariant, bit for bit: a node's row is its path's row fed alone as a chain
        assert torch.equal(got, want) if model.invariant else torch.allclose(got, want, atol=1e-4), \
            (path, (got - want).abs().max())
    # the kept path's KV, moved in order, is what feeding the path as a chain leaves
    path = [3, 4, 7]
    cache.keep_path(len(prompt), path)
    nxt = model.forward([5], cache)
    alone = model.new_cache(64)
    assert torch.allclose(nxt, model.forward(prompt + [tokens[j] for j in path] + [5], alone, last=1), atol=1e-4)


def random_tree(truth: list[int], vocab: int, rng: random.Random, budget: int = 10) -> tuple[list[int], list[int]]:
    """A tree under `budget` nodes with up to len(truth) of the target's next tokens on one branch
    (not always the first) and decoys around it, some of them right beside the truth; parents first."""
    depth = rng.randint(0, min(len(truth), budget // 2))
    tokens, parents, node = [], [], -1
    used = {}

    def add(token: int, parent: int) -> int | None:
        if (parent, token) in used or len(tokens) >= budget:
            return None
        used[(parent, token)] = len(tokens)
        tokens.append(token)
        parents.append(parent)
        return len(tokens) - 1

    for d in range(depth):
        if rng.random() < 0.6:                         # a decoy sibling first
            decoy = add(rng.randrange(3, vocab), node)
            if decoy is not None and rng.random() < 0.5:
                add(rng.randrange(3, vocab), decoy)
        nxt = add(truth[d], node)
        if nxt is None:
            break
        node = nxt
    while len(tokens) < budget and rng.random() < 0.7:   # decoys anywhere
        add(rng.randrange(3, vocab), rng.randrange(-1, len(tokens)))
    return tokens, parents


def generate(oracle, prompt: list[int], params: SamplingParams, processors=()) -> list[int]:
    model, _ = oracle
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens or None,
                             repetition_penalty=params.repetition_penalty, logits_processor=list(processors),
                             pad_token_id=model.generation_config.eos_token_id)
    gen = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return gen[:-1] if gen and gen[-1] == eos else gen


def run_trees(engine: VerifyEngine, prompt: list[int], params: SamplingParams, want: list[int], seed: int,
              grammar=None, reports: list | None = None) -> tuple[list[int], int]:
    """Decodes with random trees that hide `want`'s next tokens on a branch; (output, rounds that
    took a path off the first branch). Each verdict's logprob reports go to `reports`."""
    rng = random.Random(seed)
    s = engine.open("trees", prompt, params, grammar=grammar)
    engine.prefill(s)
    off_first = 0
    while not s.stop_reason:
        done = len(s.tokens) - len(prompt)
        tokens, parents = random_tree(want[done:] + [0] * 4, engine.model.vocab_size, rng)
        v = engine.verify(s, tokens, parents=parents)
        if reports is not None:
            reports += v.logprobs
        off_first += v.accepted > 0 and tokens[0] != v.token_ids[0]
    return s.tokens[len(prompt):], off_first


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=40),
    SamplingParams(max_new_tokens=40, repetition_penalty=1.5),
    SamplingParams(max_new_tokens=24, min_new_tokens=12, repetition_penalty=1.2),
], ids=["plain", "repetition", "min-new-tokens"])
def test_trees_with_the_target_on_any_branch_equal_transformers(tiny_models, oracle, params):
    engine = VerifyEngine(tiny_models[0])
    prompt = oracle[1](PROMPT).input_ids
    want = generate(oracle, prompt, params)
    got, off_first = run_trees(engine, prompt, params, want, seed=1)
    assert got == want
    assert off_first > 0            # paths through later siblings were taken: their KV moved


def test_trees_under_a_guide_equal_transformers_with_xgrammar(tiny_pair, tiny_models, oracle):
    import xgrammar as xgr

    from tandem.engine.modeling import load_tokenizer
    from tandem.speculation.grammar import Grammars, Guide
    model, tok = tiny_models[0], load_tokenizer(str(tiny_pair[0]))
    regex = "[ab][a-d ]{3,30}"
    eos = oracle[0].generation_config.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.vocab_size, stop_token_ids=[eos])
    processor = xgr.contrib.hf.LogitsProcessor(xgr.GrammarCompiler(info).compile_regex(regex))
    params = SamplingParams(max_new_tokens=30, repetition_penalty=1.3, guide=Guide("regex", regex))
    prompt = oracle[1](PROMPT).input_ids
    want = generate(oracle, prompt, params, [processor])
    matcher = asyncio.run(Grammars(tok, model.vocab_size, model.eos_ids).matcher_within(params.guide, 10.0, []))
    got, off_first = run_trees(VerifyEngine(model), prompt, params, want, seed=2, grammar=matcher)
    assert got == want
    assert off_first > 0


def test_a_bad_tree_is_refused_and_leaves_the_session_as_it_was(tiny_models, oracle):
    engine = VerifyEngine(tiny_models[0])
    prompt = oracle[1](PROMPT).input_ids
    s = engine.open("bad", prompt, SamplingParams(max_new_tokens=8))
    engine.prefill(s)
    for tokens, parents, why in [([5, 5], [-1, -1], "same id"), ([5, 6], [-1, 2], "earlier index"),
                                 ([5, 6], [-1], "one parent per token")]:
        with pytest.raises(ProtocolError, match=why):
            engine.verify(s, tokens, parents=parents)
    sampled = engine.open("sampled", prompt, SamplingParams(max_new_tokens=8, temperature=0.7, seed=1))
    engine.prefill(sampled)
    with pytest.raises(ProtocolError, match="greedy"):
        engine.verify(sampled, [5, 6], parents=[-1, -1])
    assert s.cache.length == len(prompt) - 1 and engine.verify(s, [5, 6], parents=[-1, -1]).token_ids


@pytest.mark.parametrize("k", [3, 8])
def test_model_drafted_trees_equal_the_target_alone(tiny_models, tiny_pair, k):
    """The draft model's trees (branches at its second choices, drafted in the same passes), judged
    by the verify engine, give the target's own greedy output; some rounds take a branch."""
    from transformers import AutoTokenizer

    from draft_worker.model import ModelDrafter
    from tests.local import reference, speculate
    target, draft = tiny_models
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    engine, drafter = VerifyEngine(target), ModelDrafter(draft, confidence=0.0)
    budget = tree.TreeBudget(nodes=2 * k, branches=2, at_least=0.0)
    branched = 0
    for prompt in ["def add(a, b):", "for i in range(10):\n", "The quick brown fox"]:
        ids = tok(prompt).input_ids
        params = SamplingParams(max_new_tokens=40, repetition_penalty=1.1)
        proposals = []
        out, drafted, accepted = speculate(engine, drafter, ids, params, k, budget=budget, drafts=proposals)
        assert out == reference(target, ids, params), prompt
        trees = [p for p in proposals if p.parents is not None]
        assert trees and all(len(p.tokens) <= 2 * k and tree.problem(p.tokens, p.parents) is None for p in trees)
        branched += sum(p.line < len(p.tokens) for p in trees)
    assert branched > 0


def test_ngram_trees_merge_the_continuations_of_every_occurrence():
    from tandem.speculation.ngram import lookup, lookup_tree
    context = [1, 2, 3, 9, 9, 1, 2, 3, 4, 4, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    tokens, parents, n = lookup_tree(context, k=4, nodes=10, branches=2)
    assert (tokens[:4], n) == lookup(context, 4)          # the latest occurrence is the main line
    assert tree.problem(tokens, parents) is None
    assert sorted(tuple(tokens[j] for j in path) for path in tree.paths(parents)) == [(4, 4, 1, 2), (5, 6, 7, 1), (9, 9)]
    assert lookup_tree(context, k=4, nodes=10, branches=0)[1] is None
    assert lookup_tree([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], k=4, nodes=10, branches=2) == ([3, 4, 1, 2], None, 3)


def test_ngram_drafted_trees_equal_the_target_alone(tiny_models, oracle):
    """Prompt lookup over a prompt whose phrases recur with different continuations: its trees
    take branches, and the output is transformers' own."""
    from draft_worker.drafters import NgramDrafter
    from tests.local import speculate
    target = tiny_models[0]
    text = "the cat sat. the cat ran. the dog sat. the dog ran. the cat"
    ids = oracle[1](text).input_ids
    params = SamplingParams(max_new_tokens=40)
    proposals = []
    out, _, _ = speculate(VerifyEngine(target), NgramDrafter(), ids, params, 6,
                          budget=tree.TreeBudget(nodes=12, branches=2), drafts=proposals)
    assert out == generate(oracle, ids, params)
    assert any(p.parents is not None for p in proposals)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_min_new_tokens_blocks_an_end_that_falls_on_its_last_blocked_position(tiny_models, oracle, shape):
    """The target's natural end falls exactly at the last position min_new_tokens blocks: that row
    (depth-dependent in a tree) must still block it, and the next may not. The end-of-sequence id
    is set to the token the target writes there, for the oracle and the engine alike."""
    model, hf = tiny_models[0], oracle[0]
    prompt = oracle[1](PROMPT).input_ids
    free = generate(oracle, prompt, SamplingParams(max_new_tokens=30))
    at = next(i for i in range(4, len(free)) if free[i] not in free[:i])
    saved, saved_hf = model.eos_ids, hf.generation_config.eos_token_id
    model.eos_ids, hf.generation_config.eos_token_id = [free[at]], free[at]
    try:
        params = SamplingParams(max_new_tokens=30, min_new_tokens=at + 1)
        want = generate(oracle, prompt, params)
        assert want[:at] == free[:at] and len(want) > at and want[at] != free[at]   # blocked there, it goes on
        engine = VerifyEngine(model)
        if shape == "tree":
            got, _ = run_trees(engine, prompt, params, want, seed=3)
        else:
            from tests.local import speculate
            got = speculate(engine, None, prompt, params, 0)[0]
        assert got == want
    finally:
        model.eos_ids, hf.generation_config.eos_token_id = saved, saved_hf


def test_a_tree_verdict_reports_each_token_from_the_row_it_was_decided_from(tiny_models, oracle):
    from tests.local import speculate
    engine = VerifyEngine(tiny_models[0])
    prompt = oracle[1](PROMPT).input_ids
    params = SamplingParams(max_new_tokens=24, logprobs=True, top_logprobs=3)
    plain: list = []
    want = speculate(engine, None, prompt, params, 0, reports=plain)[0]
    got: list = []
    out, off_first = run_trees(engine, prompt, params, want, seed=4, reports=got)
    assert out == want and off_first > 0
    assert [r.token_id for r in got] == want
    for a, b in zip(got, plain):
        assert a.rank == b.rank and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_a_round_budget_prices_a_node_by_what_its_position_costs():
    budget = tree.TreeBudget.for_round
    assert budget(0, 16, 1000, 2, 0.0).nodes == 16 and budget(4, 16, 1000, 2, 0.0).nodes == 4
    assert budget(0, 16, 6, 2, 0.0).nodes == 5                           # the context window holds 5 more
    assert budget(0, 16, 1000, 2, 0.0).at_least == tree.TreeBudget.AT_LEAST
    assert budget(0, 16, 1000, 2, 0.4).at_least == 0.4                   # the verify worker's price
    flat, sloped = [20.0] * 17, [200.0 + 10 * i for i in range(17)]      # ms per pass by length
    assert budget(0, 16, 1000, 2, 0.0, flat, 12.0).at_least == tree.TreeBudget.AT_LEAST
    assert budget(0, 16, 1000, 2, 0.0, sloped, 12.0).at_least == pytest.approx(0.010 * 12.0)

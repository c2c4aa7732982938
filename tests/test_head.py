"""The trained head (tandem.head): drafting beside the target, its file formats, and how many
drafted positions a round verifies.

- Speculation with a head through the verify worker's own rounds (verify_worker.headspec, run in
  one process by tests.local.speculate_head) gives exactly the target's greedy output, whether the
  head drafts badly (an untrained head: nearly every proposal rejected) or well (a head whose Markov table
  holds the target's own continuation: most accepted); after every round the head's context holds
  exactly what one teacher-forced pass of the target gives for the committed tokens.
- Sampled requests complete within their limits and a seed gives the same output again.
- The training forward (tandem.head.train.block_outputs) and the drafter agree on every block
  position: the token, the distribution, the confidence; features at or after the anchor change
  nothing in training (the block mask).
- The head file round-trips (bfloat16 storage), a DeepSpec folder loads to the same head, and
  broken files or configurations fail with a message saying what is wrong.
- choose_k against a brute-force search; the Markov and confidence heads change what is drafted.
"""

import copy
import hashlib
import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.head import checkpoint
from tandem.head.checkpoint import HeadFileError
from tandem.head.drafter import (HeadContext, HeadDraft, HeadDrafter, choose_k, gain_at_price, head_tree,
                                 pays_for_head_pass, worth_its_price)
from tandem.speculation import tree
from tandem.head.model import BlockHead, HeadConfig
from tandem.speculation.drafting import RowDrafter
from tandem.speculation.sampling import SamplingParams
from tandem.testing import build_random_head
from tests.local import open_head_session, reference, speculate_head
from verify_worker.engine import VerifyEngine
from verify_worker import headspec
from verify_worker.headspec import HeadSpeculation

pytestmark = pytest.mark.unit

BLOCK = 4
PROMPTS = [[5, 6, 7, 8, 9], [3], "def add(a, b):", "The quick brown fox"]


@pytest.fixture(scope="module")
def target(tiny_pair, tiny_models):
    """(target folder, CausalLM, tokenizer)."""
    from tandem.engine.modeling import load_tokenizer
    return tiny_pair[0], tiny_models[0], load_tokenizer(str(tiny_pair[0]))


@pytest.fixture(scope="module")
def head_file(target, tmp_path_factory):
    return build_random_head(tmp_path_factory.mktemp("head") / "head.safetensors", target[0], block_size=BLOCK)


@pytest.fixture(scope="module")
def prompts(target):
    tok = target[2]
    return [p if isinstance(p, list) else tok(p).input_ids for p in PROMPTS]


def serving(target, path, leaves: int = headspec.HEAD_TREE_LEAVES) -> HeadSpeculation:
    """The verify worker's head speculation, as `verify_worker --head path` builds it."""
    folder, model, _ = target
    return HeadSpeculation(checkpoint.load_drafter(str(path), model, str(folder)), VerifyEngine(model), leaves)


def bare_drafter(target, head: BlockHead) -> HeadDrafter:
    """A drafter over an unpacked head, bound to the target's embedding table and output layer."""
    model = target[1].model
    return HeadDrafter(head, model.get_input_embeddings(), model.get_output_embeddings())


def draw_block(drafter: HeadDrafter, ctx, anchor: int, k: int, temperature: float = 0.0,
               generator: torch.Generator | None = None):
    """The head's draft after `anchor` with no processing stage but the temperature (and no end of
    sequence): the raw block, position by position."""
    rows = RowDrafter([anchor], 1, SamplingParams(temperature=temperature), [], None, generator)
    try:
        return drafter.draft(ctx, anchor, k, rows)
    finally:
        rows.finish()


def teacher_forced(model, ids: list[int], taps) -> torch.Tensor:
    """Tapped features [len(ids), taps * hidden] from one pass of the target over ids."""
    cache = model.new_cache(len(ids) + 1)
    try:
        return model.forward(ids, cache, last=1, taps=tuple(taps))[1]
    finally:
        cache.release()


def checked_rounds(spec: HeadSpeculation, model, monkeypatch, seen: dict) -> None:
    """Before every round: the head has states for a position per committed token but the last, in
    its context or held back, and its context holds the keys and values that a fresh context made
    from one teacher-forced pass holds for those positions."""
    real = spec.step

    def step(s, h, *args, **kwargs):
        assert h.known() == s.cache.length == len(s.tokens) - 1
        if h.context.length:
            fresh = spec.drafter.new_context()
            spec.drafter.extend(fresh, teacher_forced(model, s.tokens[:h.context.length], spec.taps))
            for (k, v), (k2, v2) in zip(h.context.view(), fresh.view()):
                torch.testing.assert_close(k, k2, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(v, v2, atol=1e-4, rtol=1e-4)
        seen["rounds"] = seen.get("rounds", 0) + 1
        seen["held"] = max(seen.get("held", 0), h.known() - h.context.length)
        return real(s, h, *args, **kwargs)

    monkeypatch.setattr(spec, "step", step)


# ---------------------------------------------------------------------------------------------
# Greedy: exactly the target's output
# ---------------------------------------------------------------------------------------------

def test_greedy_with_an_untrained_head_is_the_targets_output(target, head_file, prompts, monkeypatch):
    model = target[1]
    spec = serving(target, head_file)
    seen: dict = {}
    checked_rounds(spec, model, monkeypatch, seen)
    drafted = 0
    for prompt in prompts:
        for n in (1, 2, 9, 30):
            params = SamplingParams(max_new_tokens=n)
            out, d, a = speculate_head(VerifyEngine(model), spec, prompt, params)
            assert out == reference(model, prompt, params), (prompt, n)
            assert len(out) <= n
            drafted += d
            if n == 1:
                assert d == 0            # no room for a proposal: the round is the target's token
    assert drafted > 0 and seen["rounds"] > 0


def table_head(target, path, sequences: list[list[int]], second: bool = False, confidence: float = 4.0,
               leaves: int = headspec.HEAD_TREE_LEAVES) -> HeadSpeculation:
    """Serving speculation with a head whose Markov table proposes, after each token, what followed
    it first in `sequences` (bias 100 on that token, far above the untrained base logits), and
    whose confidence is sigmoid(`confidence`) everywhere (~0.98: every round proposes a whole
    block). second: the table's token is the head's second choice (99), after another (100)."""
    spec = serving(target, path, leaves)
    head = spec.drafter.head
    vocab = head.markov_head.markov_w2.weight.shape[0]
    follows: dict[int, int] = {}
    for seq in sequences:
        for a, b in zip(seq, seq[1:]):
            follows.setdefault(a, b)
    r = head.config.markov_rank
    assert len(follows) <= r
    with torch.no_grad():
        head.markov_head.markov_w1.weight.zero_()
        head.markov_head.markov_w2.weight.zero_()
        for i, (a, b) in enumerate(follows.items()):
            head.markov_head.markov_w1.weight[a, i] = 1.0
            head.markov_head.markov_w2.weight[b, i] = 99.0 if second else 100.0
            if second:
                head.markov_head.markov_w2.weight[(b + 7) % vocab, i] = 100.0
        head.confidence_head.proj.weight.zero_()
        head.confidence_head.proj.bias.fill_(confidence)
    return spec


def test_greedy_with_a_head_that_drafts_well_is_the_targets_output(target, prompts, tmp_path, monkeypatch):
    """Most proposals accepted, several positions a round: the committed positions' states extend
    the head's context, the rejected ones do not."""
    model = target[1]
    path = build_random_head(tmp_path / "table.safetensors", target[0], seed=3, block_size=BLOCK, markov_rank=64)
    params = SamplingParams(max_new_tokens=30)
    refs = [reference(model, p, params) for p in prompts]
    spec = table_head(target, path, [p[-1:] + r for p, r in zip(prompts, refs)])
    seen: dict = {}
    checked_rounds(spec, model, monkeypatch, seen)
    # a calibrated pass-cost curve (greedy rounds weigh the confidences against it), nearly flat
    monkeypatch.setattr(model, "forward_ms", [2.0 + 0.01 * i for i in range(9)])
    drafted = accepted = 0
    for prompt, ref in zip(prompts, refs):
        out, d, a = speculate_head(VerifyEngine(model), spec, prompt, params)
        assert out == ref, prompt
        drafted, accepted = drafted + d, accepted + a
    tokens = sum(len(r) for r in refs)
    assert accepted > tokens / 2 and seen["rounds"] < tokens / 2, (accepted, drafted, seen, tokens)


def test_greedy_trees_take_the_heads_second_choices_and_stay_the_targets_output(target, prompts, tmp_path,
                                                                                 monkeypatch):
    """A head whose Markov table puts the target's token second, after another, unsure of each
    position (confidence 0.5), with and without leaves: both give the target's output, and the head's
    context holds the accepted path's states, not the rejected chain's (checked_rounds); with
    leaves, rounds go through a second choice (a token a chain would not have had) and fewer
    rounds are needed."""
    from tandem.service import metrics
    model = target[1]
    path = build_random_head(tmp_path / "second.safetensors", target[0], seed=4, block_size=BLOCK, markov_rank=64)
    params = SamplingParams(max_new_tokens=20)
    refs = [reference(model, p, params) for p in prompts]
    monkeypatch.setattr(model, "forward_ms", [2.0 + 0.01 * i for i in range(17)])
    through = metrics.TREE_ROUNDS.labels("branch")
    seen: dict = {}
    for leaves in (0, headspec.HEAD_TREE_LEAVES):
        spec = table_head(target, path, [p[-1:] + r for p, r in zip(prompts, refs)], second=True, confidence=0.0,
                          leaves=leaves)
        monkeypatch.setattr(spec, "_lookup", lambda *a: None)     # the head's blocks only, no prompt lookups
        seen[leaves] = {}
        checked_rounds(spec, model, monkeypatch, seen[leaves])
        before = through._value.get()
        for prompt, ref in zip(prompts, refs):
            out, _, _ = speculate_head(VerifyEngine(model), spec, prompt, params)
            assert out == ref, (leaves, prompt)
        seen[leaves]["branch"] = through._value.get() - before
    chains, trees = seen[0], seen[headspec.HEAD_TREE_LEAVES]
    assert chains["branch"] == 0 and trees["branch"] > trees["rounds"] / 3, seen
    assert trees["rounds"] < chains["rounds"] * 0.9, seen


def test_a_lookup_beside_the_heads_chain_goes_in_as_a_branch_and_the_output_stays_the_targets(
        target, prompts, tmp_path, monkeypatch):
    """A confident head whose first choices are wrong, and a prompt lookup (here: the target's own
    continuation, promising less than the head) beside it: the lookup goes in as a branch off the
    root, rounds go through it, its record counts what was taken, the head's context holds the
    accepted path's states (checked_rounds), and the output is the target's."""
    from tandem.service import metrics
    from tandem.speculation.survival import Survival
    model = target[1]
    path = build_random_head(tmp_path / "branch.safetensors", target[0], seed=4, block_size=BLOCK, markov_rank=64)
    params = SamplingParams(max_new_tokens=20)
    refs = [reference(model, p, params) for p in prompts]
    spec = table_head(target, path, [p[-1:] + r for p, r in zip(prompts, refs)], second=True, confidence=2.0)
    seen: dict = {}
    checked_rounds(spec, model, monkeypatch, seen)
    monkeypatch.setattr(model, "forward_ms", [2.0 + 0.01 * i for i in range(17)])
    current: dict = {}

    def truth(s, h):
        follow = current["ref"][len(s.tokens) - s.prompt_len:][:4]
        if not follow:
            return None
        h.lookups.setdefault(3, Survival())
        return HeadDraft(follow, [0.5] * len(follow), None, ngram=3)
    monkeypatch.setattr(spec, "_lookup", truth)
    through = metrics.TREE_ROUNDS.labels("branch")
    before = through._value.get()
    records = []
    real = spec._judge

    def judge(s, h, *args):
        verdict = real(s, h, *args)
        records.append(h.lookups[3].accepted[1])
        return verdict
    monkeypatch.setattr(spec, "_judge", judge)
    accepted = 0
    for prompt, ref in zip(prompts, refs):
        current["ref"] = ref
        out, _, a = speculate_head(VerifyEngine(model), spec, prompt, params)
        assert out == ref, prompt
        accepted += a
    rounds = seen["rounds"]
    assert through._value.get() - before > rounds / 4 and accepted > rounds, (accepted, rounds)
    assert max(records) > 0                  # the lookup's record saw its tokens taken


def test_leaves_are_the_likeliest_second_choices_that_pay():
    """head_tree: the chain, then second choices as leaves (a sibling of the chain's token at their
    position), likeliest first (reach x rejection x share), while they pay and room is left."""
    draft = HeadDraft([10, 11, 12, 13], [0.5, 0.5, 0.9, 0.5], alternatives=[(20, 1.0), (21, 0.5), (-1, 0.0), (23, 1.0)])
    # values: j0 0.5, j1 0.5*0.5*0.5 = 0.125, j2 none, j3 0.5*0.5*0.9*0.5 = 0.1125

    def shape(t):
        return t.tokens, t.parents

    t = head_tree(draft, 4, 4, lambda v, n: v > 0.1)
    assert shape(t) == ([10, 11, 12, 13, 20, 21, 23], [-1, 0, 1, 2, -1, 0, 2])
    assert t.chain == 4 and t.leaves == {4: 0.5, 5: 0.125, 6: 0.1125} and t.lookup == []
    assert shape(head_tree(draft, 4, 2, lambda v, n: True)) == ([10, 11, 12, 13, 20, 21], [-1, 0, 1, 2, -1, 0])
    assert shape(head_tree(draft, 4, 4, lambda v, n: True, leaves=1)) == ([10, 11, 12, 13, 20], [-1, 0, 1, 2, -1])
    assert shape(head_tree(draft, 4, 4, lambda v, n: v > 0.12)) == ([10, 11, 12, 13, 20, 21], [-1, 0, 1, 2, -1, 0])
    assert shape(head_tree(draft, 4, 4, lambda v, n: n < 5)) == ([10, 11, 12, 13, 20], [-1, 0, 1, 2, -1])
    assert shape(head_tree(draft, 2, 4, lambda v, n: True)) == ([10, 11, 20, 21], [-1, 0, -1, 0])
    assert shape(head_tree(draft, 4, 4, lambda v, n: False)) == ([10, 11, 12, 13], None)
    assert shape(head_tree(HeadDraft([10], [0.5]), 1, 4, lambda v, n: True)) == ([10], None)
    # scaled by how often such leaves were taken: at half, only position 0's (0.25) beats 0.1
    t = head_tree(draft, 4, 4, lambda v, n: v > 0.1, scale=0.5)
    assert shape(t) == ([10, 11, 12, 13, 20], [-1, 0, 1, 2, -1]) and t.leaves == {4: 0.25}
    # likeliest first, not by position
    late = HeadDraft([10, 11], [0.9, 0.1], alternatives=[(20, 0.1), (21, 1.0)])     # j0 0.01, j1 0.81
    assert shape(head_tree(late, 2, 4, lambda v, n: True)) == ([10, 11, 21, 20], [-1, 0, 0, -1])


def test_a_prompt_lookup_goes_in_as_a_branch_where_it_leaves_the_heads_chain():
    """head_tree with the other source's proposal: its tokens after the chain's shared prefix as a
    line, each node valued at that source's reach; a second choice that is the branch's first token
    gives no leaf; the lookup's tokens are listed (shared prefix, then the branch)."""
    looked = HeadDraft([10, 11, 30, 31, 32], [0.9, 0.9, 0.9, 0.5, 0.1], ngram=3)     # reach .9 .81 .729 .36 .036
    draft = HeadDraft([10, 11, 12, 13], [0.5, 0.5, 0.9, 0.5], alternatives=[(20, 1.0), (21, 0.5), (30, 1.0), (23, 1.0)],
                      other=looked)
    t = head_tree(draft, 4, 16, lambda v, n: v > 0.1)
    assert (t.tokens, t.parents) == ([10, 11, 12, 13, 30, 31, 20, 21, 23], [-1, 0, 1, 2, 1, 4, -1, 0, 2])
    assert t.chain == 4 and t.lookup == [0, 1, 4, 5] and t.ngram == 3 and set(t.leaves) == {6, 7, 8}
    assert tree.problem(t.tokens, t.parents) is None
    # the head's block as the branch of a lookup's chain: no leaves (a lookup has no second choices)
    head = HeadDraft([10, 40, 41], [0.6, 0.5, 0.5])                                      # reach .6 .3 .15
    main = HeadDraft([10, 11, 30], [0.9, 0.9, 0.9], ngram=2, other=head)
    t = head_tree(main, 3, 16, lambda v, n: v > 0.1)
    assert (t.tokens, t.parents, t.lookup, t.ngram, t.leaves) == ([10, 11, 30, 40, 41], [-1, 0, 1, 0, 3], [0, 1, 2], 2, {})
    # a lookup that only repeats the chain adds nothing; room caps the branch
    same = HeadDraft([10, 11], [0.9, 0.9], ngram=1)
    assert head_tree(HeadDraft([10, 11, 12], [0.5] * 3, other=same), 3, 16, lambda v, n: True).parents is None
    assert head_tree(draft, 4, 1, lambda v, n: v > 0.1).tokens == [10, 11, 12, 13, 30]


# ---------------------------------------------------------------------------------------------
# Sampling: within its limits, reproducible
# ---------------------------------------------------------------------------------------------

def test_sampled_runs_complete_and_a_seed_repeats(target, head_file, prompts):
    model = target[1]
    spec, other = serving(target, head_file), serving(target, head_file)
    outputs = set()
    drafted = 0
    for seed in range(3):
        for prompt in prompts[:3]:
            params = SamplingParams(temperature=1.3, top_k=12, top_p=0.95, repetition_penalty=1.3, seed=seed,
                                    max_new_tokens=12 + seed)
            out, d, _ = speculate_head(VerifyEngine(model), spec, prompt, params)
            assert 0 < len(out) <= params.max_new_tokens
            assert not set(out) & set(model.eos_ids)
            again, _, _ = speculate_head(VerifyEngine(model), spec, prompt, params)
            elsewhere, _, _ = speculate_head(VerifyEngine(model), other, prompt, params)   # another worker
            assert again == out == elsewhere, (prompt, seed)
            outputs.add((tuple(prompt), tuple(out[:10])))
            drafted += d
    assert drafted > 0
    assert len(outputs) > len(prompts[:3])          # the seed matters


def test_sampled_runs_stop_at_the_end_token(target, head_file):
    """The length penalty makes the end token likely from the third token on (and min_new_tokens
    forbids it before the fourth): every run ends there, the end token not part of the output."""
    model = target[1]
    spec = serving(target, head_file)
    lengths = []
    for seed in range(6):
        params = SamplingParams(temperature=1.5, seed=seed, max_new_tokens=40, min_new_tokens=3,
                                length_start=2, length_decay=3.0)
        out, _, _ = speculate_head(VerifyEngine(model), spec, [5, 6, 7, 8, 9], params)
        assert model.eos_ids[0] not in out
        lengths.append(len(out))
    assert all(3 <= n < 40 for n in lengths), lengths


# ---------------------------------------------------------------------------------------------
# Training forward == drafting
# ---------------------------------------------------------------------------------------------

def test_training_forward_agrees_with_the_drafter(target, head_file, prompts):
    from tandem.head.train import Sequence, block_outputs, target_features
    model = target[1]
    head, _ = checkpoint.load(head_file)
    drafter = bare_drafter(target, head)
    embed, lm_head = drafter.embed, drafter.lm_head
    ids = prompts[2] + reference(model, prompts[2], SamplingParams(max_new_tokens=20))
    seq = target_features(model, {"ids": ids, "prompt_len": len(prompts[2])}, drafter.taps)
    assert seq.features.shape == (len(ids), len(drafter.taps) * 64)
    anchors = [0, 1, 6, 13, len(ids) - BLOCK - 2]
    g = torch.Generator().manual_seed(0)

    def ctx_of(features):
        ctx = drafter.new_context(4)           # grown while extended
        drafter.extend(ctx, features.float())
        return ctx

    # all anchors in one batch: position 0 (its previous token is the anchor for both)
    with torch.no_grad():
        logits, _, labels, valid, conf = block_outputs(head, embed, lm_head, seq, torch.tensor(anchors), "cpu")
    assert labels[:, 0].tolist() == [ids[a + 1] for a in anchors]
    for i, a in enumerate(anchors):
        ctx = ctx_of(seq.features[:a])
        greedy = draw_block(drafter, ctx, ids[a], BLOCK)
        assert greedy.tokens[0] == int(logits[i, 0].argmax()), a
        assert greedy.confidence[0] == pytest.approx(float(torch.sigmoid(conf[i, 0])), abs=1e-5)
        sampled = draw_block(drafter, ctx, ids[a], 1, 1.0, g)
        cands, probs = sampled.support[0]
        assert len(cands) == head.config.vocab_size
        dense = torch.zeros(head.config.vocab_size).index_put_((cands,), probs)
        torch.testing.assert_close(dense, torch.softmax(logits[i, 0], -1), atol=1e-5, rtol=1e-4)

    # every position, one anchor at a time, with the drafted tokens as the sequence's tokens (so the
    # trainer's previous tokens are the drafter's) and noise for every feature from the anchor on
    for a in anchors:
        greedy = draw_block(drafter, ctx_of(seq.features[:a]), ids[a], BLOCK)
        row = {"ids": ids[:a + 1] + greedy.tokens, "prompt_len": 0}
        noise = torch.randn(BLOCK + 1, seq.features.shape[1], generator=g).half() * 10
        seq2 = Sequence(row, torch.cat([seq.features[:a], noise]), torch.randn(a + 1 + BLOCK, 64).half())
        with torch.no_grad():
            logits, _, labels, valid, conf = block_outputs(head, embed, lm_head, seq2, torch.tensor([a]), "cpu")
        assert labels[0].tolist() == greedy.tokens and valid.all()
        for j, t in enumerate(greedy.tokens):
            assert float(logits[0, j, t]) >= float(logits[0, j].max()) - 1e-4, (a, j)
        assert greedy.confidence == pytest.approx(torch.sigmoid(conf[0]).tolist(), abs=1e-5)


# ---------------------------------------------------------------------------------------------
# The head file, a DeepSpec folder, broken files
# ---------------------------------------------------------------------------------------------

def tiny_config(target, **changes) -> HeadConfig:
    from transformers import AutoConfig
    config = HeadConfig.for_target(AutoConfig.from_pretrained(target[0]), layers=2, block_size=BLOCK,
                                   markov_rank=8, taps=[0, 1], mask_token_id=1)
    for k, v in changes.items():
        setattr(config, k, v)
    return config


def random_head(config: HeadConfig, seed: int = 0) -> BlockHead:
    torch.manual_seed(seed)
    head = BlockHead(config)
    with torch.no_grad():
        for p in head.parameters():        # norms and the Markov head too: every tensor matters
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    return head.eval()


def drafts(target, head: BlockHead, seed: int = 0) -> list:
    """What a head drafts from random context features: greedy and sampled, several anchors."""
    g = torch.Generator().manual_seed(seed)
    drafter = bare_drafter(target, head)
    c = head.config
    out = []
    for n, anchor in ((0, 7), (3, 11), (9, 200)):
        ctx = drafter.new_context()
        drafter.extend(ctx, torch.randn(n, len(c.target_layer_ids) * c.hidden_size, generator=g))
        greedy = draw_block(drafter, ctx, anchor, BLOCK)
        sampled = draw_block(drafter, ctx, anchor, BLOCK, 0.7, torch.Generator().manual_seed(n))
        out.append((greedy.tokens, greedy.confidence, sampled.tokens, sampled.confidence,
                    [(i.tolist(), p.tolist()) for i, p in sampled.support]))
    return out


def same_parameters(a: BlockHead, b: BlockHead) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype == torch.float32, name
        assert torch.equal(sa[name], sb[name]), name


def test_save_load_round_trip(target, tmp_path):
    head = random_head(tiny_config(target))
    path = tmp_path / "h.safetensors"
    trained = {"command": "python -m tandem.head.train --steps 3", "steps": 3}
    digest = checkpoint.save(head, path, target="tiny-target", trained=trained)
    assert digest == checkpoint.sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), "pt") as f:
        names, meta = set(f.keys()), f.metadata()
        assert {f.get_tensor(n).dtype for n in names} == {torch.bfloat16}
    assert names == set(head.state_dict())
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    assert meta["format"] == "tandem-head/1"

    loaded, info = checkpoint.load(path)
    assert info == {"target": "tiny-target", "trained": trained}
    assert loaded.config == head.config and not loaded.training
    rounded = copy.deepcopy(head)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.bfloat16().float())
    assert not torch.equal(rounded.fc.weight, head.fc.weight)      # the file really is bfloat16
    same_parameters(loaded, rounded)
    assert drafts(target, loaded) == drafts(target, rounded)
    assert drafts(target, loaded) != drafts(target, random_head(tiny_config(target), seed=1))

    # a head saved without metadata to speak of still loads, with empty target and training record
    checkpoint.save(loaded, tmp_path / "bare.safetensors")
    assert checkpoint.load(tmp_path / "bare.safetensors")[1] == {"target": "", "trained": {}}


def deepspec_folder(folder, head: BlockHead, weights: str, prefix: str, config_changes: dict | None = None):
    """A checkpoint laid out as DeepSpec's: config.json with its field names (and fields Tandem
    does not know), the head's tensors under `prefix`, plus embedding and output-layer copies."""
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    config = {
        "architectures": ["DSparkDraftModel"], "model_type": "dspark", "torch_dtype": "bfloat16",
        "transformers_version": "4.56.0", "target_model_name_or_path": "Qwen/Qwen3-8B",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "vocab_size": c.vocab_size, "block_size": c.block_size,
        "mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids), "num_anchors": 512,
        "markov_rank": c.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": c.enable_confidence_head,
        "confidence_head_with_markov": c.confidence_head_with_markov, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
    }
    for k, v in (config_changes or {}).items():     # None: the field is left out
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {prefix + n: t.clone() for n, t in head.state_dict().items()}
    tensors[prefix + "embed_tokens.weight"] = torch.randn(c.vocab_size, c.hidden_size)
    tensors["lm_head.weight"] = torch.randn(c.vocab_size, c.hidden_size)
    save_file(tensors, str(folder / weights))
    return folder


@pytest.mark.parametrize("weights,prefix,changes", [
    ("model.safetensors", "model.", {}),
    ("pytorch_model.safetensors", "", {"rope_theta": None, "rope_parameters": {"rope_theta": 5e5}}),
    ("model.safetensors", "model.", {"head_dim": None}),
])
def test_deepspec_folder_loads_the_same_head(target, tmp_path, weights, prefix, changes):
    head = random_head(tiny_config(target, rope_theta=5e5))       # not the default 10000
    folder = deepspec_folder(tmp_path / "ds", head, weights, prefix, changes)
    loaded, info = checkpoint.load(folder)
    assert info == {"target": "Qwen/Qwen3-8B", "trained": {}}
    for field in ("hidden_size", "head_dim", "target_layer_ids", "block_size", "mask_token_id", "markov_rank",
                  "rope_theta", "num_key_value_heads"):
        assert getattr(loaded.config, field) == getattr(head.config, field), field
    same_parameters(loaded, head)
    assert drafts(target, loaded) == drafts(target, head)
    checkpoint.check_target(loaded.config, target[1].model.config)


def rewrite(path, out, drop: str = "", reshape: str = "", config_changes: dict | None = None, meta=None):
    """A copy of head file `path` with one tensor dropped or reshaped, or its config changed."""
    with safe_open(str(path), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
        metadata = dict(f.metadata())
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    if config_changes:
        config = json.loads(metadata["config"])
        config.update(config_changes)
        metadata["config"] = json.dumps(config)
    save_file(tensors, str(out), metadata=meta if meta is not None else metadata)
    return out


def test_broken_files_say_what_is_wrong(target, tmp_path):
    good = tmp_path / "good.safetensors"
    checkpoint.save(random_head(tiny_config(target)), good)

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    with pytest.raises(HeadFileError, match="cannot read head file junk.safetensors"):
        checkpoint.load(junk)
    with pytest.raises(HeadFileError, match="cannot read head file missing.safetensors"):
        checkpoint.load(tmp_path / "missing.safetensors")

    plain = tmp_path / "plain.safetensors"
    save_file({"fc.weight": torch.zeros(2, 2)}, str(plain))
    with pytest.raises(HeadFileError, match=r"plain.safetensors is not a Tandem head file \(format None\)"):
        checkpoint.load(plain)
    other = rewrite(good, tmp_path / "other.safetensors", meta={"format": "tandem-head/2", "config": "{}"})
    with pytest.raises(HeadFileError, match=r"is not a Tandem head file \(format 'tandem-head/2'\)"):
        checkpoint.load(other)

    missing = rewrite(good, tmp_path / "m.safetensors", drop="layers.1.mlp.up_proj.weight")
    with pytest.raises(HeadFileError, match=r"m.safetensors: parameters do not match the configuration "
                                            r"\(missing \['layers.1.mlp.up_proj.weight'\], unexpected \[\]\)"):
        checkpoint.load(missing)
    fewer = rewrite(good, tmp_path / "l.safetensors", config_changes={"num_hidden_layers": 1})
    with pytest.raises(HeadFileError, match=r"missing \[\], unexpected \['layers.1.input_layernorm.weight'"):
        checkpoint.load(fewer)
    shape = rewrite(good, tmp_path / "s.safetensors", reshape="markov_head.markov_w2.weight")
    with pytest.raises(HeadFileError, match=r"s.safetensors: markov_head.markov_w2.weight has shape \(319, 8\), "
                                            r"expected \(320, 8\)"):
        checkpoint.load(shape)

    # a bad configuration is the file's fault too: HeadFileError, so --head exits with its message
    gated = rewrite(good, tmp_path / "g.safetensors", config_changes={"markov_head_type": "gated"})
    with pytest.raises(HeadFileError, match="g.safetensors: bad head configuration: markov_head_type 'gated'"):
        checkpoint.load(gated)
    taps = rewrite(good, tmp_path / "t.safetensors", config_changes={"target_layer_ids": [1, 1]})
    with pytest.raises(HeadFileError, match=r"target_layer_ids must be strictly increasing, got \[1, 1\]"):
        checkpoint.load(taps)
    with pytest.raises(HeadFileError, match="target_layer_ids must not be empty"):
        checkpoint.load(rewrite(good, tmp_path / "e.safetensors", config_changes={"target_layer_ids": []}))
    with pytest.raises(HeadFileError, match="multiple of num_key_value_heads"):
        checkpoint.load(rewrite(good, tmp_path / "k.safetensors", config_changes={"num_key_value_heads": 3}))
    no_config = rewrite(good, tmp_path / "n.safetensors", meta={"format": "tandem-head/1"})
    with pytest.raises(HeadFileError, match="n.safetensors: bad head configuration"):
        checkpoint.load(no_config)
    bad_json = rewrite(good, tmp_path / "j.safetensors", meta={"format": "tandem-head/1", "config": "{oops"})
    with pytest.raises(HeadFileError, match="j.safetensors: bad head configuration"):
        checkpoint.load(bad_json)
    no_width = rewrite(good, tmp_path / "w.safetensors", meta={"format": "tandem-head/1",
                                                               "config": json.dumps({"vocab_size": 320})})
    with pytest.raises(HeadFileError, match="w.safetensors: bad head configuration"):
        checkpoint.load(no_width)

    # a DeepSpec folder: incomplete, gated, decreasing taps
    head = random_head(tiny_config(target))
    with pytest.raises(HeadFileError, match="ds0: a DeepSpec checkpoint needs config.json and model.safetensors"):
        checkpoint.load(deepspec_folder(tmp_path / "ds0", head, "weights.bin", "model."))
    with pytest.raises(ValueError, match="markov_head_type 'gated' is not supported"):
        checkpoint.load(deepspec_folder(tmp_path / "ds1", head, "model.safetensors", "model.",
                                        {"markov_head_type": "gated"}))
    with pytest.raises(ValueError, match=r"strictly increasing, got \[1, 0\]"):
        checkpoint.load(deepspec_folder(tmp_path / "ds2", head, "model.safetensors", "model.",
                                        {"target_layer_ids": [1, 0]}))
    with pytest.raises(HeadFileError, match=r"ds3: parameters do not match the configuration \(missing \[\], "
                                            r"unexpected \['layers.1.input_layernorm.weight'"):
        checkpoint.load(deepspec_folder(tmp_path / "ds3", head, "model.safetensors", "model.",
                                        {"num_hidden_layers": 1}))


def test_check_target(target):
    from transformers import AutoConfig
    tc = AutoConfig.from_pretrained(target[0])           # hidden 64, vocab 320, 2 layers
    checkpoint.check_target(tiny_config(target), tc)
    with pytest.raises(HeadFileError, match="head vocab_size 321 != target's 320"):
        checkpoint.check_target(tiny_config(target, vocab_size=321), tc)
    with pytest.raises(HeadFileError, match="head hidden_size 96 != target's 64"):
        checkpoint.check_target(tiny_config(target, hidden_size=96), tc)
    with pytest.raises(HeadFileError, match=r"head taps layers \[0, 2\]; the target has 2"):
        checkpoint.check_target(tiny_config(target, target_layer_ids=[0, 2]), tc)
    with pytest.raises(HeadFileError, match=r"head taps layers \[-2, 1\]; the target has 2"):
        checkpoint.check_target(tiny_config(target, target_layer_ids=[-2, 1]), tc)
    with pytest.raises(HeadFileError, match="head mask_token_id 320 is outside the vocabulary"):
        checkpoint.check_target(tiny_config(target, mask_token_id=320), tc)


def test_load_drafter_refuses_a_head_for_another_target(target, tmp_path):
    path = tmp_path / "wide.safetensors"
    config = tiny_config(target, target_layer_ids=[0, 1, 2], num_target_layers=3)
    checkpoint.save(random_head(config), path)
    with pytest.raises(HeadFileError, match=r"head taps layers \[0, 1, 2\]; the target has 2"):
        checkpoint.load_drafter(str(path), target[1], str(target[0]))
    with pytest.raises(HeadFileError, match="no head is shipped for 'no-such-preset'"):
        checkpoint.load_drafter("shipped", target[1], "no-such-preset")


def test_a_head_file_whose_sha256_is_not_the_one_given_or_shipped_is_refused(target, head_file, tmp_path, monkeypatch):
    folder, model, _ = target
    digest = checkpoint.sha256(head_file)
    assert checkpoint.load_drafter(str(head_file), model, str(folder), digest.upper()) is not None
    other = "0" * 64
    with pytest.raises(HeadFileError, match=f"head.safetensors has sha256 {digest}, not {other}: the file is damaged"):
        checkpoint.load_drafter(str(head_file), model, str(folder), other)
    # 'shipped': always checked against the sha256 recorded beside it
    monkeypatch.setattr(checkpoint, "SHIPPED", tmp_path)
    shipped = tmp_path / "tiny.safetensors"
    shipped.write_bytes(head_file.read_bytes())
    with pytest.raises(HeadFileError, match="no sha256 is recorded for the shipped head tiny.safetensors"):
        checkpoint.load_drafter("shipped", model, "tiny")
    (tmp_path / "SHA256SUMS").write_text(f"{digest}  tiny.safetensors\n")
    assert checkpoint.load_drafter("shipped", model, "tiny") is not None
    shipped.write_bytes(head_file.read_bytes()[:-1] + b" ")             # one byte changed
    with pytest.raises(HeadFileError, match="tiny.safetensors has sha256 .*, not " + digest):
        checkpoint.load_drafter("shipped", model, "tiny")


def test_the_shipped_head_is_the_one_its_sha256sums_records():
    path = checkpoint.shipped("smollm2-135m-instruct")      # raises when the file is not the one recorded
    assert checkpoint.sha256(path) in (checkpoint.SHIPPED / "SHA256SUMS").read_text()


# ---------------------------------------------------------------------------------------------
# choose_k, the context, the Markov and confidence heads
# ---------------------------------------------------------------------------------------------

def best_k(confidence, pass_ms, head_ms):
    """Brute force: the k (smallest among ties) maximizing E[tokens] / (head_ms + pass_ms[k])."""
    def expected(k):
        total, reach = 1.0, 1.0
        for c in confidence[:k]:
            reach *= c
            total += reach
        return total
    ks = range(min(len(confidence), len(pass_ms) - 1) + 1)
    rates = [expected(k) / (head_ms + pass_ms[k]) for k in ks]
    return rates.index(max(rates))


def test_choose_k():
    flat = [10.0 + 0.1 * i for i in range(9)]         # a pass of 1..9 tokens costs about the same
    assert choose_k([0.95] * 8, flat) == 8
    assert choose_k([0.9, 0.9, 0.9, 0.01, 0.9], flat) == 3
    assert choose_k([0.01] * 8, [10.0 + 0.5 * i for i in range(9)]) == 0
    assert choose_k([0.95] * 8, flat[:4]) == 3                   # the curve ends at 4 tokens fed
    assert choose_k([0.95] * 3, flat) == 3
    steep = [10.0 * (i + 1) for i in range(9)]                   # each token fed costs a whole pass
    assert choose_k([0.95] * 8, steep) == 0
    assert choose_k([0.95] * 8, steep, head_ms=1000.0) == 8      # a slow head: verify all it drafted
    # no curve: every position reached with chance >= floor
    assert choose_k([0.9, 0.5, 0.2, 0.9], []) == 4               # 0.9, 0.45, 0.09, 0.081
    assert choose_k([0.9, 0.5, 0.2, 0.9], [], floor=0.1) == 2
    assert choose_k([0.04, 1.0], []) == 0
    assert choose_k([], []) == 0 and choose_k([], flat) == 0
    assert choose_k([0.0, 0.0], [10.0, 10.0, 10.0]) == 0          # among equal rates, the fewest tokens
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 9)
        confidence = [rng.random() for _ in range(n)]
        curve = sorted(rng.uniform(5, 30) for _ in range(rng.randint(1, 10)))
        head_ms = rng.choice([0.0, rng.uniform(0, 5)])
        k = choose_k(confidence, curve, head_ms)
        assert k == best_k(confidence, curve, head_ms), (confidence, curve, head_ms)
        assert 0 <= k <= len(confidence)
        assert 0 <= choose_k(confidence, []) <= len(confidence)


def test_context_grows_and_copies_a_prefix():
    ctx = HeadContext(layers=2, kv_heads=2, head_dim=3, capacity=2)
    parts = [[(torch.randn(2, n, 3), torch.randn(2, n, 3)) for _ in range(2)] for n in (1, 2, 5)]
    for kv in parts:
        ctx.append(kv)
    assert ctx.length == 8 and ctx.k[0].shape[1] >= 8
    for layer in range(2):
        k, v = ctx.view()[layer]
        assert torch.equal(k, torch.cat([p[layer][0] for p in parts], 1))
        assert torch.equal(v, torch.cat([p[layer][1] for p in parts], 1))
    copy = HeadContext(layers=2, kv_heads=2, head_dim=3, capacity=1)
    copy.copy_prefix(ctx, 3)
    assert copy.length == 3
    assert all(torch.equal(c, o[:, :3]) for (c, _), (o, _) in zip(copy.view(), ctx.view()))
    new = [(torch.ones(2, 1, 3), torch.ones(2, 1, 3))] * 2
    copy.append(new)                            # its own rows: the donor's stay as they were
    assert torch.equal(copy.view()[1][0][:, 3:], new[1][0]) and copy.length == 4
    assert ctx.length == 8 and torch.equal(ctx.view()[1][0][:, 3:4], parts[2][1][0][:, :1])


def test_the_markov_head_changes_what_is_drafted(target):
    head = random_head(tiny_config(target))
    without = copy.deepcopy(head)
    with torch.no_grad():
        without.markov_head.markov_w2.weight.zero_()
    a, b = drafts(target, head), drafts(target, without)
    assert [x[0] for x in a] != [x[0] for x in b]          # greedy tokens differ for some anchor
    # the zeroed Markov head drafts exactly what the base logits' argmax gives, position by position
    drafter = bare_drafter(target, without)
    ctx = drafter.new_context()
    drafter.extend(ctx, torch.randn(5, 128, generator=torch.Generator().manual_seed(1)))
    d = draw_block(drafter, ctx, 42, BLOCK)
    with torch.no_grad():
        ids = torch.tensor([42] + [without.config.mask_token_id] * (BLOCK - 1))
        hidden = without.backbone(drafter.embed(ids).float(), torch.arange(5, 5 + BLOCK), ctx.view(), None)
        assert d.tokens == drafter.lm_head(hidden).argmax(-1).tolist()
    # the sampled q is the Markov-corrected softmax: zeroing w2 changes it
    g = lambda: torch.Generator().manual_seed(0)      # noqa: E731
    qa = draw_block(bare_drafter(target, head), ctx, 42, 1, 1.0, g()).support[0][1]
    qb = draw_block(drafter, ctx, 42, 1, 1.0, g()).support[0][1]
    assert not torch.allclose(qa, qb)


def test_the_confidence_head_decides_the_confidence(target):
    head = random_head(tiny_config(target))
    conf = [x[1] for x in drafts(target, head)]
    assert all(0 < c < 1 for cs in conf for c in cs) and len({c for cs in conf for c in cs}) > 3
    plain = random_head(tiny_config(target, enable_confidence_head=False))
    assert plain.confidence_head is None
    assert all(c == 1.0 for x in drafts(target, plain) for c in x[1])
    no_markov = random_head(tiny_config(target, confidence_head_with_markov=False))
    assert no_markov.confidence_head.proj.in_features == 64
    without = random_head(tiny_config(target, markov_rank=0, confidence_head_with_markov=False))
    assert without.markov_head is None and len(drafts(target, without)[0][0]) == BLOCK
    with pytest.raises(ValueError, match="confidence_head_with_markov needs markov_rank > 0"):
        BlockHead(tiny_config(target, markov_rank=0))
    # the previous token's Markov embedding feeds the confidence: changing it changes the confidence
    other = copy.deepcopy(head)
    with torch.no_grad():
        other.markov_head.markov_w1.weight.mul_(-1)
        other.markov_head.markov_w2.weight.mul_(-1)   # same Markov bias, other embedding
    a, b = drafts(target, head), drafts(target, other)
    assert [x[0] for x in a] == [x[0] for x in b] and [x[1] for x in a] != [x[1] for x in b]


def test_a_draft_vocabulary_restricts_drafting_and_keeps_the_loss_exact(target, prompts, tmp_path):
    """A head drafting from part of the vocabulary: the file keeps the part, every drafted token and
    every candidate of q lies in it, the training forward agrees with the drafter over those rows,
    and the L1 term over the rows plus the target's mass outside them is the L1 distance over the
    whole vocabulary (q is zero outside)."""
    from transformers import AutoModelForCausalLM

    from tandem.head.train import Vocab, block_outputs, dspark_loss, parse_args, target_features
    hf = AutoModelForCausalLM.from_pretrained(target[0]).eval()          # unpacked: its weight is at hand
    head = random_head(tiny_config(target))
    vocab = torch.tensor(sorted(random.Random(0).sample(range(320), 40)))
    head.draft_vocab = vocab
    path = tmp_path / "v.safetensors"
    checkpoint.save(head, path)
    loaded, _ = checkpoint.load(path)
    assert torch.equal(loaded.draft_vocab, vocab)
    drafter = HeadDrafter(loaded, hf.get_input_embeddings(), hf.get_output_embeddings())
    ids = prompts[0] + prompts[1] + prompts[2]
    seq = target_features(target[1], {"ids": ids, "prompt_len": 0}, drafter.taps)
    rows = Vocab(hf.get_output_embeddings(), vocab)
    inside = set(vocab.tolist())
    g = torch.Generator().manual_seed(0)
    for a in (2, len(ids) - BLOCK - 2):
        ctx = drafter.new_context()
        drafter.extend(ctx, seq.features[:a].float())
        greedy = draw_block(drafter, ctx, ids[a], BLOCK)
        assert set(greedy.tokens) <= inside
        sampled = draw_block(drafter, ctx, ids[a], BLOCK, 1.0, g)
        for cands, probs in sampled.support:
            assert set(cands.tolist()) <= inside and float(probs.sum()) == pytest.approx(1.0, abs=1e-5)
        with torch.no_grad():
            logits, logp, labels, valid, _ = block_outputs(loaded, drafter.embed, rows, seq, torch.tensor([a]), "cpu")
        assert int(vocab[int(logits[0, 0].argmax())]) == greedy.tokens[0]
        assert labels[0, 0] == (vocab.tolist().index(ids[a + 1]) if ids[a + 1] in inside else -1)
        with torch.no_grad():
            full = torch.log_softmax(hf(torch.tensor([ids])).logits[0, a].float(), -1)
        torch.testing.assert_close(logp[0, 0], full[vocab], atol=2e-3, rtol=0)
        # the L1 term: the rows' part plus what p puts outside them == the distance over all tokens
        _, parts = dspark_loss(logits[:, :1], logp[:, :1], labels[:, :1], valid[:, :1], None, parse_args(["--out", "x"]))
        q_full = torch.zeros(320).index_put_((vocab,), torch.softmax(logits[0, 0], -1))
        assert parts["l1"] == pytest.approx(float((q_full - full.exp()).abs().sum()), abs=5e-3)
    bad = rewrite(path, tmp_path / "b.safetensors")
    with safe_open(str(bad), "pt") as f:
        tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    tensors["draft_vocab"] = torch.tensor([5, 320])
    save_file(tensors, str(bad), metadata=meta)
    with pytest.raises(HeadFileError, match="draft_vocab must be token ids inside the vocabulary"):
        checkpoint.load(bad)


def test_under_load_a_position_stays_only_while_reaching_it_beats_its_price():
    conf = [0.9, 0.8, 0.5]                                 # reach 0.9, 0.72, 0.36
    assert worth_its_price(conf, 0.0) == 3                 # alone: no price
    assert worth_its_price(conf, 0.5) == 2
    assert worth_its_price(conf, 0.8) == 1
    assert worth_its_price(conf, 0.95) == 0
    assert worth_its_price([], 0.5) == 0


def test_under_load_the_head_proposes_only_while_its_gain_pays_for_its_next_pass():
    reach = [0.9, 0.72, 0.36]
    assert gain_at_price(reach, 0.0) == pytest.approx(1.98)
    assert gain_at_price(reach, 0.5) == pytest.approx(0.4 + 0.22)       # the third is not worth 0.5
    assert gain_at_price(reach, 0.95) == 0.0
    assert pays_for_head_pass(reach, 0.0, 100.0)                        # alone: the pass is its own
    assert pays_for_head_pass(reach, 0.1, 10.0)                         # 1.68 > 1.0
    assert not pays_for_head_pass(reach, 0.1, 17.0)                     # 1.68 < 1.7
    assert pays_for_head_pass(reach[:2], 0.1, 14.0)                     # 1.42 > 1.4
    assert not pays_for_head_pass([], 0.1, 1.0)


def test_under_load_a_resting_head_holds_its_states_back_and_catches_up(target, prompts, tmp_path, monkeypatch):
    """A head whose next pass does not pay at the price drafts nothing and runs no head layers:
    the committed positions' states wait, and join its context in one call once the price falls
    (or HELD_ROWS of them wait); a session started meanwhile starts resting too. The output stays
    the target's, and the context ends as one teacher-forced pass gives it."""
    model = target[1]
    path = build_random_head(tmp_path / "table.safetensors", target[0], seed=3, block_size=BLOCK, markov_rank=64)
    params = SamplingParams(max_new_tokens=24)
    prompt = prompts[2]
    ref = reference(model, prompt, params)
    spec = table_head(target, path, [prompt[-1:] + ref])
    seen: dict = {}
    checked_rounds(spec, model, monkeypatch, seen)
    # a nearly flat pass-cost curve: a head pass costs as much as hundreds of positions
    monkeypatch.setattr(model, "forward_ms", [2.0 + 0.01 * i for i in range(9)])
    monkeypatch.setattr(headspec, "HELD_ROWS", 8)
    engine = spec.engine
    s = open_head_session(engine, spec, prompt, params)
    h = s.drafting
    spec.start(s, h)
    rounds = []                                  # (price, states held back, tokens proposed)
    while not s.stop_reason:
        price = 0.5 if s.generated < 12 else 0.0
        held = h.known() - h.context.length
        step, proposed = spec.step(s, h, price)
        rounds.append((price, held, len(proposed)))
        step.then(engine.model.forward(step.tokens, s.cache, taps=spec.taps))
    assert s.tokens[len(prompt):] == ref
    loaded = [r for r in rounds if r[0] > 0]
    assert len(loaded) >= 3 and not any(n for _, _, n in loaded)          # no proposal pays
    assert any(held for _, held, _ in loaded) and 0 < seen["held"] < 8     # held, never 8 at once
    after = [r for r in rounds if r[0] == 0]
    assert after and all(held == 0 and n > 0 for _, held, n in after[1:])  # caught up, proposing
    assert spec.reach is not None and spec.price == 0.0
    # a session opened while the latest price does not pay for the head's pass starts resting
    spec.price = 0.5
    late = open_head_session(engine, spec, prompt, params, "late")
    spec.start(late, late.drafting)
    assert late.drafting.proposal is None and late.drafting.price == 0.5
    spec.price = 0.0
    spec.start(late, late.drafting)
    assert late.drafting.proposal is not None and late.drafting.proposal.tokens


def test_a_greedy_head_session_copies_a_prompt_prefix_with_its_context(target, head_file, prompts):
    """From another head session whose context covers it: the target's KV and the head's context
    rows, so only the rest is prefilled; the output stays the target's. Sampled sessions and
    sessions of other methods are not donors or takers."""
    model = target[1]
    spec = serving(target, head_file)
    engine = spec.engine
    params = SamplingParams(max_new_tokens=8)
    long = prompts[2] * 8
    donor = open_head_session(engine, spec, long + prompts[3], params, "donor")
    plain = engine.open("plain", long + [7], params, reuse_prefix=False)
    prompt = long + prompts[0]
    s = engine.open("taker", prompt, params, reuse_prefix=False)
    h = s.drafting = spec.open(s)
    spec.share_prefix(s, h, [plain, donor])
    assert s.cache.length == h.context.length == len(long)
    for (k, v), (dk, dv) in zip(h.context.view(), donor.drafting.context.view()):
        assert torch.equal(k, dk[:, :len(long)]) and torch.equal(v, dv[:, :len(long)])
    for piece in engine.prefill_chunks(s, 512):
        spec.prefill_then(s, h, lambda logits: None)(engine.model.forward(piece, s.cache, last=1, taps=spec.taps))
    spec.start(s, h)
    while not s.stop_reason:
        step, _ = spec.step(s, h)
        step.then(engine.model.forward(step.tokens, s.cache, taps=spec.taps))
    assert s.tokens[len(prompt):] == reference(model, prompt, params)
    sampled = engine.open("sampled", prompt, SamplingParams(max_new_tokens=8, temperature=0.8, seed=1),
                          reuse_prefix=False)
    sampled.drafting = spec.open(sampled)
    spec.share_prefix(sampled, sampled.drafting, [donor])
    assert sampled.cache.length == 0
    for session in (donor, plain, s, sampled):
        session.cache.release()


def test_a_greedy_calibration_reads_the_confidence_for_greedy_requests_only(target, tmp_path):
    """A head file's greedy_calibration round-trips; a greedy request's confidence at position j is
    sigmoid(scale_j * logit + offset_j) of the trained one, a sampled request's is as trained, and
    the tokens drafted do not change. A calibration of the wrong shape is refused."""
    head = random_head(tiny_config(target))
    path = tmp_path / "c.safetensors"
    checkpoint.save(head, path)
    plain, _ = checkpoint.load(path)
    head.greedy_calibration = torch.tensor([[0.5, -1.0], [2.0, 0.3], [1.0, 0.0], [-1.0, 2.0]])
    checkpoint.save(head, path)
    loaded, _ = checkpoint.load(path)
    assert torch.equal(loaded.greedy_calibration, head.greedy_calibration)
    for before, after in zip(drafts(target, plain), drafts(target, loaded)):
        assert before[0] == after[0] and before[2] == after[2]
        assert after[3] == pytest.approx(before[3], abs=1e-6)
        scale, offset = head.greedy_calibration[:len(before[1])].unbind(-1)
        trained = torch.tensor(before[1], dtype=torch.float64)
        want = torch.sigmoid(torch.logit(trained) * scale + offset)
        assert after[1] == pytest.approx(want.tolist(), abs=1e-5)
        assert after[1] != pytest.approx(before[1], abs=1e-3)
    bad = rewrite(path, tmp_path / "b.safetensors")
    with safe_open(str(bad), "pt") as f:
        tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, f.metadata()
    tensors["greedy_calibration"] = torch.ones(BLOCK - 1, 2)
    save_file(tensors, str(bad), metadata=meta)
    with pytest.raises(HeadFileError, match=rf"greedy_calibration must be \[{BLOCK}, 2\] finite numbers"):
        checkpoint.load(bad)


def test_the_greedy_calibration_fit_reads_only_blocks_that_reached_a_position(target, monkeypatch):
    """fit_greedy_calibration against blocks whose greedy match at j follows
    sigmoid(2 * logit - 1) wherever every earlier position matched, and is always 1 after a miss
    (what a block that never reached j must not teach): the fit recovers (2, -1) per position."""
    from tandem.head import train
    g = torch.Generator().manual_seed(0)
    conf = torch.randn(20000, BLOCK, generator=g) * 2
    drawn = torch.rand(20000, BLOCK, generator=g) < torch.sigmoid(2 * conf - 1)
    match = drawn.clone()
    for j in range(1, BLOCK):
        match[:, j] = torch.where(match[:, :j].all(1), drawn[:, j], torch.ones_like(drawn[:, j]))
    prefix = match.int().cumprod(-1).bool()
    valid = torch.ones_like(match)
    monkeypatch.setattr(train, "_held_out_blocks", lambda *a: iter([(match, prefix, valid, conf)]))
    fit = train.fit_greedy_calibration(random_head(tiny_config(target)), None, None, [], "cpu")
    assert fit.shape == (BLOCK, 2)
    torch.testing.assert_close(fit, torch.tensor([[2.0, -1.0]] * BLOCK), atol=0.15, rtol=0)


def test_training_data_is_stratified_and_sampled_answers_repeat():
    """Held-out sets take every family in turn and the calibration set never repeats the
    evaluation's; a sampled answer's draws are seeded by its record's id."""
    from tandem.head import prompts as prompt_set
    from tandem.head.prompts import stratified
    from tandem.head.train import _picker, sampled_records
    heldout = prompt_set.load("heldout")
    families = {r["id"].rsplit("-", 1)[0] for r in heldout}
    evaluated = stratified(heldout, len(families))
    assert {r["id"].rsplit("-", 1)[0] for r in evaluated} == families
    calibrated = stratified(heldout, 40, skip=len(families))
    assert len(calibrated) == 40 and not {r["id"] for r in calibrated} & {r["id"] for r in evaluated}
    assert stratified(heldout, 10**6) == stratified(heldout, 10**6) and len(stratified(heldout, 10**6)) == len(heldout)
    assert sampled_records(heldout[:3], 0.0) == []
    copies = sampled_records(heldout[:3], 0.7)
    assert [r["id"] for r in copies] == [r["id"] + "@t0.7" for r in heldout[:3]]
    row = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert _picker(heldout[0])(row) == int(row.argmax())
    first, again, other = _picker(copies[0]), _picker(copies[0]), _picker(copies[1])
    draws = [first(row) for _ in range(30)]
    assert draws == [again(row) for _ in range(30)] != [other(row) for _ in range(30)]


def test_the_trainer_starts_from_a_head_file_and_adds_sampled_answers(target, head_file, tmp_path):
    """`python -m tandem.head.train --init ... --sampled-temperature ... --followups ...` on the
    tiny target: the data holds a greedy and a sampled answer per prompt and second turns, training starts from the given head (its
    shape and draft vocabulary), and the head written records where it started (by sha256, with no
    folder of this machine in its command) and carries a greedy calibration per position."""
    from tandem.head import train
    out = tmp_path / "run"
    train.main(["--target", str(target[0]), "--out", str(out), "--init", str(head_file), "--max-prompts", "3",
                "--max-new-tokens", "6", "--gen-batch", "4", "--steps", "2", "--batch", "2", "--anchors", "4",
                "--eval-every", "1", "--eval-sequences", "2", "--calibration-sequences", "3",
                "--sampled-temperature", "0.7", "--followups", "2"])
    rows = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    sampled = [r for r in rows if r["id"].endswith("@t0.7")]
    second = [r for r in rows if r["id"].endswith("+followup")]
    assert len(sampled) == 3 and len(second) == 2 and len(rows) == 3 + 3 + 2 + 3 + 2
    first = {r["id"]: r for r in rows}
    for r in second:                     # the second turn's prompt begins as the first turn's
        one = first[r["id"].removesuffix("+followup")]
        half = one["prompt_len"] // 2
        assert r["prompt_len"] > one["prompt_len"] and r["ids"][:half] == one["ids"][:half]
    head, meta = checkpoint.load(out / "head.safetensors")
    start, _ = checkpoint.load(head_file)
    assert head.config == start.config
    assert torch.equal(head.draft_vocab, start.draft_vocab) if start.draft_vocab is not None else head.draft_vocab is None
    assert meta["trained"]["init_sha256"] == checkpoint.sha256(head_file)
    assert meta["trained"]["sampled_sequences"] <= 3 and str(tmp_path) not in meta["trained"]["command"]
    assert head.greedy_calibration is not None and head.greedy_calibration.shape == (BLOCK, 2)

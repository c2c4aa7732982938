"""Speculative sampling with logits processing emits exactly the target's processed distribution.

Part 1: `verify_sampled` with k >= 3 on hand-made tensors whose residuals are one-hot, so every
outcome is deterministic: the rejected row's residual, the bonus row, one uniform per position,
and the residual of a deterministic proposal.

Part 2: a toy target and a toy draft (pseudo-random logits over V=5 tokens, a function of the
history; the two are unrelated, so proposals are rejected at every position) run through the real
pipeline: the draft samples k tokens from q = probabilities(process(...)) row by row, the target
processes all k+1 rows in ONE `process` call with `proposed` (as the verify worker does), then
`probabilities` and `verify_sampled`. The first T=3 tokens of N sequences are compared with the
target's exact distribution, enumerated token by token through the same two functions.

Statistic: every cell (each full 3-token outcome, an end token padded with PAD, and each
position's marginal) must satisfy |empirical - exact| <= Z*sqrt(p(1-p)/N) + Z^2/(3N), Bernstein's
bound with Z = 4.5 (two-sided ~7e-6 per cell); an outcome the target forbids must never occur.
`detection` is the worst cell's deviation over its bound, so the test passes iff it is < 1. With
N = 60000 the largest bound (p = 1/2) is 0.0093, below 0.01: a shift of one percentage point in
any cell's probability exceeds it.

Each config also runs deliberately wrong variants through the same statistic and asserts they are
detected (detection > 1): the target processing each row with the committed history only, the
draft reporting a q other than the one it sampled from, the residual taken from the wrong row, and
one uniform reused for every position, each over N/4 sequences (a wrong variant only has to be
told apart; the right one has to pass at full power). (A draft that samples from unprocessed q AND reports it is
not a bug: rejection sampling is exact for any q; only a mismatch is.)
"""

import math
import zlib
from bisect import bisect_right
from collections import Counter
from itertools import accumulate

import pytest
import torch

from tandem.speculation.sampling import SamplingParams, probabilities, process
from tandem.speculation.verification import Outcome, verify_sampled

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------------------------------------
# Part 1: exact cases with k >= 3
# ---------------------------------------------------------------------------------------------

# k = 4, V = 5, proposed [1, 2, 3, 4]. Acceptance ratios p/q of the proposed tokens: 1, 1, 1/3, 1/2.
# Residuals max(0, p_i - q_i) are one-hot on a different token per row: 4, 3, 0, 2; bonus row p_4
# is a point mass on 1.
PROPOSED = torch.tensor([1, 2, 3, 4])
Q = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0],
                  [0.5, 0.0, 0.5, 0.0, 0.0],
                  [0.0, 0.2, 0.2, 0.6, 0.0],
                  [0.0, 0.0, 0.0, 0.0, 1.0]])
P = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5],
                  [0.0, 0.0, 0.5, 0.5, 0.0],
                  [0.4, 0.2, 0.2, 0.2, 0.0],
                  [0.0, 0.0, 0.5, 0.0, 0.5],
                  [0.0, 1.0, 0.0, 0.0, 0.0]])


def test_the_hand_made_case_is_as_described():
    residual = (P[:4] - Q).clamp(min=0)
    assert ((residual > 0).sum(-1) == 1).all()
    assert residual.argmax(-1).tolist() + [int(P[4].argmax())] == [4, 3, 0, 2, 1]
    rows = torch.arange(4)
    assert (P[rows, PROPOSED] / Q[rows, PROPOSED]).tolist() == pytest.approx([1, 1, 1 / 3, 0.5])


def verdict(uniforms, proposed=PROPOSED, q=Q, p=P, seed=0) -> tuple[int, int]:
    out = verify_sampled(proposed, q, p, torch.tensor(uniforms), torch.Generator().manual_seed(seed))
    return out.accepted, out.next_token


@pytest.mark.parametrize("seed", range(5))
def test_rejection_in_the_middle_draws_from_that_rows_residual(seed):
    assert verdict([0.99, 0.99, 0.5, 0.0], seed=seed) == (2, 0)      # 0.5 >= 1/3 rejects row 2
    assert verdict([0.99, 0.99, 0.3, 0.6], seed=seed) == (3, 2)      # row 2 accepted, row 3 not


@pytest.mark.parametrize("seed", range(5))
def test_all_accepted_draws_the_bonus_from_row_k(seed):
    assert verdict([0.99, 0.99, 0.3, 0.4], seed=seed) == (4, 1)


def test_each_position_uses_its_own_uniform():
    shared = lambda u: verdict([u[0]] * 4)                          # noqa: E731  the wrong rule
    for uniforms, right in (([0.1, 0.1, 0.9, 0.1], (2, 0)), ([0.9, 0.9, 0.1, 0.1], (4, 1)),
                            ([0.2, 0.2, 0.2, 0.7], (3, 2))):
        assert verdict(uniforms) == right
        assert shared(uniforms)[0] != right[0]


@pytest.mark.parametrize("seed", range(5))
def test_deterministic_proposal_residual_is_p_without_the_proposed_token(seed):
    # q one-hot on proposed [2, 3, 1]: accept with probability p_i(x_i) = 0.9, 0.3, 0.5; p_i with
    # x_i zeroed is one-hot on 0, 4, 3; bonus row a point mass on 2.
    proposed = torch.tensor([2, 3, 1])
    p = torch.tensor([[0.1, 0.0, 0.9, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.3, 0.7],
                      [0.0, 0.5, 0.0, 0.5, 0.0],
                      [0.0, 0.0, 1.0, 0.0, 0.0]])
    run = lambda u: verdict(u, proposed, None, p, seed)              # noqa: E731
    assert run([0.95, 0.0, 0.0]) == (0, 0)
    assert run([0.5, 0.5, 0.0]) == (1, 4)
    assert run([0.5, 0.2, 0.7]) == (2, 3)
    assert run([0.5, 0.2, 0.4]) == (3, 2)


# ---------------------------------------------------------------------------------------------
# Part 2: the distribution of the first T tokens through the whole pipeline
# ---------------------------------------------------------------------------------------------

V, T, PROMPT, PAD = 5, 3, (1, 2), -1
N, Z = 60_000, 4.5
N_WRONG = N // 4    # sequences per wrong variant: each is detected at least 2.2 times over the bound


def toy_logits(salt: int, history: tuple[int, ...]) -> torch.Tensor:
    """[V] logits, a fixed pseudo-random function of the history; salt tells the models apart.
    Token 0 (the end token where one is set) is pushed down so that most sequences run T tokens."""
    seed = zlib.crc32(repr((salt, history)).encode())
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) - 2.0 * (torch.arange(V) == 0)


TARGET, DRAFT = 1, 2


class Pipeline:
    """Cached distributions for one config; the uncached path is the real `process` + `probabilities`.

    bug: None, or one of
      "row_history"  - the target processes each row with the committed history only
      "reported_q"   - the draft samples from its q but reports softmax(raw logits / temperature)
      "residual_row" - the verifier takes the residual from row 0 wherever the rejection is
      "one_uniform"  - uniforms[0] decides every position
    """

    def __init__(self, params: SamplingParams, eos: list[int], k: int, bug: str | None = None):
        self.params, self.eos, self.k, self.bug = params, eos, k, bug
        self._draft, self._round, self._target = {}, {}, {}

    def dist(self, salt: int, history: tuple, proposed: tuple = ()) -> torch.Tensor:
        """[n, V] probabilities after history + proposed[:i] for i < n = len(proposed) + 1, all
        rows processed in one call, as the verify worker does."""
        logits = torch.stack([toy_logits(salt, history + proposed[:i]) for i in range(len(proposed) + 1)])
        return probabilities(process(logits, list(history), len(PROMPT), self.params, self.eos,
                                     list(proposed)), self.params)

    def target_row(self, history: tuple) -> torch.Tensor:
        if history not in self._target:
            self._target[history] = self.dist(TARGET, history)[0]
        return self._target[history]

    def draft(self, history: tuple) -> tuple[list[float], torch.Tensor]:
        """(cumulative q for sampling, the q reported to the verifier)."""
        if history not in self._draft:
            q = self.dist(DRAFT, history)[0]
            reported = q
            if self.bug == "reported_q":
                reported = torch.softmax(toy_logits(DRAFT, history) / self.params.temperature, -1)
            self._draft[history] = (list(accumulate(q.tolist())), reported)
        return self._draft[history]

    def round(self, history: tuple, proposed: tuple):
        key = (history, proposed)
        if key not in self._round:
            q = torch.stack([self.draft(history + proposed[:i])[1] for i in range(self.k)])
            if self.bug == "row_history":
                p = torch.cat([probabilities(process(toy_logits(TARGET, history + proposed[:i])[None],
                                                     list(history), len(PROMPT), self.params, self.eos),
                                             self.params) for i in range(self.k + 1)])
            else:
                p = self.dist(TARGET, history, proposed)
            self._round[key] = (torch.tensor(proposed), q, p)
        return self._round[key]

    def verify(self, proposed, q, p, uniforms, g) -> Outcome:
        if self.bug == "one_uniform":
            uniforms = uniforms[:1].expand(self.k)
        if self.bug == "residual_row":
            out = verify_sampled(proposed, q, p, uniforms, g)
            if out.accepted < self.k:                                 # redraw from row 0's residual
                residual = torch.clamp(p[0] - q[0], min=0.0)
                residual = residual if float(residual.sum()) > 0 else p[0]
                return Outcome(out.accepted, int(torch.multinomial(residual, 1, generator=g)))
            return out
        return verify_sampled(proposed, q, p, uniforms, g)

    def speculative(self, n: int, seed: int) -> Counter:
        """Counts of the first T emitted tokens (PAD after an end token) over n sequences."""
        g = torch.Generator().manual_seed(seed)
        draws = iter(torch.rand(n * T * self.k, generator=g).tolist())    # the draft's sampling
        uniforms = torch.rand(n * T, self.k, generator=g)                   # acceptance, per round
        rounds, counts = 0, Counter()
        for _ in range(n):
            history, out = PROMPT, []
            while len(out) < T and not (out and out[-1] in self.eos):
                proposed = ()
                for _ in range(self.k):
                    cum, _ = self.draft(history + proposed)
                    proposed += (bisect_right(cum, next(draws) * cum[-1]),)
                outcome = self.verify(*self.round(history, proposed), uniforms[rounds], g)
                rounds += 1
                new = proposed[:outcome.accepted] + (outcome.next_token,)
                history += new
                for t in new:
                    out.append(t)
                    if len(out) == T or t in self.eos:
                        break
            counts[tuple(out) + (PAD,) * (T - len(out))] += 1
        return counts

    def exact(self) -> dict[tuple, float]:
        """The target's distribution of the first T tokens, token by token."""
        result = {}

        def walk(out: tuple, prob: float):
            if len(out) == T or (out and out[-1] in self.eos):
                result[out + (PAD,) * (T - len(out))] = prob
                return
            for t, pt in enumerate(self.target_row(PROMPT + out).tolist()):
                if pt > 0:
                    walk(out + (t,), prob * pt)

        walk((), 1.0)
        return result


def bound(p: float, n: int) -> float:
    return Z * math.sqrt(max(p * (1 - p), 0.0) / n) + Z * Z / (3 * n)


def detection(counts: Counter, exact: dict[tuple, float]) -> float:
    """Worst cell's |empirical - exact| / bound over full outcomes and per-position marginals;
    inf if an outcome the target forbids occurred."""
    n = sum(counts.values())
    if set(counts) - set(exact):
        return math.inf
    cells = [(counts[c], exact[c]) for c in exact]
    for pos in range(T):
        for t in set(c[pos] for c in exact):
            cells.append((sum(v for c, v in counts.items() if c[pos] == t),
                          sum(p for c, p in exact.items() if c[pos] == t)))
    return max(abs(c / n - p) / bound(p, n) for c, p in cells)


def test_threshold_detects_one_percentage_point():
    assert bound(0.5, N) < 0.01


CONFIGS = {   # name: (params, eos_ids, k, bugs that must be detected)
    "plain": (SamplingParams(temperature=1.0), [], 3, ["residual_row", "one_uniform"]),
    "top_k_top_p": (SamplingParams(temperature=1.0, top_k=2, top_p=0.8), [], 2, ["reported_q"]),
    "repetition": (SamplingParams(temperature=1.0, repetition_penalty=1.8), [], 3,
                   ["row_history", "reported_q"]),
    "presence_frequency": (SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.5),
                           [], 2, ["row_history"]),
    "length": (SamplingParams(temperature=1.0, length_start=0, length_decay=2.0), [0], 3, ["row_history"]),
    "typical": (SamplingParams(temperature=1.0, typical_p=0.6), [], 2, ["reported_q"]),
    "min_new_tokens": (SamplingParams(temperature=1.0, min_new_tokens=2), [0], 3, ["row_history"]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_matches_target(name):
    params, eos, k, bugs = CONFIGS[name]
    exact = Pipeline(params, eos, k).exact()
    assert abs(sum(exact.values()) - 1) < 1e-5
    stats = {bug: detection(Pipeline(params, eos, k, bug).speculative(N_WRONG if bug else N, seed=7), exact)
             for bug in [None, *bugs]}
    print(name, {b: round(s, 2) for b, s in stats.items()})
    assert stats[None] < 1, stats
    for bug in bugs:
        assert stats[bug] > 1, (bug, stats)


def test_no_finite_distribution_is_the_requests_fault():
    """Logits that processing overflowed raise SamplingError (a ValueError: workers answer
    INVALID_ARGUMENT), never a multinomial crash deep in a worker."""
    from tandem.speculation.sampling import SamplingError
    logits = torch.tensor([[float("inf"), 1.0, 2.0]])
    with pytest.raises(SamplingError):
        probabilities(logits, SamplingParams(temperature=1.0))
    assert torch.allclose(probabilities(torch.tensor([[0.0, 1.0, 2.0]]), SamplingParams(temperature=1.0)).sum(), torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------
# Part 3: structured output, through the verify engine and the model drafter
# ---------------------------------------------------------------------------------------------
#
# The system under test: VerifyEngine (`open`, `prefill`, `verify` -> `judge` -> `_commit`) with a
# Tandem Matcher as the session's grammar, and ModelDrafter drafting under a second Matcher that
# follows the committed tokens, the guide's forced tokens proposed first with one-hot q, as
# draft_worker.speculation._guided does. The draft is a second tiny model with unrelated weights
# (seed 5): under the mask about 75% of its tokens are accepted, so every row rejects sometimes
# and the bonus row is reached too (asserted). Both models' forward passes are memoized by prefix
# (`_Memo`: logits are a function of the tokens), which makes thousands of sessions affordable;
# everything else is the workers' real path.
#
# The reference, the masked target alone, owes nothing to Tandem: the target's folder loaded
# with transformers, each row masked by xgrammar's own GrammarMatcher / bitmask API, divided by
# the temperature and softmaxed, enumerated over the first T = 3 tokens (an end token padded with
# PAD). The statistic is Part 2's `detection`: every full outcome and each position's marginal
# within Bernstein's bound at Z = 4.5, an outcome the reference forbids infinitely far.
#
# Guides (each leaves a choice at each of the first positions; the tokenizer has the token 'dd'):
#   "choice": [ab][a-d]{1,15} - 'a'/'b', then 'a'..'d' or 'dd', end-of-sequence from the third
#             character on; no forced tokens. k = 3.
#   "forced": [ab]([ab]-|[cd])[a-d]{1,15} - after 'aa', 'ab', 'ba' or 'bb' the guide forces '-',
#             which a round starting there (about one session in 20) proposes by jump-forward
#             before its k = 2 drafted tokens.
# Wrong variants, inside the verify engine only, through the same statistic:
#   "row0":     every row of a proposal masked with the state at row 0. Under "choice" the row 0
#               state is a subset of every later row's, so nothing the guide refuses is committed
#               and only frequencies move; under "forced" it commits refused tokens.
#   "unmasked": the target ignores the guide.

GUIDED_PROMPT = "def add(a, b):"
GUIDED_PARAMS = SamplingParams(temperature=10.0, max_new_tokens=32)   # the tiny target's logits are x25
GUIDED_N = 4000
GUIDED_CONFIGS = {   # name: (regex, k, wrong variants that must be detected)
    "choice": ("[ab][a-d]{1,15}", 3, ["row0", "unmasked"]),
    "forced": ("[ab]([ab]-|[cd])[a-d]{1,15}", 2, ["row0"]),
}


class _Tape:
    """Stands in for a SessionCache: the ids fed so far (`_Memo` computes the logits)."""
    capacity = 1 << 20

    def __init__(self) -> None:
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    def crop(self, n: int) -> None:
        del self.ids[n:]

    def keep_path(self, base: int, nodes: list[int]) -> None:
        self.ids[base:] = [self.ids[base + i] for i in nodes]

    def reserve(self, total: int, spare: bool = True) -> None:
        pass

    def release(self) -> None:
        pass

    def nbytes(self) -> int:
        return 0


class _Memo:
    """A CausalLM whose forward passes are memoized by prefix: the logits after ids[:j + 1] are the
    real model's row j of one pass over the whole sequence, computed the first time it is asked."""

    def __init__(self, lm) -> None:
        self.lm, self.pool, self.model = lm, lm.pool, lm.model
        self.vocab_size, self.eos_ids, self.max_context = lm.vocab_size, lm.eos_ids, lm.max_context
        self.rows: dict[tuple, torch.Tensor] = {}

    def new_cache(self, capacity: int = 64) -> _Tape:
        return _Tape()

    def forward(self, token_ids: list[int], cache: _Tape, last: int | None = None) -> torch.Tensor:
        start, full = cache.length, cache.ids + list(token_ids)
        if tuple(full) not in self.rows:
            real = self.lm.new_cache(len(full))
            try:
                logits = self.lm.forward(full, real)
            finally:
                real.release()
            for j in range(len(full)):
                self.rows[tuple(full[:j + 1])] = logits[j]
        cache.ids = full
        rows = [self.rows[tuple(full[:j + 1])] for j in range(start, len(full))]
        return torch.stack(rows[-last:] if last else rows)

    def forward_batch(self, items: list[tuple]) -> list[torch.Tensor]:
        """Chains only, each memoized as `forward`."""
        assert all(len(item) < 4 or item[3] is None for item in items)
        return [self.forward(ids, cache, last) for cache, ids, last, *_ in items]


@pytest.fixture(scope="module")
def guided(tiny_pair, tiny_models, tmp_path_factory):
    """(target folder, tokenizer, memoized target, memoized unrelated draft, Grammars, prompt ids)."""
    from tandem.engine.modeling import CausalLM, load_tokenizer
    from tandem.speculation.grammar import Grammars
    from tandem.testing import build_tiny_model
    target, model = tiny_pair[0], tiny_models[0]
    other = build_tiny_model(tmp_path_factory.mktemp("guided") / "draft", seed=5)
    tok = load_tokenizer(str(target))
    return (target, tok, _Memo(model), _Memo(CausalLM(str(other))),
            Grammars(tok, model.vocab_size, model.eos_ids), tok(GUIDED_PROMPT).input_ids)


def guided_exact(folder, tok, prompt: list[int], regex: str, temperature: float,
                 dtype: torch.dtype = torch.float32) -> dict[tuple, float]:
    """The masked target's distribution of the first T tokens, from transformers and xgrammar alone."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=sorted(eos))
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    result = {}

    def walk(out: tuple, prob: float):
        if len(out) == T or (out and out[-1] in eos):
            result[tuple(PAD if t in eos else t for t in out) + (PAD,) * (T - len(out))] = prob
            return
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(out)])).logits[:, -1].float().clone()   # [1, V]
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        p = torch.softmax(logits / temperature, dim=-1)[0]
        for t in p.nonzero().flatten().tolist():
            assert matcher.accept_token(t)
            walk(out + (t,), prob * float(p[t]))
            matcher.rollback(1)

    walk((), 1.0)
    return result


def guided_first_tokens(engine, drafter, grammars, guide, prompt: list[int], params: SamplingParams,
                        k: int, seen: Counter) -> tuple:
    """One session's first T tokens (PAD after its end), speculating as the draft worker does;
    counts each round's accepted tokens and the forced tokens proposed into `seen`."""
    from tandem.service import wire
    vocab = engine.model.vocab_size
    s = engine.open("guided", prompt, params, grammar=grammars.matcher(guide))
    engine.prefill(s)
    g = grammars.matcher(guide)                       # the draft side's, after s.tokens
    state = drafter.start(params, engine.model.eos_ids, len(prompt), grammar=g)
    try:
        while len(s.tokens) - len(prompt) < T and not s.stop_reason:
            forced = g.forced(engine.max_proposal - k)                        # jump-forward
            g.advance(forced)
            try:
                draft = state.propose(s.tokens + forced, k)
            finally:
                g.rollback(len(forced))
            tokens = forced + draft.tokens
            support = [(torch.tensor([t]), torch.tensor([1.0])) for t in forced] + draft.support
            q = wire.dense_draft_probs([wire.support_to_proto(i, p) for i, p in support], len(tokens), vocab)
            try:
                verdict = engine.verify(s, tokens, q)
            except RuntimeError:      # "a committed token broke the guide": wrong variants only
                break
            seen["forced"] += len(forced)
            seen[f"accepted {verdict.accepted - len(forced)} of {len(draft.tokens)}"] += 1
            if not verdict.stop_reason:
                assert g.advance(verdict.token_ids) == len(verdict.token_ids)
    finally:
        state.close()
    return tuple(s.tokens[len(prompt):len(prompt) + T]) + (PAD,) * (T - (len(s.tokens) - len(prompt)))


def guided_counts(guided, regex: str, k: int, n: int, bug: str | None, monkeypatch) -> tuple[Counter, Counter]:
    """(first T tokens of n sessions, seeds 0..n-1; what the rounds did)."""
    from dataclasses import replace

    import verify_worker.engine as engine_module
    from draft_worker.model import ModelDrafter
    from tandem.speculation.grammar import Guide
    _, _, target, draft, grammars, prompt = guided
    real = engine_module.process

    def wrong(logits, history, prompt_len, params, eos_ids, proposed=(), allowed=None):
        if allowed is not None:
            allowed = None if bug == "unmasked" else allowed[:1].expand_as(allowed)   # "row0"
        return real(logits, history, prompt_len, params, eos_ids, proposed, allowed)

    engine, drafter, guide = engine_module.VerifyEngine(target), ModelDrafter(draft), Guide("regex", regex)
    seen: Counter = Counter()
    with monkeypatch.context() as patch:
        if bug is not None:
            patch.setattr(engine_module, "process", wrong)
        counts = Counter(guided_first_tokens(engine, drafter, grammars, guide, prompt,
                                             replace(GUIDED_PARAMS, seed=seed), k, seen) for seed in range(n))
    return counts, seen


def test_guided_threshold_detects_four_percentage_points():
    assert bound(0.5, GUIDED_N) < 0.04


@pytest.fixture(scope="module")
def guided_bfloat16(guided):
    """`guided` with target and draft served in bfloat16."""
    from tandem.engine.modeling import CausalLM
    folder, tok, target, draft, grammars, prompt = guided
    return (folder, tok, _Memo(CausalLM(str(folder), dtype="bfloat16")), _Memo(CausalLM(str(draft.lm.path), dtype="bfloat16")),
            grammars, prompt)


@pytest.mark.parametrize("name", [*GUIDED_CONFIGS, pytest.param("choice at bfloat16", marks=pytest.mark.slow)])
def test_guided_speculative_matches_masked_target(guided, guided_bfloat16, name, monkeypatch):
    """The configs above, and the first with the target served in bfloat16 against transformers
    in bfloat16: its rows in a verify pass are its rows in plain decoding (batch invariance, which
    `_Memo` assumes and tests/test_invariance.py proves), so the same statistic holds."""
    at_bf16 = name.endswith("bfloat16")
    regex, k, bugs = GUIDED_CONFIGS[name.split()[0]]
    if at_bf16:
        guided, bugs = guided_bfloat16, bugs[-1:]
    folder, tok, *_, prompt = guided
    exact = guided_exact(folder, tok, prompt, regex, GUIDED_PARAMS.temperature,
                         torch.bfloat16 if at_bf16 else torch.float32)
    assert abs(sum(exact.values()) - 1) < 1e-5
    for pos in range(T):          # a real choice at every position, end-of-sequence among them
        assert len({c[pos] for c in exact}) >= (2 if pos == 0 else 5), (pos, exact)
    assert any(PAD in c for c in exact)
    stats, seen = {}, {}
    for bug in [None, *bugs]:
        counts, seen[bug] = guided_counts(guided, regex, k, GUIDED_N, bug, monkeypatch)
        stats[bug] = detection(counts, exact)
    print(name, {b: round(s, 2) for b, s in stats.items()}, dict(seen[None]))
    # every row of a proposal rejected sometimes, and all of it accepted (the bonus row) too
    assert all(seen[None][f"accepted {a} of {k}"] > 0 for a in range(k + 1)), seen[None]
    assert (seen[None]["forced"] > 0) == (name == "forced")
    assert stats[None] < 1, stats
    for bug in bugs:
        assert stats[bug] > 1, (bug, stats)


# ---------------------------------------------------------------------------------------------
# Part 4: sampled speculation with a trained head, through the verify worker's head rounds
# ---------------------------------------------------------------------------------------------
#
# The system under test: the verify worker's head speculation (verify_worker.headspec: `open`,
# `prefill_then`, `draft`, `step` and its follow-up `_judge` -> VerifyEngine.judge_fed), driven as
# tests.local.speculate_head drives it, with the head's tensors and context in the loop. The target
# is the tiny model, memoized by prefix as in Part 3 (`_TapMemo` also returns the tapped hidden
# states the head reads); the head drafts for real (HeadDrafter.draft: a block pass, then left to
# right with the Markov bias, each position drawn through the request's own pipeline and guide,
# tandem.speculation.drafting: q is the processed, warped distribution it drew from).
# choose_k is fixed to k = 3 (a random head's confidences would choose k at random, 0 included).
#
# An untrained head's proposals are almost never inside the target's top-k, so the rows after the
# first would never be judged. The head here is an untrained one whose final norm is scaled down
# (its own logits stay, smaller) and whose Markov table holds, after each token of the tree of
# the target's top-k continuations, twice the target's raw logits after that token's history (the
# first history where a token occurs several times): an overconfident head, its q sharper than the
# target's distribution (and its own top k not always the target's), so every row is reached,
# rejected sometimes, and the bonus row is reached too (asserted). One config samples at temperature 1.5, where a q that
# left out the temperature would be wrong (checked by hand: detection 2.3).
#
# The reference owes nothing to Tandem: the target's folder loaded with transformers, its last
# logits through transformers' own RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
# TopKLogitsWarper and TopPLogitsWarper (generate's order), softmaxed, enumerated over the first
# T = 3 tokens (an end token padded with PAD). The statistic is Part 2's `detection`.
#
# Wrong variants, through the same statistic:
#   "reported_q":  the head samples from its q but reports the uniform distribution over q's
#                  support;
#   "shifted_q":   the q reported for each position is the next position's;
#   "no_penalty":  the verify worker ignores the repetition penalty.
# (A verify worker processing every row with the committed history only, so that a token proposed
# earlier in the block escapes the penalty, is caught by Part 2. Here it changes no outcome: the
# head draws through the same pipeline, penalty included, and on this tiny target a token just
# drawn never returns to the next row's top 4, so the two rules agree on every row that counts.)
# (A verify worker that ignores q and judges the proposal as deterministic is not wrong: accepting x
# with chance p(x) and otherwise drawing from p without x emits exactly p, for any q; it only
# accepts less.) The wrong variants run HEAD_WRONG_N sessions each, to keep the test short: each
# is still detected with a wide margin (above 2, or infinitely far).

HEAD_PROMPT = "The quick brown fox"
HEAD_N, HEAD_WRONG_N = 3000, 800
HEAD_K = 3
HEAD_TABLE_SCALE = 2.0
HEAD_CONFIGS = {   # name: (params, wrong variants that must be detected)
    "top_k": (SamplingParams(temperature=1.5, top_k=4, max_new_tokens=32), ["reported_q", "shifted_q"]),
    "repetition": (SamplingParams(temperature=1.0, top_k=4, top_p=0.9, repetition_penalty=2.0, max_new_tokens=32),
                   ["no_penalty"]),
}


class _TapMemo(_Memo):
    """`_Memo` with the tapped hidden states too (CausalLM.forward's `taps`), memoized alike."""

    forward_ms: list[float] = []

    def __init__(self, lm) -> None:
        super().__init__(lm)
        self.features: dict[tuple, torch.Tensor] = {}

    def new_cache(self, capacity: int = 64) -> _Tape:
        tape = _Tape()
        tape.capacity = capacity          # the head's context is sized by it
        return tape

    def forward(self, token_ids: list[int], cache: _Tape, last: int | None = None, taps: tuple = ()):
        start, full = cache.length, cache.ids + list(token_ids)
        if taps and (taps, tuple(full)) not in self.features:
            real = self.lm.new_cache(len(full))
            try:
                logits, features = self.lm.forward(full, real, taps=taps)
            finally:
                real.release()
            for j in range(len(full)):
                self.rows[tuple(full[:j + 1])] = logits[j]
                self.features[(taps, tuple(full[:j + 1]))] = features[j]
        logits = super().forward(token_ids, cache, last)
        if not taps:
            return logits
        return logits, torch.stack([self.features[(taps, tuple(full[:j + 1]))] for j in range(start, len(full))])


def head_exact(folder, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """The target's distribution of the first T tokens under params, from transformers alone."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    processors = LogitsProcessorList(
        ([RepetitionPenaltyLogitsProcessor(params.repetition_penalty)] if params.repetition_penalty != 1.0 else [])
        + [TemperatureLogitsWarper(params.temperature)]
        + ([TopKLogitsWarper(params.top_k)] if params.top_k else [])
        + ([TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []))
    result = {}

    def walk(out: tuple, prob: float):
        if len(out) == T or (out and out[-1] in eos):
            result[tuple(PAD if t in eos else t for t in out) + (PAD,) * (T - len(out))] = prob
            return
        ids = torch.tensor([prompt + list(out)])
        with torch.no_grad():
            scores = processors(ids, model(ids).logits[:, -1].float())
        p = torch.softmax(scores, dim=-1)[0]
        for t in p.nonzero().flatten().tolist():
            walk(out + (t,), prob * float(p[t]))

    walk((), 1.0)
    return result


@pytest.fixture(scope="module")
def head_setup(tiny_pair, tiny_models):
    """(target folder, memoized target, prompt ids, serving target)."""
    from tandem.engine.modeling import load_tokenizer
    target, model = tiny_pair[0], tiny_models[0]
    return target, _TapMemo(model), load_tokenizer(str(target))(HEAD_PROMPT).input_ids, model


def table_spec(head_setup, exact: dict[tuple, float], path, shape=None):
    """HeadSpeculation with the head described above, for the tree of `exact`'s outcomes;
    shape(history, logits) -> logits changes each table row before it is scaled."""
    from tandem.head.checkpoint import load_drafter
    from tandem.testing import build_random_head
    from verify_worker.engine import VerifyEngine
    from verify_worker.headspec import HeadSpeculation
    folder, memo, prompt, model = head_setup
    build_random_head(path, folder, seed=2, block_size=HEAD_K, markov_rank=32)
    drafter = load_drafter(str(path), model, str(folder))
    head = drafter.head
    after: dict[int, list[int]] = {}          # previous token -> the history its row is the target's after
    for outcome in exact:
        history = list(prompt)
        for t in outcome[:T - 1]:
            after.setdefault(history[-1], list(history))
            if t == PAD:
                break
            history.append(t)
        else:
            after.setdefault(history[-1], history)
    table = {}
    for t, history in after.items():
        cache = model.new_cache(len(history) + 1)
        table[t] = model.forward(history, cache, last=1)[0]
        cache.release()
        if shape is not None:
            table[t] = shape(history, table[t])
    assert len(table) <= head.config.markov_rank
    with torch.no_grad():
        head.norm.weight.mul_(0.25)
        head.markov_head.markov_w1.weight.zero_()
        head.markov_head.markov_w2.weight.zero_()
        for i, (t, logits) in enumerate(table.items()):
            head.markov_head.markov_w1.weight[t, i] = 1.0
            head.markov_head.markov_w2.weight[:, i] = logits * HEAD_TABLE_SCALE
    return HeadSpeculation(drafter, VerifyEngine(memo))


def head_first_tokens(spec, prompt: list[int], params: SamplingParams, seen: Counter, grammar=None) -> tuple:
    """One session's first T tokens (PAD after its end) through the head rounds, under `grammar`
    (a guide's fresh matcher) if given; counts each round's accepted tokens into `seen`."""
    from tests.local import open_head_session
    engine = spec.engine
    s = open_head_session(engine, spec, prompt, params, "head", grammar)
    spec.draft(s, s.drafting)
    while len(s.tokens) - len(prompt) < T and not s.stop_reason:
        step, proposed = spec.step(s, s.drafting)
        verdict = step.then(engine.model.forward(step.tokens, s.cache, taps=spec.taps))
        seen[f"accepted {verdict.accepted} of {len(proposed)}"] += 1
    out = s.tokens[len(prompt):len(prompt) + T]
    return tuple(out) + (PAD,) * (T - len(out))


def head_counts(spec, prompt: list[int], params: SamplingParams, n: int, bug: str | None,
                monkeypatch, matcher=None) -> tuple[Counter, Counter]:
    """(first T tokens of n sessions, seeds 0..n-1; what the rounds did). matcher: a fresh guide
    matcher per session, when guided."""
    from dataclasses import replace

    import verify_worker.engine as engine_module
    import verify_worker.headspec as headspec
    real_process, real_draft = engine_module.process, spec.drafter.draft

    def no_penalty(logits, history, prompt_len, params, eos_ids, proposed=(), allowed=None):
        return real_process(logits, history, prompt_len, replace(params, repetition_penalty=1.0), eos_ids,
                            proposed, allowed)

    def reported_q(*args, **kwargs):
        draft = real_draft(*args, **kwargs)
        draft.support = [(ids, torch.full_like(probs, 1 / len(probs))) for ids, probs in draft.support]
        return draft

    def shifted_q(*args, **kwargs):
        draft = real_draft(*args, **kwargs)
        draft.support = draft.support[1:] + draft.support[-1:]
        return draft

    def unmasked_q(ctx, anchor, k, rows):
        # the head drawing as if there were no guide (q unmasked), its rows still following it
        grammar, rows.grammar = rows.grammar, None
        try:
            draft = real_draft(ctx, anchor, k, rows)
        finally:
            rows.grammar = grammar
        return draft

    real_step = headspec.HeadSpeculation.step

    def cut_at_refusal(self, s, h, k=None):
        # the old rule: the unmasked block cut before the first token the guide refuses
        step, proposed = real_step(self, s, h, k)
        taken = s.grammar.advance(proposed)
        s.grammar.rollback(taken)
        if taken < len(proposed):
            h.proposal.tokens = h.proposal.tokens[:taken]
            h.proposal.support = h.proposal.support[:taken]
            h.rest, h.backoff = 0, 0
            step, proposed = real_step(self, s, h, taken)
        return step, proposed

    seen: Counter = Counter()
    with monkeypatch.context() as patch:
        patch.setattr(headspec, "choose_k", lambda confidence, curve, head_ms=0.0: HEAD_K)
        if bug == "no_penalty":
            patch.setattr(engine_module, "process", no_penalty)
        if bug == "reported_q":
            patch.setattr(spec.drafter, "draft", reported_q)
        if bug == "shifted_q":
            patch.setattr(spec.drafter, "draft", shifted_q)
        if bug == "unmasked_q":
            patch.setattr(spec.drafter, "draft", unmasked_q)
        if bug == "cut_at_refusal":
            patch.setattr(spec.drafter, "draft", unmasked_q)
            patch.setattr(headspec.HeadSpeculation, "step", cut_at_refusal)
        counts = Counter(head_first_tokens(spec, prompt, replace(params, seed=seed), seen,
                                           matcher() if matcher else None) for seed in range(n))
    return counts, seen


def test_head_threshold_detects_four_and_a_half_percentage_points():
    assert bound(0.5, HEAD_N) < 0.045


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n == "repetition" else [])
                                  for n in HEAD_CONFIGS])
def test_head_speculative_matches_target(head_setup, name, monkeypatch, tmp_path):
    params, bugs = HEAD_CONFIGS[name]
    folder, _, prompt, _ = head_setup
    exact = head_exact(folder, prompt, params)
    assert abs(sum(exact.values()) - 1) < 1e-5
    for pos in range(T):          # a real choice at every position
        assert len({c[pos] for c in exact}) >= (2 if pos == 0 else 4), (pos, exact)
    spec = table_spec(head_setup, exact, tmp_path / "head.safetensors")
    stats, seen = {}, {}
    for bug in [None, *bugs]:
        counts, seen[bug] = head_counts(spec, prompt, params, HEAD_WRONG_N if bug else HEAD_N, bug, monkeypatch)
        stats[bug] = detection(counts, exact)
    print(name, {b: round(s, 2) for b, s in stats.items()}, dict(seen[None]))
    # every proposal is HEAD_K tokens long; every row rejected sometimes, and all accepted too
    assert all(key.endswith(f"of {HEAD_K}") for key in seen[None]), seen[None]
    assert all(seen[None][f"accepted {a} of {HEAD_K}"] > HEAD_N // 100 for a in range(HEAD_K + 1)), seen[None]
    assert stats[None] < 1, stats
    for bug in bugs:
        assert stats[bug] > 1, (bug, stats)


# Under a guide (issue 30): the head draws each position through the guide's mask, so its q is the
# distribution it drew from and no sampled proposal is cut by what it drew. The target is the tiny
# model under Part 3's "choice" guide at temperature 10 (its logits are x25), the reference
# transformers with xgrammar's own matcher (Part 3's `guided_exact`), the head the overconfident
# table head above, built on the guided outcomes, each table row the target's logits where the
# guide allows a token, negated and sharpened (the head prefers what the target does not, so the
# residual differs from p: where q is close to p, drawing from p instead of the residual changes
# little), and beside them one token the guide refuses, as likely as the best allowed one. Wrong variants:
# "unmasked_q", the head drawing without the mask (the target rejects every refused token it
# proposes: exact all the same, only slower, so it must NOT be detected), and "cut_at_refusal",
# the old rule (an unmasked draw cut before the first refused token, which hands that position to
# p instead of the residual): detected.
HEAD_GUIDED_REGEX = "[ab][a-d]{1,15}"


def test_head_under_a_guide_matches_the_masked_target(head_setup, guided, monkeypatch, tmp_path):
    from dataclasses import replace

    from tandem.speculation.grammar import Guide
    folder, _, prompt, _ = head_setup
    _, tok, _, _, grammars, _ = guided
    params = replace(GUIDED_PARAMS, max_new_tokens=32)
    exact = guided_exact(folder, tok, prompt, HEAD_GUIDED_REGEX, params.temperature)
    assert abs(sum(exact.values()) - 1) < 1e-5
    guide = Guide("regex", HEAD_GUIDED_REGEX)

    def allowed_and_one_refused(history: list[int], logits: torch.Tensor) -> torch.Tensor:
        m = grammars.matcher(guide)
        m.advance(history[len(prompt):])
        allowed = m.allowed()[0]
        refused = int(logits.masked_fill(allowed, float("-inf")).argmax())
        out = (-3.0 * logits).masked_fill(~allowed, -1e3)       # the target's order reversed, sharper
        out[refused] = out[allowed].max()
        return out

    spec = table_spec(head_setup, exact, tmp_path / "head.safetensors", allowed_and_one_refused)
    stats, seen = {}, {}
    for bug in (None, "unmasked_q", "cut_at_refusal"):
        counts, seen[bug] = head_counts(spec, prompt, params, HEAD_WRONG_N if bug else HEAD_N, bug, monkeypatch,
                                        lambda: grammars.matcher(guide))
        stats[bug] = detection(counts, exact)
    print("guided head", {b: round(s, 2) for b, s in stats.items()}, dict(seen[None]))
    assert all(seen[None][f"accepted {a} of {HEAD_K}"] > HEAD_N // 100 for a in range(HEAD_K + 1)), seen[None]
    assert stats[None] < 1 and stats["unmasked_q"] < 1, stats
    assert stats["cut_at_refusal"] > 1, stats

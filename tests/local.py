"""The speculation loop run in one process (no gRPC), with the same engine and drafters the
workers use: for tests that need thousands of generations and for measuring what the network costs."""

from __future__ import annotations

from draft_worker.drafters import Drafter
from tandem.engine.modeling import CausalLM
from tandem.service import wire
from tandem.speculation.room import plan_k
from tandem.speculation.sampling import SamplingParams, choose, make_generator, process
from tandem.speculation.tree import TreeBudget
from verify_worker.engine import VerifyEngine


def speculate(engine: VerifyEngine, drafter: Drafter | None, prompt: list[int], params: SamplingParams,
              k: int, reports: list | None = None, budget: TreeBudget | None = None,
              drafts: list | None = None) -> tuple[list[int], int, int]:
    """Returns (generated tokens, drafted, accepted); appends the tokens' logprob reports to
    `reports` when given (params must ask for them), and each Draft to `drafts`. With a budget,
    the drafter proposes trees."""
    s = engine.open("local", prompt, params)
    engine.prefill(s)
    state = drafter.start(params, engine.model.eos_ids, len(prompt)) if drafter else None
    drafted = accepted = 0
    while not s.stop_reason:
        kk = plan_k(k, len(s.tokens), s.generated, params.max_new_tokens, engine.model.max_context,
                    engine.max_proposal) if state else 0
        draft = state.propose(list(s.tokens), kk, budget) if state else None
        if drafts is not None and draft is not None:
            drafts.append(draft)
        tokens = draft.tokens if draft else []
        q = None
        if draft is not None and draft.support is not None and not params.greedy:
            dists = [wire.support_to_proto(ids, probs) for ids, probs in draft.support]
            q = wire.dense_draft_probs(dists, len(tokens), engine.model.vocab_size)
        v = engine.verify(s, tokens, q, draft.parents if draft else None)
        if reports is not None:
            reports += v.logprobs or ()
        drafted += len(tokens)
        accepted += v.accepted
    if state is not None:
        state.close()
    return s.tokens[len(prompt):], drafted, accepted


def reference(model: CausalLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """The target alone, token by token, the way a plain decoder does it."""
    cache = model.new_cache(len(prompt) + params.max_new_tokens)
    g = make_generator(params.seed, stream=0)
    logits = model.forward(prompt, cache, last=1)
    out: list[int] = []
    while True:
        t = choose(process(logits, [*prompt, *out], len(prompt), params, model.eos_ids), params, g)
        if t in model.eos_ids:
            return out
        out.append(t)
        if len(out) >= params.max_new_tokens or len(prompt) + len(out) >= model.max_context:
            return out
        logits = model.forward([t], cache)


def speculate_head(engine: VerifyEngine, spec, prompt: list[int], params: SamplingParams) -> tuple[list[int], int, int]:
    """The verify worker's head rounds (verify_worker.headspec) in one process: the same session
    steps and follow-ups, each step fed alone. Returns (generated tokens, drafted, accepted)."""
    s = open_head_session(engine, spec, prompt, params)
    spec.draft(s, s.drafting)
    drafted = accepted = 0
    while not s.stop_reason:
        step, proposed = spec.step(s, s.drafting)
        v = step.then(engine.model.forward_batch([(s.cache, step.tokens, None, step.tree)], spec.taps)[0])
        drafted += len(proposed)
        accepted += v.accepted
    return s.tokens[len(prompt):], drafted, accepted


def open_head_session(engine: VerifyEngine, spec, prompt: list[int], params: SamplingParams, session_id: str = "local",
                      grammar=None):
    """A session opened and prefilled as the verify worker does for draft method "head": no KV
    reused, every prompt position's states handed to the head; `grammar`, the guide's matcher after
    the prompt. Its first block is not drafted yet."""
    s = engine.open(session_id, prompt, params, reuse_prefix=False, grammar=grammar)
    s.drafting = spec.open(s)
    for piece in engine.prefill_chunks(s, 512):
        spec.prefill_then(s, s.drafting, lambda logits: None)(engine.model.forward(piece, s.cache, last=1, taps=spec.taps))
    return s

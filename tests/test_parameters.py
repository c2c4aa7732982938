"""Every request parameter through the whole service, with speculation on, against an oracle no
one here wrote: transformers' own `generate` on the target alone with its own logits processors
(RepetitionPenaltyLogitsProcessor, ExponentialDecayLengthPenalty via `generate`'s arguments) and its
raw `output_logits` for logprobs. Presence and frequency penalties have no transformers processor;
they are written below as one, from OpenAI's formula.

Logprobs are compared to 1e-3: the service's batched kernels (packed GEMM, paged attention) sum in
another order than transformers' eager forward, so equality cannot be exact (docs/api.md, Parameters under speculation).
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from fmaas import generation_pb2 as fm
from tandem.v1 import generation_pb2 as tpb
from tests.stack import stack, wait_until_idle  # noqa: F401  (stack: the fixture)

pytestmark = pytest.mark.service

# the last repeats itself, so that the n-gram drafter finds matches whatever the model says
PROMPTS = ["def add(a, b):", "for i in range(10):\n", "The quick brown fox", "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"]
TIMEOUT = 60
TOL = 1e-3
NEW = 24
METHODS = {"model": tpb.DRAFT_METHOD_MODEL, "ngram": tpb.DRAFT_METHOD_NGRAM, "none": tpb.DRAFT_METHOD_NONE}


class OpenAIPenalties(LogitsProcessor):
    """presence/frequency penalties over the generated tokens only (OpenAI's definition)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


PENALTIES = {
    "repetition": dict(repetition_penalty=1.5),
    "length": dict(length_penalty=(6, 1.4)),
    "presence_frequency": dict(presence_penalty=1.2, frequency_penalty=0.8),
    "repetition_length": dict(repetition_penalty=1.3, length_penalty=(4, 1.5)),
}


@pytest.fixture(autouse=True, params=["chained", "streamed"])
def always_speculate(stack, request):
    """The draft worker proposes every round: its rate controller would otherwise learn that the
    tiny models' drafts do not pay and decode plainly, and the tests would not speculate. Every
    test runs twice: proposals sent whole per round, and streamed as drafted (--pipeline)."""
    stack.draft.drafting.adaptive_k = False
    stack.draft.drafting.pipeline = request.param == "streamed"
    yield
    stack.draft.drafting.adaptive_k = True
    stack.draft.drafting.pipeline = False


def reference(oracle, prompt: str, max_new: int = NEW, **penalty) -> tuple[list[int], torch.Tensor, list[int]]:
    """(generated ids without the final EOS, raw logits [n, V] of each, prompt ids) from transformers."""
    model, tok = oracle
    ids = tok(prompt).input_ids
    kwargs = {}
    if "repetition_penalty" in penalty:
        kwargs["repetition_penalty"] = penalty["repetition_penalty"]
    if "length_penalty" in penalty:
        kwargs["exponential_decay_length_penalty"] = penalty["length_penalty"]
    processors = LogitsProcessorList()
    if "presence_penalty" in penalty:
        processors.append(OpenAIPenalties(len(ids), penalty["presence_penalty"], penalty["frequency_penalty"]))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new, logits_processor=processors,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.eos_token_id, **kwargs)
    gen = out.sequences[0, len(ids):].tolist()
    if tok.eos_token_id in gen:
        gen = gen[:gen.index(tok.eos_token_id)]
    return gen, torch.cat(out.logits)[:len(gen)].float(), ids


def request(prompt: str, method: str, max_new: int = NEW, top: int = 0, prompt_logprobs: bool = False,
            **penalty) -> tpb.GenerateRequest:
    sampling = tpb.SamplingParameters(max_new_tokens=max_new, repetition_penalty=penalty.get("repetition_penalty", 0),
                                      presence_penalty=penalty.get("presence_penalty", 0),
                                      frequency_penalty=penalty.get("frequency_penalty", 0))
    if "length_penalty" in penalty:
        start, decay = penalty["length_penalty"]
        sampling.length_penalty.start_index, sampling.length_penalty.decay_factor = start, decay
    return tpb.GenerateRequest(prompt=prompt, sampling=sampling,
                               speculation=tpb.SpeculationOptions(method=METHODS[method], num_speculative_tokens=4),
                               logprobs=tpb.LogprobOptions(logprobs=True, top_logprobs=top,
                                                           prompt_logprobs=prompt_logprobs))


def check_reports(reports, logits: torch.Tensor, ids: list[int], tok, top: int) -> None:
    """Each report's logprob, rank and top list (`top` long: what the request asked) against the
    reference's raw logits [n, V]."""
    assert [r.token_id for r in reports] == ids
    logp = torch.log_softmax(logits, dim=-1)
    for r, row, t in zip(reports, logp, ids):
        assert r.text == tok.decode([t])
        assert abs(r.logprob - float(row[t])) < TOL, (r.logprob, float(row[t]))
        assert r.rank == int((row > row[t]).sum()) + 1
        assert len(r.top_logprobs) == top, (len(r.top_logprobs), top)
        want = torch.topk(row, top)
        assert [x.token_id for x in r.top_logprobs] == want.indices.tolist()
        assert all(abs(x.logprob - v) < TOL for x, v in zip(r.top_logprobs, want.values.tolist()))


@pytest.mark.parametrize("method", ["model", "ngram", "none"])
@pytest.mark.parametrize("penalty", list(PENALTIES))
async def test_greedy_with_penalty_equals_transformers(stack, oracle, method, penalty):
    changed = drafted = 0
    for prompt in PROMPTS:
        want, logits, _ = reference(oracle, prompt, **PENALTIES[penalty])
        got = await stack.tandem.Generate(request(prompt, method, **PENALTIES[penalty]), timeout=TIMEOUT)
        assert [t.token_id for t in got.tokens] == want, prompt
        assert got.text == oracle[1].decode(want)
        check_reports(got.tokens, logits, want, oracle[1], top=0)      # raw logprobs, also under a penalty
        changed += want != reference(oracle, prompt)[0]
        drafted += got.usage.draft_tokens
    assert changed, f"{penalty} changed no prompt's output: the comparison proves nothing"
    assert (drafted > 0) == (method != "none")


@pytest.mark.parametrize("method", ["model", "ngram", "none"])
async def test_logprobs_ranks_top_and_prompt_logprobs_equal_transformers(stack, oracle, method):
    model, tok = oracle
    for prompt in PROMPTS:
        want, logits, ids = reference(oracle, prompt)
        got = await stack.tandem.Generate(request(prompt, method, top=5, prompt_logprobs=True), timeout=TIMEOUT)
        check_reports(got.tokens, logits, want, tok, top=5)
        with torch.no_grad():
            prompt_logits = model(torch.tensor([ids])).logits[0, :-1]        # row i predicts ids[i + 1]
        first, *rest = got.prompt_tokens
        assert first.token_id == ids[0] and not first.HasField("logprob")
        check_reports(rest, prompt_logits, ids[1:], tok, top=5)


async def test_streamed_logprobs_cover_each_delta(stack, oracle):
    want, logits, ids = reference(oracle, PROMPTS[1])
    msgs = [m async for m in stack.tandem.GenerateStream(request(PROMPTS[1], "model", top=3, prompt_logprobs=True),
                                                         timeout=TIMEOUT)]
    assert [len(m.tokens) for m in msgs] == [m.token_count for m in msgs]
    assert len(msgs[0].prompt_tokens) == len(ids) and not any(m.prompt_tokens for m in msgs[1:])
    check_reports([r for m in msgs for r in m.tokens], logits, want, oracle[1], top=3)


async def test_seeded_sampling_with_every_stage_repeats(stack):
    """Sampled requests with every processing stage on are served, with speculation, and the seed
    reproduces them (their distribution is proven in tests/test_distribution.py)."""
    sampling = tpb.SamplingParameters(temperature=0.9, top_k=40, top_p=0.95, typical_p=0.9, seed=11,
                                      max_new_tokens=20, repetition_penalty=1.2, presence_penalty=0.3,
                                      frequency_penalty=0.2, length_penalty=tpb.LengthPenalty(start_index=5,
                                                                                             decay_factor=1.2))
    req = tpb.GenerateRequest(prompt=PROMPTS[0], sampling=sampling,
                              speculation=tpb.SpeculationOptions(method=tpb.DRAFT_METHOD_MODEL),
                              logprobs=tpb.LogprobOptions(logprobs=True))
    a = await stack.tandem.Generate(req, timeout=TIMEOUT)
    b = await stack.tandem.Generate(req, timeout=TIMEOUT)
    assert a.text == b.text and a.usage.generated_tokens > 0 and a.usage.draft_tokens > 0
    assert len(a.tokens) == a.usage.generated_tokens
    assert all(t.logprob <= 0 and t.rank >= 1 for t in a.tokens)


async def test_truncation_keeps_the_last_tokens(stack, oracle):
    _, tok = oracle
    ids = tok(PROMPTS[2]).input_ids
    assert len(ids) > 4
    tail = tok.decode(ids[-4:])
    # the precondition of comparing with the tail alone, true of the tiny tokenizer and this prompt
    assert tok(tail).input_ids == ids[-4:], "the last 4 tokens do not re-encode to themselves"
    want, _, _ = reference(oracle, tail)
    for face in ("tandem", "tgis"):
        if face == "tandem":
            req = request(PROMPTS[2], "model")
            req.truncate_input_tokens = 4
            got = await stack.tandem.Generate(req, timeout=TIMEOUT)
            assert got.usage.prompt_tokens == 4
            assert [t.token_id for t in got.tokens] == want
        else:
            p = fm.Parameters(truncate_input_tokens=4, stopping=fm.StoppingCriteria(max_new_tokens=NEW))
            [got] = (await stack.tgis.Generate(fm.BatchedGenerationRequest(
                requests=[fm.GenerationRequest(text=PROMPTS[2])], params=p), timeout=TIMEOUT)).responses
            assert got.input_token_count == 4
            assert got.text == tok.decode(want)
    # more than the prompt holds keeps it whole (TGIS); the context window or more is refused
    req = request(PROMPTS[2], "none")
    req.truncate_input_tokens = len(ids) + 10
    assert (await stack.tandem.Generate(req, timeout=TIMEOUT)).usage.prompt_tokens == len(ids)
    req.truncate_input_tokens = stack.core.max_context
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stack.tandem.Generate(req, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "truncate_input_tokens must be below the model's context" in err.value.details()


# ---- the TGIS face: caikit-nlp's default request ----

def caikit_default(text: str, max_new_tokens: int = NEW) -> fm.SingleGenerationRequest:
    """What caikit-nlp's TextGenerationTGIS.run sends by default (GREEDY with the neutral sampling
    values, per-token logprobs and ranks, no truncation, max_time as time_limit_millis)."""
    return fm.SingleGenerationRequest(
        model_id="", request=fm.GenerationRequest(text=text),
        params=fm.Parameters(
            method=fm.GREEDY,
            sampling=fm.SamplingParameters(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0),
            stopping=fm.StoppingCriteria(max_new_tokens=max_new_tokens, min_new_tokens=0, time_limit_millis=60_000),
            response=fm.ResponseOptions(generated_tokens=True, token_logprobs=True, token_ranks=True),
            decoding=fm.DecodingParameters(repetition_penalty=1.0),
            truncate_input_tokens=0))


def check_token_infos(infos, logits: torch.Tensor, ids: list[int], tok) -> None:
    logp = torch.log_softmax(logits, dim=-1)
    assert len(infos) == len(ids)
    for info, row, t in zip(infos, logp, ids):
        assert info.text == tok.decode([t])
        assert abs(info.logprob - float(row[t])) < TOL
        assert info.rank == int((row > row[t]).sum()) + 1


@pytest.mark.parametrize("method", ["model", "ngram"])
async def test_caikit_default_request_on_generate_and_stream(stack, oracle, method):
    md = (("x-tandem-draft-method", method), ("x-tandem-num-speculative-tokens", "4"))
    _, tok = oracle
    for prompt in PROMPTS:
        want, logits, ids = reference(oracle, prompt)
        single = caikit_default(prompt)
        [batch] = (await stack.tgis.Generate(fm.BatchedGenerationRequest(
            model_id="", requests=[single.request], params=single.params), metadata=md, timeout=TIMEOUT)).responses
        assert batch.text == tok.decode(want) and batch.generated_token_count == len(want)
        check_token_infos(batch.tokens, logits, want, tok)
        assert all(i.rank == 1 for i in batch.tokens)          # greedy, nothing processed: the top token
        msgs = [m async for m in stack.tgis.GenerateStream(single, metadata=md, timeout=TIMEOUT)]
        assert msgs[0].input_token_count == len(ids) and not msgs[0].tokens
        assert "".join(m.text for m in msgs) == batch.text
        prev = 0
        for m in msgs[1:]:           # each message carries the tokens it adds to the count
            assert len(m.tokens) == m.generated_token_count - prev
            prev = m.generated_token_count
        check_token_infos([i for m in msgs for i in m.tokens], logits, want, tok)


async def test_tgis_input_tokens_top_n_and_defaults(stack, oracle):
    model, tok = oracle
    want, logits, ids = reference(oracle, PROMPTS[0], max_new=20)
    req = caikit_default(PROMPTS[0], max_new_tokens=0)       # 0: TGIS's documented default, 20
    req.params.response.input_tokens = True
    req.params.response.top_n_tokens = 3
    req.params.response.input_text = True
    msgs = [m async for m in stack.tgis.GenerateStream(req, timeout=TIMEOUT)]
    first = msgs[0]
    assert first.text == PROMPTS[0] and len(first.input_tokens) == len(ids)
    assert math.isnan(first.input_tokens[0].logprob) and first.input_tokens[0].rank == 0
    with torch.no_grad():
        prompt_logits = model(torch.tensor([ids])).logits[0, :-1]
    check_token_infos(first.input_tokens[1:], prompt_logits, ids[1:], tok)
    generated = [i for m in msgs[1:] for i in m.tokens]
    check_token_infos(generated, logits, want, tok)
    assert msgs[-1].generated_token_count == len(want) <= 20
    top = torch.topk(torch.log_softmax(logits, dim=-1), 3)
    for info, top_ids, top_lp in zip(generated, top.indices.tolist(), top.values.tolist()):
        assert [t.text for t in info.top_tokens] == [tok.decode([t]) for t in top_ids]
        assert all(abs(t.logprob - v) < TOL for t, v in zip(info.top_tokens, top_lp))
    assert await wait_until_idle(stack) == (0, 0)

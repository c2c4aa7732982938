"""The TGIS face (fmaas.GenerationService) over real gRPC, against the in-process stack."""

from __future__ import annotations

import grpc
import pytest

from fmaas import generation_pb2 as fm
from tandem.v1 import generation_pb2 as tpb
from tests.stack import stack, wait_until_idle  # noqa: F401  (stack: the fixture)

pytestmark = pytest.mark.service

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "The quick brown fox", "class Point:"]
TIMEOUT = 60


def params(max_new_tokens: int = 32, **stopping) -> fm.Parameters:
    return fm.Parameters(stopping=fm.StoppingCriteria(max_new_tokens=max_new_tokens, **stopping))


def single(text: str = PROMPTS[0], p: fm.Parameters | None = None, **fields) -> fm.SingleGenerationRequest:
    return fm.SingleGenerationRequest(request=fm.GenerationRequest(text=text), params=p or params(), **fields)


def batch(texts: list[str], p: fm.Parameters | None = None, **fields) -> fm.BatchedGenerationRequest:
    return fm.BatchedGenerationRequest(requests=[fm.GenerationRequest(text=t) for t in texts],
                                       params=p or params(), **fields)


def method_md(method: str, k: int | str = 3) -> tuple[tuple[str, str], ...]:
    return (("x-tandem-draft-method", method), ("x-tandem-num-speculative-tokens", str(k)))


async def stream(stack, req, metadata=()) -> list[fm.GenerationResponse]:
    return [m async for m in stack.tgis.GenerateStream(req, metadata=metadata, timeout=TIMEOUT)]


async def generate(stack, req, metadata=()) -> list[fm.GenerationResponse]:
    return list((await stack.tgis.Generate(req, metadata=metadata, timeout=TIMEOUT)).responses)


# ---- generation ----

async def test_stream_greedy_matches_tandem_v1_for_every_draft_method(stack):
    tok = stack.core.tokenizer
    for prompt in PROMPTS[:2]:
        v1 = await stack.tandem.Generate(tpb.GenerateRequest(
            prompt=prompt, sampling=tpb.SamplingParameters(max_new_tokens=32),
            speculation=tpb.SpeculationOptions(method=tpb.DRAFT_METHOD_NONE)), timeout=TIMEOUT)
        assert v1.text
        for method in ("none", "model", "ngram"):
            msgs = await stream(stack, single(prompt), method_md(method))
            first, body, last = msgs[0], msgs[1:-1], msgs[-1]
            assert first.input_token_count == len(tok(prompt).input_ids) and not first.text
            assert "".join(m.text for m in msgs) == v1.text, (prompt, method)
            assert body and all(m.stop_reason == fm.NOT_FINISHED for m in body)
            counts = [m.generated_token_count for m in body]
            assert counts == sorted(counts) and counts[0] > 0
            assert last.stop_reason in (fm.MAX_TOKENS, fm.EOS_TOKEN)
            assert last.generated_token_count == v1.usage.generated_tokens
            assert last.seed == 0                                  # greedy: no seed


async def test_batched_generate_keeps_request_order(stack):
    singles = [(await generate(stack, batch([p])))[0] for p in PROMPTS]
    assert len({r.text for r in singles}) == len(PROMPTS)          # distinct, so order is visible
    batched = await generate(stack, batch(PROMPTS), method_md("model"))
    assert [r.text for r in batched] == [r.text for r in singles]
    tok = stack.core.tokenizer
    assert [r.input_token_count for r in batched] == [len(tok(p).input_ids) for p in PROMPTS]
    assert [r.generated_token_count for r in batched] == [r.generated_token_count for r in singles]
    assert all(r.stop_reason in (fm.MAX_TOKENS, fm.EOS_TOKEN) for r in batched)


async def test_max_new_tokens_gives_max_tokens(stack):
    [r] = await generate(stack, batch([PROMPTS[0]], params(5)))
    assert (r.stop_reason, r.generated_token_count) == (fm.MAX_TOKENS, 5)


async def test_stop_sequence_cuts_and_include_keeps_it(stack):
    [full] = await generate(stack, batch([PROMPTS[0]]))
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut_at = full.text.index(stop)
    [cut] = await generate(stack, batch([PROMPTS[0]], params(stop_sequences=[stop])))
    assert (cut.text, cut.stop_reason, cut.stop_sequence) == (full.text[:cut_at], fm.STOP_SEQUENCE, stop)
    [kept] = await generate(stack, batch([PROMPTS[0]], params(stop_sequences=[stop], include_stop_sequence=True)))
    assert (kept.text, kept.stop_reason) == (full.text[:cut_at] + stop, fm.STOP_SEQUENCE)
    msgs = await stream(stack, single(PROMPTS[0], params(stop_sequences=[stop])), method_md("ngram"))
    assert "".join(m.text for m in msgs) == full.text[:cut_at]
    assert (msgs[-1].stop_reason, msgs[-1].stop_sequence) == (fm.STOP_SEQUENCE, stop)


async def test_input_text_is_echoed_first(stack):
    [plain] = await generate(stack, batch([PROMPTS[1]]))
    p = params()
    p.response.input_text = True
    [echoed] = await generate(stack, batch([PROMPTS[1]], p))
    assert echoed.text == PROMPTS[1] + plain.text
    msgs = await stream(stack, single(PROMPTS[1], p))
    assert msgs[0].text == PROMPTS[1] and "".join(m.text for m in msgs) == PROMPTS[1] + plain.text


async def test_sampling_seed_is_used_and_reported(stack):
    def sampled(seed: int | None) -> fm.Parameters:
        p = params(24)
        p.method = fm.SAMPLE
        p.sampling.top_p = 0.95              # temperature left 0: TGIS's "unset", i.e. 1.0
        if seed is not None:
            p.sampling.seed = seed
        return p

    a, b = await generate(stack, batch([PROMPTS[0]] * 2, sampled(7)), method_md("model"))
    assert a.text == b.text and a.seed == b.seed == 7
    others = await generate(stack, batch([PROMPTS[0]] * 3, sampled(None)))
    assert all(r.seed != 0 for r in others)
    assert len({r.seed for r in others}) == 3
    # Reproducible from the reported seed, and not greedy in disguise.
    [again] = await generate(stack, batch([PROMPTS[0]], sampled(others[0].seed)))
    assert again.text == others[0].text
    [greedy] = await generate(stack, batch([PROMPTS[0]], params(24)))
    seeded = await generate(stack, batch([PROMPTS[0]] * 4, sampled(None)))
    assert any(r.text != greedy.text for r in seeded)


async def test_time_limit_stops_with_text_so_far(stack):
    p = params(400, min_new_tokens=400, time_limit_millis=1)
    [r] = await generate(stack, batch([PROMPTS[0]], p))
    assert r.stop_reason == fm.TIME_LIMIT and r.generated_token_count < 400
    msgs = await stream(stack, single(PROMPTS[0], p), method_md("model"))
    assert msgs[-1].stop_reason == fm.TIME_LIMIT and msgs[-1].generated_token_count < 400
    # The abandoned generations are cancelled on the workers, not left running.
    assert await wait_until_idle(stack) == (0, 0)


async def test_accepted_neutral_values(stack):
    """Values that mean 'off' in TGIS are accepted, not refused as unsupported."""
    p = params(8)
    p.decoding.repetition_penalty = 1.0
    p.decoding.format = fm.DecodingParameters.TEXT      # unconstrained
    p.sampling.typical_p = 0.5                          # ignored under GREEDY, as in TGIS
    p.sampling.temperature = 5.0
    [r] = await generate(stack, batch([PROMPTS[0]], p, model_id=stack.core.model_name))
    [plain] = await generate(stack, batch([PROMPTS[0]], params(8)))
    assert r.text == plain.text


# ---- tokenizer and model facts ----

async def test_tokenize_matches_tokenizer(stack):
    tok = stack.core.tokenizer
    texts = ["def add(a, b):", "The quick brown fox jumps", ""]
    resp = await stack.tgis.Tokenize(fm.BatchedTokenizeRequest(
        requests=[fm.TokenizeRequest(text=t) for t in texts], return_tokens=True, return_offsets=True),
        timeout=TIMEOUT)
    for text, r in zip(texts, resp.responses, strict=True):
        enc = tok(text, return_offsets_mapping=True)
        assert r.token_count == len(enc.input_ids)
        assert list(r.tokens) == tok.convert_ids_to_tokens(enc.input_ids)
        assert [(o.start, o.end) for o in r.offsets] == [tuple(o) for o in enc.offset_mapping]
        assert "".join(text[o.start:o.end] for o in r.offsets) == text     # ASCII: offsets tile the text
    counts_only = await stack.tgis.Tokenize(fm.BatchedTokenizeRequest(
        requests=[fm.TokenizeRequest(text=texts[1])]), timeout=TIMEOUT)
    assert counts_only.responses[0].token_count == resp.responses[1].token_count
    assert not counts_only.responses[0].tokens and not counts_only.responses[0].offsets


async def test_tokenize_truncation_keeps_the_last_tokens(stack):
    tok = stack.core.tokenizer
    text = "The quick brown fox jumps"
    ids = tok(text).input_ids
    assert len(ids) > 3
    resp = await stack.tgis.Tokenize(fm.BatchedTokenizeRequest(
        requests=[fm.TokenizeRequest(text=text)], return_tokens=True, return_offsets=True,
        truncate_input_tokens=3), timeout=TIMEOUT)
    r = resp.responses[0]
    assert r.token_count == 3 and list(r.tokens) == tok.convert_ids_to_tokens(ids[-3:])
    assert r.offsets[-1].end == len(text)


async def test_model_info(stack):
    info = await stack.tgis.ModelInfo(fm.ModelInfoRequest(model_id=stack.core.model_name), timeout=TIMEOUT)
    assert info.model_kind == fm.ModelInfoResponse.DECODER_ONLY
    assert info.max_sequence_length == stack.core.max_context == 512
    assert info.max_new_tokens == stack.limits.max_new_tokens


# ---- refusals ----

def _set(path: str, value):
    """A mutator of a SingleGenerationRequest/BatchedGenerationRequest: _set('params.sampling.top_k', 3)."""
    def apply(m):
        *parents, name = path.split(".")
        for p in parents:
            m = getattr(m, p)
        if isinstance(value, dict):
            getattr(m, name).SetInParent()
            for k, v in value.items():
                setattr(getattr(m, name), k, v)
        elif isinstance(value, list):
            getattr(m, name).extend(value)
        else:
            setattr(m, name, value)
    return apply


def _sample(*more):
    def apply(m):
        m.params.method = fm.SAMPLE
        for f in more:
            f(m)
    return apply


UNSUPPORTED = [
    (_set("prefix_id", "p1"), "prefix_id is not supported by Tandem"),
    (_set("adapter_id", "lora1"), "adapter_id is not supported by Tandem"),
]
INVALID = [
    (_set("params.decoding.json_schema", "{nope"), "params.decoding.json_schema is not JSON"),
    (_set("params.decoding.regex", ""), "params.decoding.regex must not be empty"),
    (_set("params.decoding.choice", {}), "params.decoding.choice must hold at least one string"),
    (_set("params.decoding.grammar", "root ::= x"), 'grammar does not compile: EBNF parser error'),
    (_sample(_set("params.sampling.temperature", -1.0)), "temperature must be a finite number >= 0"),
    (_sample(_set("params.sampling.top_p", 1.5)), "top_p must be in (0, 1]"),
    (_set("params.stopping.max_new_tokens", 100000), "max_new_tokens must be between 1 and 2048"),
    (_set("params.stopping.min_new_tokens", 33), "min_new_tokens must be between 0 and max_new_tokens (32)"),
    (_set("params.stopping.stop_sequences", ["a"] * 7), "at most 6 stop sequences"),
    (_set("params.stopping.stop_sequences", [""]), "stop_sequences[0] is empty"),
    (_set("params.method", 7), "unknown params.method value 7"),
    (_set("model_id", "gpt-9"), "model_id 'gpt-9' is not served here; this server serves"),
    (_set("params.truncate_input_tokens", 100000), "params.truncate_input_tokens must be below the model's context"),
    (_set("params.decoding.repetition_penalty", -1.0), "params.decoding.repetition_penalty must be between 0.001 and 10"),
    (_set("params.decoding.repetition_penalty", float("nan")), "params.decoding.repetition_penalty must be a finite"),
    (_set("params.decoding.repetition_penalty", 11.0), "params.decoding.repetition_penalty must be between 0.001 and 10"),
    (_set("params.decoding.length_penalty", {"start_index": 2, "decay_factor": 0.5}),
     "params.decoding.length_penalty.decay_factor must be between 1 and 10"),
    (_set("params.decoding.length_penalty", {"start_index": 2, "decay_factor": float("inf")}),
     "params.decoding.length_penalty.decay_factor must be a finite number"),
    (_set("params.response.top_n_tokens", 11), "params.response.top_n_tokens must be between 0 and 10"),
    (_set("params.response.top_n_tokens", 1000), "params.response.top_n_tokens must be between 0 and 10"),
    (_sample(_set("params.sampling.typical_p", 1.5)), "params.sampling.typical_p must be in (0, 1]"),
    (_sample(_set("params.sampling.typical_p", float("nan"))), "params.sampling.typical_p must be a finite"),
]
BAD_METADATA = [
    ((("x-tandem-num-speculative-tokens", "four"),), "x-tandem-num-speculative-tokens must be an integer"),
    ((("x-tandem-num-speculative-tokens", "99"),), "num_speculative_tokens must be between 1 and 16"),
    ((("x-tandem-draft-method", "oracle"),), "unknown draft method 'oracle'"),
    ((("x-tandem-session-id", "bad id!"),), "session_id must be"),
]


async def _refused(call, message: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()


@pytest.mark.parametrize("rpc", ["stream", "batch"])
@pytest.mark.parametrize("mutate,message", UNSUPPORTED + INVALID)
async def test_bad_fields_get_invalid_argument(stack, rpc, mutate, message):
    req = single() if rpc == "stream" else batch([PROMPTS[0], PROMPTS[1]])
    mutate(req)
    await _refused(lambda: (stream if rpc == "stream" else generate)(stack, req), message)


@pytest.mark.parametrize("metadata,message", BAD_METADATA)
async def test_bad_metadata_gets_invalid_argument(stack, metadata, message):
    await _refused(lambda: stream(stack, single(), metadata), message)
    await _refused(lambda: generate(stack, batch([PROMPTS[0]]), metadata), message)


async def test_bad_batches_get_invalid_argument(stack):
    await _refused(lambda: generate(stack, batch([])), "requests must not be empty")
    await _refused(lambda: generate(stack, batch([PROMPTS[0], ""])), "requests[1]: prompt must not be empty")
    await _refused(lambda: generate(stack, batch([PROMPTS[0], "x" * 3000])), "requests[1]: prompt is")
    await _refused(lambda: generate(stack, batch(PROMPTS[:2]), (("x-tandem-session-id", "s1"),)),
                   "x-tandem-session-id names one generation")
    [r] = await generate(stack, batch([PROMPTS[0]], params(4)), (("x-tandem-session-id", "s1"),))
    assert r.generated_token_count == 4


async def test_wrong_model_id_on_tokenize_and_model_info(stack):
    await _refused(lambda: stack.tgis.Tokenize(fm.BatchedTokenizeRequest(
        model_id="other", requests=[fm.TokenizeRequest(text="x")]), timeout=TIMEOUT), "serves")
    await _refused(lambda: stack.tgis.ModelInfo(fm.ModelInfoRequest(model_id="other"), timeout=TIMEOUT),
                   stack.core.model_name)


async def test_still_serves_after_bad_requests(stack):
    for mutate, message in UNSUPPORTED + INVALID:
        req = single()
        mutate(req)
        await _refused(lambda: stream(stack, req), message)
    msgs = await stream(stack, single(PROMPTS[2]), method_md("model", 4))
    assert msgs[-1].stop_reason in (fm.MAX_TOKENS, fm.EOS_TOKEN)
    assert "".join(m.text for m in msgs)
    assert await wait_until_idle(stack) == (0, 0)

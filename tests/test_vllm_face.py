"""The vLLM engine face (vllm.grpc.engine.VllmEngine) over real gRPC, against the in-process stack,
with stubs generated from the pinned smg-grpc-proto package: the RPCs a router calls and those it
does not, bad input, aborts."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile

import grpc
import pytest
import torch

from gateway.request import MD_METHOD
from tests.stack import live_sessions, stack, wait_until_idle  # noqa: F401  (stack: the fixture)
from vllm_engine import common_pb2
from vllm_engine import vllm_engine_pb2 as pb

pytestmark = pytest.mark.service

PROMPT = "def add(a, b):"
TIMEOUT = 60


def request(ids: list[int], stream: bool = False, request_id: str = "", **sampling) -> pb.GenerateRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", 24)
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=pb.SamplingParams(**sampling))


def prompt_ids(stack, text: str = PROMPT) -> list[int]:
    return list(stack.core.tokenizer(text).input_ids)


async def generate(stack, req: pb.GenerateRequest, method: str = "") -> list[pb.GenerateResponse]:
    md = ((MD_METHOD, method),) if method else ()
    return [m async for m in stack.vllm.Generate(req, metadata=md, timeout=TIMEOUT)]


def target_alone(oracle, ids: list[int], n: int) -> list[int]:
    model, _ = oracle
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(ids):].tolist()


async def refused(call, *words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    for w in words:
        assert w in e.value.details()


# ---- Generate ----

async def test_greedy_equals_target_alone_streamed_and_whole_for_every_method(stack, oracle):
    ids = prompt_ids(stack)
    # min_tokens = max_tokens: the tiny model may end early; the oracle runs the same length
    want = target_alone(oracle, ids, 24)
    for method in ("none", "model", "ngram"):
        [whole] = await generate(stack, request(ids, min_tokens=24), method)
        assert list(whole.complete.output_ids) == want, method
        c = whole.complete
        assert (c.finish_reason, c.prompt_tokens, c.completion_tokens) == ("length", len(ids), 24)
        if method != "none":
            assert c.spec_draft_tokens > 0 and 0 <= c.spec_accepted_tokens <= c.spec_draft_tokens
        streamed = await generate(stack, request(ids, stream=True, min_tokens=24), method)
        chunks, last = streamed[:-1], streamed[-1]
        assert all(m.WhichOneof("response") == "chunk" for m in chunks) and last.HasField("complete")
        assert [t for m in chunks for t in m.chunk.token_ids] == want, method
        assert all(m.chunk.completion_tokens == len(m.chunk.token_ids) > 0 for m in chunks)
        assert all(m.chunk.prompt_tokens == len(ids) for m in chunks)
        # streamed, the chunks carry the tokens and the complete message none (a router adds them up)
        assert not last.complete.output_ids and last.complete.finish_reason == "length"


async def test_text_input_and_sampled_output_reproducible_by_seed(stack):
    req = pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(temperature=1.0, seed=7, max_tokens=16))
    a, b = await generate(stack, req), await generate(stack, req)
    assert list(a[0].complete.output_ids) == list(b[0].complete.output_ids)
    req.sampling_params.seed = 8
    c = await generate(stack, req)
    assert list(c[0].complete.output_ids) != list(a[0].complete.output_ids)


async def test_stop_token_ids_end_the_output_after_min_tokens(stack, oracle):
    ids = prompt_ids(stack)
    want = target_alone(oracle, ids, 24)
    stop = want[5]
    first = want.index(stop)
    [r] = await generate(stack, request(ids, stop_token_ids=[stop]), "model")
    assert list(r.complete.output_ids) == want[:first + 1]
    assert (r.complete.finish_reason, r.complete.matched_token_id) == ("stop", stop)
    # min_tokens holds the stop token back, as vLLM does
    later = [i for i, t in enumerate(want) if t == stop and i >= 6]
    [r] = await generate(stack, request(ids, stop_token_ids=[stop], min_tokens=6), "ngram")
    got = list(r.complete.output_ids)
    assert got == (want[:later[0] + 1] if later else want)


async def test_logprobs_of_each_token_and_the_prompt(stack):
    ids = prompt_ids(stack)
    [whole] = await generate(stack, request(ids, max_tokens=8, logprobs=3, prompt_logprobs=2), "model")
    c = whole.complete
    lp = c.output_logprobs
    assert list(lp.token_ids) == list(c.output_ids) and len(lp.token_logprobs) == 8
    assert all(x <= 0 for x in lp.token_logprobs)
    assert [len(t.token_ids) for t in lp.top_logprobs] == [3] * 8
    for token, value, top in zip(lp.token_ids, lp.token_logprobs, lp.top_logprobs):
        assert top.token_ids[0] == token and top.values[0] == pytest.approx(value)   # greedy: its own best
    inp = c.input_logprobs
    assert [len(t.token_ids) for t in inp.top_logprobs] == [0] + [2] * (len(ids) - 1)   # its own count, not 3
    assert list(inp.token_ids) == ids
    assert not inp.token_logprobs[0].HasField("value") and all(t.HasField("value") for t in inp.token_logprobs[1:])
    streamed = await generate(stack, request(ids, max_tokens=8, logprobs=0, stream=True))
    reports = [t for m in streamed[:-1] for t in m.chunk.output_logprobs.token_logprobs]
    assert reports == pytest.approx(list(lp.token_logprobs), abs=1e-4)
    assert not any(m.chunk.output_logprobs.top_logprobs for m in streamed[:-1])     # logprobs=0: none
    [only] = await generate(stack, request(ids, max_tokens=4, prompt_logprobs=4))      # prompt alternatives alone
    assert not only.complete.HasField("output_logprobs")
    assert [len(t.token_ids) for t in only.complete.input_logprobs.top_logprobs][1:] == [4] * (len(ids) - 1)


async def test_a_json_schema_constrains_the_output(stack):
    import json
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    [r] = await generate(stack, request(prompt_ids(stack), max_tokens=40, json_schema=json.dumps(schema)), "model")
    text = stack.core.tokenizer.decode(list(r.complete.output_ids), skip_special_tokens=True)
    if r.complete.finish_reason == "stop":
        assert isinstance(json.loads(text)["a"], int)
    else:
        assert text.startswith('{')


async def test_abort_ends_the_stream_and_frees_the_verify_session(stack):
    ids = prompt_ids(stack)
    call = stack.vllm.Generate(request(ids, stream=True, request_id="to-abort", max_tokens=2000,
                                       min_tokens=2000), timeout=TIMEOUT)
    first = await call.read()
    assert first.chunk.token_ids
    assert (await live_sessions(stack))[0] == 1
    await stack.vllm.Abort(pb.AbortRequest(request_ids=["to-abort", "not-running"]), timeout=TIMEOUT)
    rest = []
    while (m := await call.read()) is not grpc.aio.EOF:
        rest.append(m)
    assert rest and rest[-1].complete.finish_reason == "abort"
    assert await call.code() == grpc.StatusCode.OK
    assert await wait_until_idle(stack) == (0, 0)


async def test_a_client_that_goes_away_frees_the_session(stack):
    call = stack.vllm.Generate(request(prompt_ids(stack), stream=True, max_tokens=2000, min_tokens=2000),
                               timeout=TIMEOUT)
    await call.read()
    call.cancel()
    assert await wait_until_idle(stack) == (0, 0)


async def test_a_request_id_runs_once_at_a_time(stack):
    ids = prompt_ids(stack)
    call = stack.vllm.Generate(request(ids, stream=True, request_id="twice", max_tokens=2000, min_tokens=2000),
                               timeout=TIMEOUT)
    await call.read()
    await refused(generate(stack, request(ids, request_id="twice")), "request_id", "already running")
    await stack.vllm.Abort(pb.AbortRequest(request_ids=["twice"]), timeout=TIMEOUT)
    while await call.read() is not grpc.aio.EOF:
        pass
    assert await wait_until_idle(stack) == (0, 0)


@pytest.mark.parametrize("fields, words", [
    ({"n": 2}, ["sampling_params.n"]),
    ({"min_p": 0.1}, ["sampling_params.min_p"]),
    ({"logit_bias": {5: 1.0}}, ["sampling_params.logit_bias"]),
    ({"ignore_eos": True}, ["sampling_params.ignore_eos"]),
    ({"structural_tag": "{}"}, ["sampling_params.structural_tag"]),
    ({"logprobs": -1}, ["sampling_params.logprobs"]),
    ({"logprobs": 11}, ["sampling_params.logprobs"]),
    ({"prompt_logprobs": 11}, ["sampling_params.prompt_logprobs"]),
    ({"max_tokens": 0}, ["max_tokens"]),
    ({"temperature": -1.0}, ["temperature"]),
    ({"top_p": 1.5}, ["top_p"]),
    ({"repetition_penalty": 100.0}, ["sampling_params.repetition_penalty"]),
    ({"frequency_penalty": 3.0}, ["sampling_params.frequency_penalty"]),
    ({"json_schema": "{not json"}, ["sampling_params.json_schema", "not JSON"]),
    ({"regex": ""}, ["sampling_params.regex"]),
    ({"stop": [""]}, ["stop_sequences[0]"]),
    ({"truncate_prompt_tokens": -2}, ["sampling_params.truncate_prompt_tokens"]),
])
async def test_bad_sampling_params_are_refused_naming_the_field(stack, fields, words):
    await refused(generate(stack, request(prompt_ids(stack), **fields)), *words)


async def test_bad_input_is_refused_and_the_face_keeps_serving(stack):
    vocab = stack.core.tokenizer.vocab_size
    for req, words in [
        (pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=4)), ["input must be set"]),
        (request([]), ["input_ids must not be empty"]),
        (request([1, vocab + 5]), ["input_ids[1]", "outside the vocabulary"]),
        (request(list(range(3)) * 2000), ["context"]),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2]), mm_inputs=pb.MultimodalInputs()),
         ["mm_inputs"]),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2]), kv_transfer_params_json="{}"),
         ["kv_transfer_params_json"]),
    ]:
        await refused(generate(stack, req), *words)
    await refused(generate(stack, request(prompt_ids(stack)), method="bogus"), "draft method")
    [ok] = await generate(stack, request(prompt_ids(stack), max_tokens=4))
    assert len(ok.complete.output_ids) <= 4 and ok.complete.finish_reason


# ---- what a router asks of an engine ----

async def test_model_and_server_info_tell_the_truth(stack):
    info = await stack.vllm.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)
    tok = stack.core.tokenizer
    assert info.is_generation and not info.supports_vision
    assert info.max_context_length == stack.core.max_context
    assert info.vocab_size == stack.verify.engine.model.vocab_size
    assert list(info.eos_token_ids) == stack.verify.engine.model.eos_ids
    assert info.bos_token_id == (tok.bos_token_id if tok.bos_token_id is not None else -1)
    assert info.served_model_name == stack.core.model_name
    server = await stack.vllm.GetServerInfo(pb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.server_type == "vllm-grpc" and server.uptime_seconds > 0 and server.data_parallel_size == 1
    health = await stack.vllm.HealthCheck(pb.HealthCheckRequest(), timeout=TIMEOUT)
    assert health.healthy, health.message


async def test_loads_count_the_requests_running_and_waiting(stack):
    idle = (await stack.vllm.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT)).loads[0]
    assert (idle.num_running_reqs, idle.num_waiting_reqs) == (0, 0)
    calls = [stack.vllm.Generate(request(prompt_ids(stack), stream=True, max_tokens=2000, min_tokens=2000),
                                 timeout=TIMEOUT) for _ in range(2)]
    for c in calls:
        await c.read()
    busy = await stack.vllm.GetLoads(pb.GetLoadsRequest(), timeout=TIMEOUT)
    assert busy.dp_rank_count == 1 and busy.loads[0].num_running_reqs == 2
    assert busy.loads[0].num_total_reqs == 2
    for c in calls:
        c.cancel()
    await wait_until_idle(stack)
    await refused(stack.vllm.GetLoads(pb.GetLoadsRequest(dp_rank=3), timeout=TIMEOUT), "dp_rank")


async def test_the_tokenizer_streams_as_a_zip_a_router_can_load(stack, tmp_path):
    from transformers import AutoTokenizer
    chunks = [c async for c in stack.vllm.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT)]
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert not any(c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert "tokenizer_config.json" in z.namelist()
        z.extractall(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok(PROMPT).input_ids == prompt_ids(stack)


@pytest.mark.parametrize("rpc, message", [
    ("Embed", pb.EmbedRequest()), ("FlushCache", common_pb2.FlushCacheRequest()),
    ("StartProfile", common_pb2.StartProfileRequest()), ("StopProfile", common_pb2.StopProfileRequest()),
])
async def test_what_tandem_has_no_part_of_is_unimplemented_with_a_reason(stack, rpc, message):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await getattr(stack.vllm, rpc)(message, timeout=TIMEOUT)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and rpc in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stack.vllm.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT):
            pass
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_the_vllm_gauges_are_exported(stack):
    from prometheus_client import REGISTRY, generate_latest
    text = generate_latest(REGISTRY).decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f"\n{name} " in text, name
    call = stack.vllm.Generate(request(prompt_ids(stack), stream=True, max_tokens=2000, min_tokens=2000),
                               timeout=TIMEOUT)
    await call.read()
    assert REGISTRY.get_sample_value("vllm:num_requests_running") == 1
    call.cancel()
    await wait_until_idle(stack)
    await asyncio.sleep(0)
    assert REGISTRY.get_sample_value("vllm:num_requests_running") == 0

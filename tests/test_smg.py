"""The real SMG router (pinned `smg`) in front of a Tandem gateway on real SmolLM2, called as users
call it: the `openai` client against its OpenAI-compatible HTTP API. Output equals transformers'
generate on the target alone with the chat template; the request fields a client sets reach the
engine; a dropped stream frees its verify session; a bad request is the client's 4xx and costs the
streams beside it nothing."""

from __future__ import annotations

import json
import threading
import time

import grpc
import jsonschema
import openai
import pytest
import torch

from gateway.request import MD_METHOD
from tandem.launch import Stack
from tandem.router import SmgRouter
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from vllm_engine import vllm_engine_pb2 as vpb
from vllm_engine import vllm_engine_pb2_grpc as vpb_grpc

pytestmark = pytest.mark.system

PRESET = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France? Answer in one sentence.",
             "Write a Python function that returns the square of a number."]
NEW = 40


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory):
    # n-gram drafting by default (the router cannot set the method); the shipped head beside the target
    with Stack(PRESET, "none", threads=1, redis_url=redis_server.url, verify_args=["--head", "shipped"],
               gateway_args=["--default-draft-method", "ngram"],
               log_dir=str(tmp_path_factory.mktemp("logs"))) as s:
        yield s


@pytest.fixture(scope="module")
def router(stack, tmp_path_factory):
    with SmgRouter(stack.address("gateway"), log_path=str(tmp_path_factory.mktemp("smg") / "smg.log")) as r:
        yield r


@pytest.fixture(scope="module")
def client(router):
    return openai.OpenAI(base_url=router.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oracle():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.modeling import resolve
    folder = resolve(PRESET)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


def chat_ids(oracle, question: str) -> list[int]:
    _, tok = oracle
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"])


def target_alone(oracle, ids: list[int], n: int = NEW) -> list[int]:
    model, tok = oracle
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def text_of(oracle, ids: list[int]) -> str:
    return oracle[1].decode(ids, skip_special_tokens=True)


def ask(client, router, question: str, **kw):
    kw.setdefault("max_tokens", NEW)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=router.model, messages=[{"role": "user", "content": question}], **kw)


def verify_sessions(stack) -> int:
    with grpc.insecure_channel(stack.address("verify_worker")) as ch:
        return ipb_grpc.VerifyServiceStub(ch).Status(ipb.StatusRequest(), timeout=5).live_sessions


def wait_idle(stack, timeout: float = 10.0) -> int:
    end = time.monotonic() + timeout
    while (n := verify_sessions(stack)) and time.monotonic() < end:
        time.sleep(0.1)
    return n


def test_chat_greedy_equals_the_target_alone_whole_and_streamed(client, router, oracle):
    for question in QUESTIONS:
        ids = chat_ids(oracle, question)
        want = target_alone(oracle, ids)
        r = ask(client, router, question)
        assert r.choices[0].message.content == text_of(oracle, want), question
        assert r.usage.prompt_tokens == len(ids)
        ended = want[-1] == oracle[1].eos_token_id      # end-of-sequence, which Tandem does not count
        assert r.usage.completion_tokens == len(want) - ended
        assert r.choices[0].finish_reason == ("stop" if ended else "length")
        parts, finish = [], None
        for chunk in ask(client, router, question, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        assert "".join(parts) == text_of(oracle, want), question
        assert finish == r.choices[0].finish_reason


def test_speculation_on_and_off_give_the_router_s_text(stack, client, router, oracle):
    """The router's request (n-gram, the gateway's default) and the same request on the vLLM face
    with each draft method, the shipped head included: the same tokens."""
    question = QUESTIONS[1]
    ids = chat_ids(oracle, question)
    routed = ask(client, router, question).choices[0].message.content
    with grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = vpb_grpc.VllmEngineStub(ch)
        for method in ("none", "ngram", "head"):
            req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids),
                                      sampling_params=vpb.SamplingParams(temperature=0, max_tokens=NEW))
            [m] = list(stub.Generate(req, metadata=((MD_METHOD, method),), timeout=120))
            assert text_of(oracle, list(m.complete.output_ids)) == routed, method
            if method != "none":
                assert m.complete.spec_draft_tokens > 0, method


def test_max_tokens_stop_seed_and_logprobs_reach_the_engine(client, router, oracle):
    question = QUESTIONS[1]
    want = target_alone(oracle, chat_ids(oracle, question))
    r = ask(client, router, question, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == text_of(oracle, want[:5])
    full = text_of(oracle, want)
    stop = full.split()[3]
    r = ask(client, router, question, stop=[stop])
    assert r.choices[0].message.content == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    sampled = [ask(client, router, question, temperature=1.0, seed=seed, max_tokens=24).choices[0].message.content
               for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    r = ask(client, router, question, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:                    # greedy: each token is its own position's best
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_a_json_schema_response_format_validates(client, router):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    r = ask(client, router, "Name a large city and its population, as JSON.", max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_a_dropped_stream_frees_its_verify_session(stack, client, router):
    assert wait_idle(stack) == 0
    stream = ask(client, router, QUESTIONS[1], stream=True, max_tokens=1000,
                 extra_body={"min_tokens": 1000})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    assert verify_sessions(stack) == 1
    stream.close()
    assert wait_idle(stack) == 0


def test_bad_requests_are_the_client_s_4xx_and_cost_the_streams_beside_them_nothing(client, router, oracle):
    question = QUESTIONS[0]
    want = text_of(oracle, target_alone(oracle, chat_ids(oracle, question)))
    result: dict = {}

    def long_one():
        result["text"] = ask(client, router, question).choices[0].message.content

    t = threading.Thread(target=long_one)
    t.start()
    for extra, words in [({"n": 2}, "sampling_params.n"), ({"extra_body": {"min_p": 0.2}}, "min_p"),
                         ({"extra_body": {"repetition_penalty": 50.0}}, "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, router, question, **extra)
        assert e.value.status_code == 400 and words in str(e.value), e.value
    t.join(120)
    assert result["text"] == want

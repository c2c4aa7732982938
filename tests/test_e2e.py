"""The three services as real processes on real sockets, with tiny seeded models."""

import grpc
import pytest

from tandem.client import build_request
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.local import reference

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def stack(tiny_pair, redis_server):
    target, draft = tiny_pair
    # Fixed k: with two tiny models of one size a draft step costs as much as a verify pass, and the
    # controller would rightly stop speculating; these tests are about the speculative path.
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, draft_args=["--no-adaptive-k"]) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(stack):
    with grpc.insecure_channel(stack.address("gateway")) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def worker_status(stack, name):
    with grpc.insecure_channel(stack.address(name)) as ch:
        stub = (ipb_grpc.VerifyServiceStub if name == "verify_worker" else ipb_grpc.DraftServiceStub)(ch)
        return stub.Status(ipb.StatusRequest(), timeout=5)


@pytest.mark.parametrize("method,k", [("none", 0), ("model", 1), ("model", 4), ("ngram", 3), ("model", 8)])
def test_stream_equals_target_greedy(gateway, tiny_pair, tiny_models, method, k):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    model = tiny_models[0]
    for prompt in ["def add(a, b):", "for i in range(10):\n"]:
        ids = tok(prompt).input_ids
        expected = reference(model, ids, SamplingParams(max_new_tokens=32))
        msgs = list(gateway.GenerateStream(build_request(prompt, max_new_tokens=32, method=method, k=k), timeout=60))
        final = msgs[-1]
        assert final.usage.generated_tokens == len(expected)
        assert "".join(m.text for m in msgs) == tok.decode(expected, skip_special_tokens=True)
        assert final.usage.draft_method == method
        assert final.usage.prompt_tokens == len(ids)
        if method == "none":
            assert final.usage.draft_tokens == 0 and final.usage.verify_rounds == len(expected)
        else:
            assert final.usage.draft_tokens > 0


def test_unary_generate_matches_stream(gateway):
    req = build_request("class Point:", max_new_tokens=20, method="model", k=3)
    unary = gateway.Generate(req, timeout=60)
    streamed = list(gateway.GenerateStream(req, timeout=60))
    assert unary.text == "".join(m.text for m in streamed)
    assert unary.finish_reason == streamed[-1].finish_reason
    for u in (unary.usage, streamed[-1].usage):   # the ratios, from the counts they summarise (float32)
        assert u.draft_tokens > 0 and u.verify_rounds > 0, u
        assert u.acceptance_rate == pytest.approx(u.accepted_tokens / u.draft_tokens, rel=1e-6), u
        assert u.mean_accepted_length == pytest.approx(u.generated_tokens / u.verify_rounds, rel=1e-6), u


def test_sampling_same_seed_same_output(gateway):
    req = build_request("def add(a, b):", max_new_tokens=24, temperature=1.5, top_p=0.9, seed=11, method="model", k=3)
    a, b = gateway.Generate(req, timeout=60), gateway.Generate(req, timeout=60)
    assert a.text == b.text
    other = [gateway.Generate(build_request("def add(a, b):", max_new_tokens=24, temperature=1.5, top_p=0.9,
                                            seed=s, method="model", k=3), timeout=60).text for s in (12, 13, 14)]
    assert any(t != a.text for t in other)


def test_stop_sequence_cuts_text(gateway):
    full = gateway.Generate(build_request("def add(a, b):", max_new_tokens=32), timeout=60)
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = gateway.Generate(build_request("def add(a, b):", max_new_tokens=32, stop=[stop]), timeout=60)
    assert cut.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert cut.stop_sequence == stop
    assert cut.text == full.text[:full.text.index(stop)]


def test_max_new_tokens_gives_length(gateway):
    r = gateway.Generate(build_request("def add(a, b):", max_new_tokens=5, method="model", k=8), timeout=60)
    assert r.finish_reason == pb.FINISH_REASON_LENGTH and r.usage.generated_tokens == 5


def test_chat_messages(gateway):
    r = gateway.Generate(build_request("hello", chat=True, max_new_tokens=8), timeout=60)
    assert r.usage.prompt_tokens > 3 and r.usage.generated_tokens > 0


BAD = [
    (dict(prompt=""), "prompt must not be empty"),
    (dict(prompt="x" * 3000), "context"),
    (dict(max_new_tokens=100000), "max_new_tokens must be between 1 and"),
    (dict(temperature=-0.5), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_p=-0.1), "top_p must be in (0, 1]"),
    (dict(stop=["a"] * 7), "at most 6 stop sequences"),
    (dict(stop=["x" * 300]), "stop_sequences[0] is 300 characters"),
    (dict(stop=[""]), "stop_sequences[0] is empty"),
    (dict(k=99, method="model"), "num_speculative_tokens must be between 1 and 16"),
    (dict(session_id="bad id!"), "session_id must be"),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_input_gets_invalid_argument(gateway, fields, message):
    fields = {"prompt": "def f():", **fields}
    prompt = fields.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        gateway.Generate(build_request(prompt, **fields), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_unknown_enum_and_min_tokens(gateway):
    req = build_request("def f():")
    req.speculation.method = 42
    with pytest.raises(grpc.RpcError) as err:
        gateway.Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "method" in err.value.details()
    req = build_request("def f():", max_new_tokens=4)
    req.sampling.min_new_tokens = 5
    with pytest.raises(grpc.RpcError) as err:
        gateway.Generate(req, timeout=30)
    assert "min_new_tokens" in err.value.details()


def test_min_new_tokens_suppresses_eos(gateway):
    # Without min_new_tokens the tiny target's greedy output for "1" ends on EOS after 44 tokens (of
    # some ninety short prompts tried, the only one that ends before 64); with it, EOS waits.
    free = gateway.Generate(build_request("1", max_new_tokens=64), timeout=60)
    req = build_request("1", max_new_tokens=64, method="model", k=4)
    req.sampling.min_new_tokens = 56
    forced = gateway.Generate(req, timeout=60)
    assert free.finish_reason == pb.FINISH_REASON_EOS and free.usage.generated_tokens < 56, free
    assert forced.usage.generated_tokens >= 56


def test_deadline_exceeded_and_worker_keeps_serving(gateway, stack):
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.GenerateStream(build_request("def add(a, b):", max_new_tokens=2000), timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert gateway.Generate(build_request("def f():", max_new_tokens=4), timeout=30).usage.generated_tokens == 4


def test_cancel_frees_sessions_on_both_workers(gateway, stack):
    import time
    call = gateway.GenerateStream(build_request("def add(a, b):", max_new_tokens=2000, method="model", k=2,
                                                temperature=1.0, seed=1), timeout=60)
    next(call)
    assert worker_status(stack, "verify_worker").live_sessions == 1
    assert worker_status(stack, "draft_worker").live_sessions == 1
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        v, d = worker_status(stack, "verify_worker"), worker_status(stack, "draft_worker")
        if v.live_sessions == 0 and d.live_sessions == 0:
            break
        time.sleep(0.1)
    assert (v.live_sessions, d.live_sessions, v.kv_bytes) == (0, 0, 0)


def test_health_and_reflection(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for name in ("gateway", "verify_worker", "draft_worker"):
        with grpc.insecure_channel(stack.address(name)) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
    assert "tandem.v1.GenerationService" in names and "grpc.health.v1.Health" in names

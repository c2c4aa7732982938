"""Multi-turn sessions through real processes and a private Redis: the next turn continues the token
history, lands on the verify worker that kept its KV cache (only new tokens prefilled), and after
eviction is rebuilt from the history in Redis with the same output."""

import json
import time

import grpc
import pytest
import redis

from tandem.client import build_request
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.local import reference

BUDGET = 300     # KV tokens per verify worker
HEARTBEAT = 0.5


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_server):
    target, draft = tiny_pair
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, verify_workers=2,
               draft_workers=1, heartbeat_seconds=HEARTBEAT, verify_args=["--kv-budget-tokens", str(BUDGET)]) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(cluster):
    with grpc.insecure_channel(cluster.address("gateway")) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


@pytest.fixture(scope="module")
def tok(tiny_pair):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_pair[0])


def turn(gateway, text, n, session_id, method="model"):
    req = build_request(text, max_new_tokens=n, method=method, k=3, session_id=session_id)
    req.sampling.min_new_tokens = n          # a fixed length keeps the expected history simple
    return gateway.Generate(req, timeout=60)


@pytest.mark.system
def test_turns_continue_reuse_the_kv_cache_and_survive_eviction(gateway, tok, tiny_models, redis_server):
    model = tiny_models[0]
    greedy = lambda ids, n: reference(model, ids, SamplingParams(max_new_tokens=n, min_new_tokens=n))  # noqa: E731
    history = tok("def add(a, b):").input_ids
    first = turn(gateway, "def add(a, b):", 20, "conv-1")
    out = greedy(history, 20)
    assert first.text == tok.decode(out) and first.usage.cached_prompt_tokens == 0
    history += out

    new = tok("\nclass Point:", add_special_tokens=False).input_ids
    second = turn(gateway, "\nclass Point:", 16, "conv-1")
    out = greedy(history + new, 16)
    assert second.text == tok.decode(out)
    assert second.usage.prompt_tokens == len(history) + len(new)
    # The session's own verify worker (affinity) kept the cache: only the new tokens were prefilled.
    assert second.usage.cached_prompt_tokens == len(history) - 1
    history += new + out

    record = json.loads(redis.Redis.from_url(redis_server.url).get("tandem:session:conv-1"))
    assert record["tokens"] == history and record["turns"] == 2 and record["status"] == "done"

    # Two long requests at once, one per verify worker, need the budget the idle conv-1 holds.
    # Routing reads load from the workers' heartbeats: let one pass that no longer shows the turns
    # above as live, or the two may be sent to one worker.
    time.sleep(2 * HEARTBEAT)
    evictors = [build_request("for i in range(10):\n", max_new_tokens=BUDGET - 40, method="none",
                              session_id=f"evictor-{i}") for i in range(2)]
    calls = [gateway.GenerateStream(evictors[0], timeout=60)]
    next(calls[0])                                   # in flight, so the second goes to the other worker
    calls.append(gateway.GenerateStream(evictors[1], timeout=60))
    for call in calls:
        list(call)

    new = tok("\nimport numpy", add_special_tokens=False).input_ids
    third = turn(gateway, "\nimport numpy", 12, "conv-1")
    assert third.usage.cached_prompt_tokens == 0     # evicted: rebuilt from the history in Redis
    assert third.text == tok.decode(greedy(history + new, 12))


@pytest.mark.system
def test_request_that_cannot_fit_gets_resource_exhausted(gateway):
    with pytest.raises(grpc.RpcError) as err:
        gateway.Generate(build_request("def f():", max_new_tokens=BUDGET + 10, method="model", k=2), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"this worker's budget is {BUDGET}" in err.value.details()


@pytest.mark.system
def test_second_request_of_a_busy_session_is_refused(gateway, tok, tiny_models):
    req = build_request("def f():", max_new_tokens=200, method="model", k=1, session_id="busy-1")
    req.sampling.min_new_tokens = 200        # busy for a while, and a history of known length
    call = gateway.GenerateStream(req, timeout=60)
    next(call)
    with pytest.raises(grpc.RpcError) as err:
        gateway.Generate(build_request("x", max_new_tokens=4, session_id="busy-1"), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has another request in flight" in err.value.details()
    list(call)
    # Once the stream ends the session takes its next turn, which continues the first one's history:
    # the refused request left nothing behind.
    history = tok("def f():").input_ids
    history += reference(tiny_models[0], history, SamplingParams(max_new_tokens=200, min_new_tokens=200))
    new = tok("x", add_special_tokens=False).input_ids
    later = gateway.Generate(build_request("x", max_new_tokens=4, session_id="busy-1"), timeout=30)
    assert later.session_id == "busy-1" and later.usage.prompt_tokens == len(history) + len(new), later.usage
    assert later.text == tok.decode(reference(tiny_models[0], history + new, SamplingParams(max_new_tokens=4)))


@pytest.mark.system
def test_unknown_session_id_starts_a_new_session(gateway):
    r = gateway.Generate(build_request("def f():", max_new_tokens=4, session_id="fresh-1"), timeout=30)
    assert r.session_id == "fresh-1" and r.usage.cached_prompt_tokens == 0
    r = gateway.Generate(build_request("def f():", max_new_tokens=4), timeout=30)
    assert len(r.session_id) == 32           # generated, and returned so the client can continue it


@pytest.mark.unit
def test_chat_later_turn_closes_the_answer_and_skips_the_default_system_prompt(tiny_pair):
    from transformers import AutoTokenizer

    from gateway.core import GenerationCore
    from gateway.routing import StaticRouter
    from tandem.testing import CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    tok.chat_template = "{% if messages[0]['role'] != 'system' %}<|system|>be brief\n{% endif %}" + CHAT_TEMPLATE
    first, later = GenerationCore(tok, "tiny", 512, StaticRouter([], [])).encode_chat([("user", "and now?")])
    assert tok.decode(first) == "<|system|>be brief\n<|user|>and now?\n<|assistant|>"
    assert tok.decode(later) == "\n<|user|>and now?\n<|assistant|>"

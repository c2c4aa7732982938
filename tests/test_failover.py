"""Failover with real processes and a real (private) Redis: workers killed mid-stream, none at all,
drained by SIGTERM, Redis itself lost. Greedy output must equal an uninterrupted run, token for token."""

import signal
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import build_request
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.local import reference
from tests.test_observability_system import scrape

pytestmark = pytest.mark.system

PROMPT = "def add(a, b):"
N = 400          # long enough that a kill lands mid-stream; forced (min = max) so no EOS ends it early


@pytest.fixture(scope="module")
def expected(tiny_pair, tiny_models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    ids = tok(PROMPT).input_ids
    tokens = reference(tiny_models[0], ids, SamplingParams(max_new_tokens=N, min_new_tokens=N))
    return tok.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def cluster(tiny_pair, redis_server):
    target, draft = tiny_pair
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, verify_workers=2, draft_workers=2,
               heartbeat_seconds=0.5, gateway_args=["--max-migrations", "2"]) as s:
        yield s


def long_request(method="model", k=1):
    req = build_request(PROMPT, max_new_tokens=N, method=method, k=k)
    req.sampling.min_new_tokens = N
    return req


def holder(stack: Stack, kind: str) -> str:
    """The live worker of a kind that holds a session now."""
    stub_cls = ipb_grpc.VerifyServiceStub if kind == "verify_worker" else ipb_grpc.DraftServiceStub
    for name, proc in stack.procs.items():
        if name.split("-")[0] == kind and proc.poll() is None:
            with grpc.insecure_channel(stack.address(name)) as ch:
                if stub_cls(ch).Status(ipb.StatusRequest(), timeout=5).live_sessions:
                    return name
    raise AssertionError(f"no {kind} holds a session")


def replace_dead(stack: Stack) -> None:
    for name, proc in list(stack.procs.items()):
        if proc.poll() is not None:
            del stack.procs[name]
            stack.add_worker(name.split("-")[0])


def stream_with(stack: Stack, req, during) -> tuple[str, object]:
    """Streams req; calls during() after the first message; returns (text, final message)."""
    with grpc.insecure_channel(stack.address("gateway")) as ch:
        call = pb_grpc.GenerationServiceStub(ch).GenerateStream(req, timeout=120)
        first = next(call)
        during()
        msgs = [first, *call]
    return "".join(m.text for m in msgs), msgs[-1]


@pytest.mark.parametrize("kind", ["verify_worker", "draft_worker"])
def test_kill_9_mid_stream_moves_the_session_and_loses_nothing(cluster, expected, kind):
    victim = []

    def kill():
        victim.append(holder(cluster, kind))
        cluster.kill(victim[0], signal.SIGKILL)

    try:
        text, final = stream_with(cluster, long_request(), kill)
        assert cluster.procs[victim[0]].wait(10) == -signal.SIGKILL
        assert final.usage.migrations == 1
        assert final.usage.generated_tokens == N
        assert text == expected                      # nothing missing, nothing repeated
        assert final.usage.draft_method == "model"   # the other draft worker took over, or kept going
    finally:
        replace_dead(cluster)


def prefilled(stack: Stack) -> float:
    """Prompt positions the live verify workers computed (not copied or kept), all together."""
    key = ("tandem_verify_prefill_tokens_total", (("source", "computed"),))
    seen = [scrape(stack, name).get(key) for name, proc in stack.procs.items()
            if name.startswith("verify_worker") and proc.poll() is None]
    assert any(v is not None for v in seen), "no verify worker exports the prefill counter"   # a rename fails here
    return sum(v or 0.0 for v in seen)


def test_a_lost_draft_worker_continues_on_the_verify_workers_cache(cluster, expected):
    """The verify worker keeps the session's KV when the stream from its draft worker breaks, and
    the gateway moves the session to another draft worker on the same verify worker: the
    continuation prefills nothing, its prompt and delivered tokens being that cache already."""
    victim, before = [], []

    def kill():
        before.append(prefilled(cluster))
        victim.append(holder(cluster, "draft_worker"))
        cluster.kill(victim[0], signal.SIGKILL)

    try:
        text, final = stream_with(cluster, long_request(), kill)
        assert final.usage.migrations == 1 and final.usage.draft_method == "model"
        assert text == expected
        assert prefilled(cluster) - before[0] == 0
    finally:
        replace_dead(cluster)


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=1.5, frequency_penalty=1.0)


def test_migrated_stream_keeps_penalties_and_logprobs(cluster, tiny_pair, tiny_models):
    """After a move the tokens already delivered are prompt to the new worker, but still output to
    the presence and frequency penalties (WorkerSampling.resumed): the result equals an
    uninterrupted run with the same penalties, and every token keeps its logprob."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    params = SamplingParams(max_new_tokens=N, min_new_tokens=N, **PENALTIES)
    want = reference(tiny_models[0], tok(PROMPT).input_ids, params)
    assert want != reference(tiny_models[0], tok(PROMPT).input_ids,
                             SamplingParams(max_new_tokens=N, min_new_tokens=N, repetition_penalty=1.3))
    req = long_request()
    for name, value in PENALTIES.items():
        setattr(req.sampling, name, value)
    req.logprobs.logprobs = True
    victim = []

    def kill():
        victim.append(holder(cluster, "verify_worker"))
        cluster.kill(victim[0], signal.SIGKILL)

    try:
        with grpc.insecure_channel(cluster.address("gateway")) as ch:
            call = pb_grpc.GenerationServiceStub(ch).GenerateStream(req, timeout=120)
            msgs = [next(call)]
            while sum(m.token_count for m in msgs) < 40:     # enough output before the move to matter
                msgs.append(next(call))
            kill()
            msgs += list(call)
        assert msgs[-1].usage.migrations == 1
        assert [t.token_id for m in msgs for t in m.tokens] == want
        assert all(t.rank >= 1 and t.logprob <= 0 for m in msgs for t in m.tokens)
    finally:
        replace_dead(cluster)


def health_after_sigterm(address: str):
    """The first health status other than SERVING, polled right after SIGTERM (None if refused)."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
            except grpc.RpcError:
                return None
            if status != health_pb2.HealthCheckResponse.SERVING:
                return status
            time.sleep(0.02)
    return None


def test_sigterm_drains_in_flight_stream_and_deregisters(cluster, expected, redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    seen = {}

    def term():
        name = seen["name"] = holder(cluster, "verify_worker")
        address = cluster.address(name)
        assert r.exists(f"tandem:worker:verify:{address}")
        cluster.kill(name, signal.SIGTERM)
        seen["health"] = health_after_sigterm(address)
        deadline = time.monotonic() + 2
        while r.exists(f"tandem:worker:verify:{address}") and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["deregistered"] = not r.exists(f"tandem:worker:verify:{address}")

    try:
        text, final = stream_with(cluster, long_request(), term)
        assert seen["health"] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert seen["deregistered"]
        assert final.usage.migrations == 0           # drained where it was, not moved
        assert text == expected
        assert cluster.procs[seen["name"]].wait(15) == 0
    finally:
        r.close()
        replace_dead(cluster)


def test_stream_outliving_the_drain_moves_instead_of_failing(tiny_pair, expected):
    """A verify worker stopped with a grace shorter than the stream cuts it at the end of its drain:
    the gateway moves the session, as for a crash, and the output is still the uninterrupted one."""
    from tandem.cluster.redis_conn import RedisServer
    target, draft = tiny_pair
    own_redis = RedisServer().start()
    try:
        with Stack(str(target), str(draft), threads=1, redis_url=own_redis.url, verify_workers=2,
                   heartbeat_seconds=0.5, verify_args=["--grace-seconds", "0.1"]) as s:
            victim = []

            def term():
                victim.append(holder(s, "verify_worker"))
                s.kill(victim[0], signal.SIGTERM)

            text, final = stream_with(s, long_request(), term)
            assert s.procs[victim[0]].wait(10) == 0
            assert final.usage.migrations == 1 and text == expected
    finally:
        own_redis.stop()


def test_migrated_guided_stream_replays_its_guide(cluster, tiny_pair):
    """A guided stream moved after kill -9 of its verify worker: both new workers rebuild the guide's
    state by replaying the delivered tokens, so the output equals the target alone under the guide
    (transformers' generate with xgrammar's own processor). Without the replay the new matcher
    would start over and force the leading "=" a second time."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    hf = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32)
    regex = "=[a-z ]+"
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[tok.eos_token_id])
    processor = xgr.contrib.hf.LogitsProcessor(xgr.GrammarCompiler(info).compile_regex(regex))
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False, logits_processor=[processor])
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    req = long_request()
    req.guided.regex = regex

    def kill():
        cluster.kill(holder(cluster, "verify_worker"), signal.SIGKILL)

    try:
        with grpc.insecure_channel(cluster.address("gateway")) as ch:
            call = pb_grpc.GenerationServiceStub(ch).GenerateStream(req, timeout=120)
            msgs = [next(call)]
            while sum(m.token_count for m in msgs) < 40:
                msgs.append(next(call))
            kill()
            msgs += list(call)
        text = "".join(m.text for m in msgs)
        assert msgs[-1].usage.migrations == 1
        assert text == want and text.count("=") == 1
    finally:
        replace_dead(cluster)


@pytest.fixture(scope="module")
def head_cluster(tiny_pair, redis_server, tmp_path_factory):
    from tandem.testing import build_random_head
    target, draft = tiny_pair
    head = build_random_head(tmp_path_factory.mktemp("head") / "head.safetensors", target)
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, verify_workers=2, draft_workers=1,
               heartbeat_seconds=0.5, verify_args=["--head", str(head)],
               gateway_args=["--max-migrations", "2"]) as s:
        yield s


def test_kill_9_of_a_head_worker_moves_the_session_to_another_head(head_cluster, expected):
    """The head drafts inside the verify worker: when it dies, the gateway resumes the request on
    another verify worker with a head, which rebuilds the head's context from the prompt and the
    delivered tokens."""
    victim = []

    def kill():
        victim.append(holder(head_cluster, "verify_worker"))
        head_cluster.kill(victim[0], signal.SIGKILL)

    try:
        text, final = stream_with(head_cluster, long_request(method="head"), kill)
        assert head_cluster.procs[victim[0]].wait(10) == -signal.SIGKILL
        assert final.usage.migrations == 1
        assert final.usage.draft_method == "head" and final.usage.draft_tokens > 0
        assert text == expected
    finally:
        replace_dead(head_cluster)

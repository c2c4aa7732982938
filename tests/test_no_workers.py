"""Failover when there is nothing to fail over to: no verify worker, no draft worker, only dead
registrations, or no Redis. Real processes, a private Redis of this module's own."""

import json
import time

import grpc
import pytest
import redis

from tandem.client import build_request
from tandem.cluster.redis_conn import free_port
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.local import reference
from tests.test_failover import PROMPT, N, long_request, stream_with

pytestmark = pytest.mark.system


def test_migrations_are_bounded(tiny_pair, redis_server):
    """Verify workers that are registered but dead: the request hops at most --max-migrations times."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.flushdb()
    target, draft = tiny_pair
    dead = [f"127.0.0.1:{free_port()}" for _ in range(4)]
    for address in dead:
        r.set(f"tandem:worker:verify:{address}", json.dumps({"address": address, "pool": "verify",
                                                             "model": str(target)}), ex=120)
        r.sadd("tandem:workers:verify", address)
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, verify_workers=0, draft_workers=0,
               gateway_args=["--max-migrations", "2"]) as s, grpc.insecure_channel(s.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(build_request(PROMPT, max_new_tokens=8, method="none"), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "gave up after 2 migrations" in err.value.details()
        assert "127.0.0.1" not in err.value.details()          # workers' addresses stay in the log
    r.flushdb()
    r.close()


def test_no_verify_worker_then_no_draft_worker_then_redis_lost(tiny_pair, tiny_models, redis_server):
    target, draft = tiny_pair
    redis.Redis.from_url(redis_server.url).flushdb()
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, verify_workers=0, draft_workers=0,
               heartbeat_seconds=0.5) as s, grpc.insecure_channel(s.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(build_request(PROMPT, max_new_tokens=8), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no verify worker for model" in err.value.details()
        assert time.monotonic() - start < 5                     # an answer, not a hang to the deadline

        s.add_worker("verify_worker")                           # verify only: served, slower, correct
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(target)
        ref = reference(tiny_models[0], tok(PROMPT).input_ids, SamplingParams(max_new_tokens=24))
        r = stub.Generate(build_request(PROMPT, max_new_tokens=24, method="model", k=3), timeout=60)
        assert r.text == tok.decode(ref, skip_special_tokens=True)
        assert r.usage.draft_method == "none" and r.usage.draft_tokens == 0

        # Redis goes away mid-stream: the stream finishes; new requests get a clear UNAVAILABLE.
        def lose_redis():
            redis_server.stop()
        text, final = stream_with(s, long_request(method="none"), lose_redis)
        assert final.usage.generated_tokens == N
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(build_request(PROMPT, max_new_tokens=8), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "Redis at" in err.value.details()

        redis_server.start()                                    # same port, empty: workers re-announce
        deadline = time.monotonic() + 10
        while True:
            try:
                r = stub.Generate(build_request(PROMPT, max_new_tokens=24, method="none"), timeout=30)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e.details()
                time.sleep(0.2)
        assert r.text == tok.decode(ref, skip_special_tokens=True)


@pytest.mark.parametrize("service,flags,message", [
    ("gateway", ["--redis-url", "http://127.0.0.1:6379"],
     "--redis-url / REDIS_URL: Redis URL 'http://127.0.0.1:6379' must start with redis://"),
    ("draft_worker", ["--heartbeat-seconds", "0"], "--heartbeat-seconds must be > 0, got 0.0"),
    ("verify_worker", ["--kv-budget-tokens", "-5"], "--kv-budget-tokens must be > 0"),
    ("verify_worker", ["--head", "shipped", "--head-sha256", "8aa637"],
     "--head-sha256 must be 64 hex digits and needs --head, got '8aa637'"),
    ("verify_worker", ["--head-tree-leaves", "-1"], "--head-tree-leaves must be 0 or more, got -1"),
])
def test_bad_flags_stop_start_up_with_a_clear_message(service, flags, message, tiny_pair):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", service, "--model", str(tiny_pair[0]), "--port", "0", "--insecure",
                           *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr

"""The verify worker as a real process at int8 (the precision whose kernels differ most from
float32's): it starts (calibration included) and speculation's greedy output through the gateway
equals its plain decoding, on real SmolLM2-135M-Instruct (its int4 copy as the draft where the CPU
runs int4, else its int8 copy). The start-up
path at every precision is tested in process (tests/test_invariance.py). A dtype the device cannot
run stops the worker at start with the reason."""

import json
import subprocess
import sys

import grpc
import pytest
import redis

from tandem.client import build_request
from tandem.engine import rowgemm
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system

PRESET = "smollm2-135m-instruct"
PROMPT = "Write a Python function that checks whether a string is a palindrome."


@pytest.mark.parametrize("dtype", ["int8"])
def test_a_target_at_dtype_starts_and_speculation_equals_plain(dtype, redis_server):
    draft_dtype = "int4" if rowgemm.int4() else "int8"
    with Stack(PRESET, PRESET, threads=1, redis_url=redis_server.url, verify_args=["--dtype", dtype],
               draft_args=["--dtype", draft_dtype]) as stack, \
            grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        out = {m: stub.Generate(build_request(PROMPT, chat=True, max_new_tokens=40, method=m), timeout=120)
               for m in ("none", "model", "ngram")}
        client = redis.Redis.from_url(redis_server.url)
        entry = json.loads(client.get(f"tandem:worker:verify:{stack.address('verify_worker')}"))
    # what the gateway keeps a moved request to: the worker's dtype and numerics
    assert entry["dtype"] == dtype and entry["numerics"].startswith(f"{dtype}, linear "), entry
    assert out["none"].usage.generated_tokens > 10
    assert out["model"].usage.draft_tokens > 0
    for method in ("model", "ngram"):
        assert out[method].text == out["none"].text, (dtype, method)


def test_a_dtype_the_device_cannot_run_stops_the_worker_with_the_reason():
    run = subprocess.run([sys.executable, "-m", "verify_worker", "--insecure", "--dtype", "float16"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--dtype: dtype float16 runs on a GPU only" in run.stderr, run.stderr[-500:]

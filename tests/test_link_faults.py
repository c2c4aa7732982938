"""Faults of the link between the pools, with real processes: the draft worker dials its verify worker
through a userspace proxy (tandem.linkproxy) that stalls, resets, partitions and delays that link
while the gateway still reaches both workers. Output must equal transformers' generate on the target
alone, nothing may be lost, and speculation must come back once the link does."""

import asyncio
import signal
import time

import grpc
import pytest
import torch

from tandem.client import build_request
from tandem.cluster.redis_conn import connect
from tandem.cluster.registry import DRAFT, Registry
from tandem.launch import Stack
from tandem.linkproxy import ProxyThread
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.test_observability_system import moved, scrape

pytestmark = pytest.mark.system

PROMPT = "def add(a, b):"
N = 400          # long enough that a fault lands mid-stream; forced (min = max) so no EOS ends it early
SHORT = 24


def generate_hf(folder, n: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def expected(tiny_pair):
    return {n: generate_hf(tiny_pair[0], n) for n in (N, SHORT)}


@pytest.fixture(scope="module")
def linked(tiny_pair, redis_server):
    """(stack, proxy): one verify worker, one draft worker that reaches it only through the proxy, and
    two gateways (gateway-2 for requests from a gateway that has not met a fault itself)."""
    target, draft = tiny_pair
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, draft_workers=0,
               heartbeat_seconds=0.5, gateway_args=["--link-retry-seconds", "1"]) as stack:
        with ProxyThread(stack.address("verify_worker")) as proxy:
            stack.add_worker("draft_worker", extra_args=[
                "--verify-route", f"{stack.address('verify_worker')}={proxy.address}", "--link-timeout", "0.5", "--pipeline"])
            stack.add_gateway(["--link-retry-seconds", "1"])
            yield stack, proxy


def links_down(stack: Stack) -> list[str]:
    """The verify workers the draft worker's registry entry lists its link to as down."""
    async def read() -> list[str]:
        client = connect(stack.redis_url)
        try:
            return {w.address: w.links_down for w in await Registry(client).workers(DRAFT)}[stack.address("draft_worker")]
        finally:
            await client.aclose()
    return asyncio.run(read())


def until(condition, within: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within
        time.sleep(0.1)
    return time.monotonic() - start


def request(n: int):
    req = build_request(PROMPT, max_new_tokens=n, method="model", k=1)
    req.sampling.min_new_tokens = n
    return req


def stream(stack: Stack, n: int, during=lambda: None, gateway: str = "gateway"):
    """Streams a request; calls during() after the first message; (text, final message, seconds)."""
    start = time.monotonic()
    with grpc.insecure_channel(stack.address(gateway)) as ch:
        call = pb_grpc.GenerationServiceStub(ch).GenerateStream(request(n), timeout=120)
        first = next(call)
        during()
        msgs = [first, *call]
    return "".join(m.text for m in msgs), msgs[-1], time.monotonic() - start


def speculating_again(stack: Stack, expected: dict, within: float) -> float:
    """Seconds until a short request speculates again (each one's output checked)."""
    start = time.monotonic()
    while True:
        text, final, _ = stream(stack, SHORT)
        assert text == expected[SHORT]
        if final.usage.draft_method == "model" and final.usage.draft_tokens > 0:
            return time.monotonic() - start
        assert time.monotonic() - start < within, "speculation did not resume"
        time.sleep(0.2)


def test_a_stalled_link_falls_back_to_plain_decoding_and_speculation_resumes(linked, expected):
    stack, proxy = linked
    before = {n: scrape(stack, n) for n in ("gateway", "draft_worker")}
    try:
        text, final, _ = stream(stack, N, lambda: proxy.stall(True))
        assert text == expected[N]                            # nothing lost, nothing repeated
        assert final.usage.generated_tokens == N
        assert final.usage.migrations == 0                    # the same verify worker kept the session
    finally:
        proxy.stall(False)
    after = {n: scrape(stack, n) for n in ("gateway", "draft_worker")}
    assert moved(before["gateway"], after["gateway"], "tandem_link_fallbacks_total", event="fallback") >= 1
    assert moved(before["draft_worker"], after["draft_worker"], "tandem_draft_link_events_total", event="lost") >= 1
    assert speculating_again(stack, expected, within=10) < 10


def test_a_reset_mid_round_loses_nothing(linked, expected):
    stack, proxy = linked
    resets = proxy.counters.resets
    before = scrape(stack, "gateway")
    text, final, _ = stream(stack, N, proxy.reset)
    assert proxy.counters.resets > resets
    assert text == expected[N] and final.usage.generated_tokens == N and final.usage.migrations == 0
    assert moved(before, scrape(stack, "gateway"), "tandem_link_fallbacks_total", event="fallback") >= 1
    assert speculating_again(stack, expected, within=10) < 10


def test_a_ten_second_partition_costs_speculation_not_output(linked, expected):
    """Besides the output: the draft worker lists the link as down in its registry entry, so that
    a gateway that has not met the fault itself decodes plainly without asking the draft worker,
    and takes the link off once its probe gets an answer through it again."""
    stack, proxy = linked
    verify = stack.address("verify_worker")
    proxy.stall(True)
    try:
        ends = time.monotonic() + 10
        served = 0
        while time.monotonic() < ends:
            text, final, seconds = stream(stack, SHORT)
            assert text == expected[SHORT]
            assert seconds < 8, f"a request waited {seconds:.1f}s for the partitioned draft pool"
            served += 1
        assert served >= 2
        assert links_down(stack) == [verify]
        before = scrape(stack, "draft_worker")
        text, final, _ = stream(stack, SHORT, gateway="gateway-2")
        assert text == expected[SHORT] and final.usage.draft_method == "none"
        assert moved(before, scrape(stack, "draft_worker"), "tandem_draft_link_events_total", event="unreachable") == 0
    finally:
        proxy.stall(False)
    restored = scrape(stack, "draft_worker")
    until(lambda: links_down(stack) == [], within=10)
    assert moved(restored, scrape(stack, "draft_worker"), "tandem_draft_link_events_total", event="restored") == 1
    assert speculating_again(stack, expected, within=10) < 10


def test_latency_spikes_are_ridden_out_without_a_fallback(linked, expected):
    stack, proxy = linked
    speculating_again(stack, expected, within=10)          # the earlier tests' faults are over
    before = scrape(stack, "gateway")
    text, final, _ = stream(stack, N, lambda: proxy.spike(20, 3))
    assert text == expected[N] and final.usage.draft_method == "model" and final.usage.draft_tokens > 0
    assert moved(before, scrape(stack, "gateway"), "tandem_link_fallbacks_total", event="fallback") == 0


def test_a_frozen_draft_worker_is_noticed_and_the_request_decodes_on(linked, expected):
    """SIGSTOP: the draft worker's process stops answering, its sockets stay open. The gateway's
    keepalive closes its connection within seconds; the request goes on at its verify worker."""
    stack, _ = linked
    try:
        text, final, seconds = stream(stack, N, lambda: stack.kill("draft_worker", signal.SIGSTOP))
        assert text == expected[N] and final.usage.generated_tokens == N
        assert seconds < 30
    finally:
        stack.kill("draft_worker", signal.SIGCONT)

"""Traces, metrics and logs in process: the stack with an in-memory span exporter (service), and the
telemetry and metrics pieces alone (unit). With the services as real processes:
tests/test_observability_system.py."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from tandem.client import build_request
from tandem.service import metrics, telemetry
from tandem.service.logs import REQUEST_ID_KEY
from tests.stack import start_stack, stop_stack, wait_until_idle

PROMPT = "def add(a, b):\n    return a + b\nfor i in range(10):\n"
REQUEST_SPAN_PREFIX = "text_completion "


def request(max_new_tokens: int = 12, k: int = 3, method: str = "model"):
    return build_request(PROMPT, max_new_tokens=max_new_tokens, method=method, k=k, seed=7)


def ids(span) -> tuple[str, str, str]:
    """(trace id, span id, parent span id) as hex, for SDK spans."""
    parent = format(span.parent.span_id, "016x") if span.parent else ""
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x"), parent


def check_one_connected_trace(spans: list[dict], usage) -> dict[str, dict]:
    """spans: {name, trace_id, span_id, parent, attrs, service}, of one request and maybe other
    RPCs. Asserts the request's trace holds every span of the request, linked gateway -> draft ->
    verify; returns that trace's spans by name (the last one of each name)."""
    [req] = [s for s in spans if s["name"].startswith(REQUEST_SPAN_PREFIX)]
    work = {"prefill", "speculation round", "/tandem.v1.VerifyService/Verify", "/tandem.v1.DraftService/Generate"}
    assert {s["trace_id"] for s in spans if s["name"] in work} == {req["trace_id"]}
    spans = [s for s in spans if s["trace_id"] == req["trace_id"]]
    by_id = {s["span_id"]: s for s in spans}
    # A gRPC call has a client and a server span of the same name: key them by name and kind.
    by_name = {(s["name"] if s["kind"] in ("internal", "server") else s["name"] + " client"): s for s in spans}

    def ancestors(span) -> list[str]:
        chain = []
        while span["parent"] in by_id:
            span = by_id[span["parent"]]
            chain.append(span["name"] + (" client" if span["kind"] == "client" else ""))
        return chain

    a = req["attrs"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.request.seed"] == 7
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_k"] == 0
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.generated_tokens
    assert list(a["gen_ai.response.finish_reasons"]) == ["length"]
    assert a["gen_ai.conversation.id"]
    assert "gen_ai.input.messages" not in a           # prompt text only when --trace-content
    assert ancestors(req)[0].endswith("GenerationService/GenerateStream")

    verify_server = by_name["/tandem.v1.VerifyService/Verify"]
    chain = ancestors(verify_server)
    # verify server <- verify client (draft) <- draft server <- draft client (gateway) <- request span
    assert chain[:4] == ["/tandem.v1.VerifyService/Verify client", "/tandem.v1.DraftService/Generate",
                         "/tandem.v1.DraftService/Generate client", req["name"]], chain
    prefill = by_name["prefill"]
    assert prefill["parent"] == verify_server["span_id"]
    assert prefill["attrs"]["tandem.prompt_tokens"] == usage.prompt_tokens

    rounds = [s for s in spans if s["name"] == "speculation round"]
    assert len(rounds) == usage.verify_rounds
    assert sum(r["attrs"]["tandem.spec.k"] for r in rounds) == usage.draft_tokens
    assert sum(r["attrs"]["tandem.spec.accepted"] for r in rounds) == usage.accepted_tokens
    draft_server = by_id[rounds[0]["parent"]]
    assert draft_server["name"] == "/tandem.v1.DraftService/Generate"
    for r in rounds:
        ra = r["attrs"]
        assert ra["tandem.batch_size"] == 1
        assert 0 < ra["tandem.verify_seconds"] < ra["tandem.round_trip_seconds"]
    return by_name


# ---- in process ----

@pytest.fixture
async def traced_stack(tiny_pair):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    exporter = InMemorySpanExporter()
    telemetry.setup("tandem-test", exporter=exporter)
    target, draft = tiny_pair
    try:
        s = await start_stack(target, draft)
    except BaseException:
        telemetry.shutdown()
        raise
    yield s, exporter
    await stop_stack(s)
    telemetry.shutdown()


def counter(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.service
async def test_in_process_one_trace_and_metrics_move(traced_stack):
    stack, exporter = traced_stack
    before = {n: counter(n, method="model") for n in ("tandem_spec_decode_num_draft_tokens_total",
                                                       "tandem_spec_decode_num_accepted_tokens_total",
                                                       "tandem_spec_decode_num_drafts_total")}
    ok_before = counter("tandem_requests_total", api="tandem", outcome="length", code="OK")
    call = stack.tandem.GenerateStream(request(), timeout=60, metadata=((REQUEST_ID_KEY, "req-in-process"),))
    assert dict(await call.initial_metadata())[REQUEST_ID_KEY] == "req-in-process"
    msgs = [m async for m in call]
    usage = msgs[-1].usage
    assert usage.draft_tokens > 0 and usage.generated_tokens == 12
    await wait_until_idle(stack)

    spans = []
    for _ in range(50):      # the workers' server spans end just after the client has its answer
        spans = [{"name": s.name, "attrs": dict(s.attributes), "kind": s.kind.name.lower(),
                  **dict(zip(("trace_id", "span_id", "parent"), ids(s)))}
                 for s in exporter.get_finished_spans()
                 if not s.name.startswith(("/grpc.", "/tandem.v1.VerifyService/Status"))]
        if len([s for s in spans if s["name"] == "speculation round"]) == usage.verify_rounds \
                and {"/tandem.v1.DraftService/Generate", "/tandem.v1.VerifyService/Verify"} <= \
                {s["name"] for s in spans if s["kind"] == "client"}:
            break
        await asyncio.sleep(0.05)
    check_one_connected_trace(spans, usage)
    request_span = next(s for s in spans if s["name"].startswith(REQUEST_SPAN_PREFIX))
    assert request_span["attrs"]["tandem.request_id"] == "req-in-process"

    # vLLM-style counters move by exactly this request's usage.
    assert counter("tandem_spec_decode_num_draft_tokens_total", method="model") - \
        before["tandem_spec_decode_num_draft_tokens_total"] == usage.draft_tokens
    assert counter("tandem_spec_decode_num_accepted_tokens_total", method="model") - \
        before["tandem_spec_decode_num_accepted_tokens_total"] == usage.accepted_tokens
    assert counter("tandem_requests_total", api="tandem", outcome="length", code="OK") == ok_before + 1


@pytest.mark.service
async def test_prompt_and_completion_text_only_when_enabled(traced_stack):
    stack, exporter = traced_stack
    stack.core.trace_content = True           # what --trace-content sets
    try:
        r = await stack.tandem.Generate(request(max_new_tokens=4), timeout=60)
    finally:
        stack.core.trace_content = False
    [span] = [s for s in exporter.get_finished_spans() if s.name.startswith(REQUEST_SPAN_PREFIX)
              and s.attributes["gen_ai.conversation.id"] == r.session_id]
    assert json.loads(span.attributes["gen_ai.input.messages"])[0]["parts"][0]["content"] == PROMPT
    assert json.loads(span.attributes["gen_ai.output.messages"])[0]["parts"][0]["content"] == r.text


@pytest.mark.service
async def test_refused_request_is_counted_with_its_status(traced_stack):
    stack, _ = traced_stack
    before = counter("tandem_requests_total", api="tandem", outcome="error", code="INVALID_ARGUMENT")
    req = request()
    req.sampling.top_p = 2.0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.tandem.Generate(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counter("tandem_requests_total", api="tandem", outcome="error", code="INVALID_ARGUMENT") == before + 1


@pytest.mark.unit
def test_tracing_off_installs_nothing():
    assert not telemetry.enabled()
    assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []
    with telemetry.span("x") as s:
        assert s is None


@pytest.mark.unit
def test_inference_queue_depth_gauge():
    from tandem.engine.thread import InferenceThread
    gate = threading.Event()

    metrics.register("draft_worker")

    async def main():
        thread = InferenceThread("draft", metrics.queue_gauge("draft"))
        base = REGISTRY.get_sample_value("tandem_draft_queue_depth")
        jobs = [asyncio.ensure_future(thread.run(gate.wait)) for _ in range(3)]
        await asyncio.sleep(0.1)
        depth = REGISTRY.get_sample_value("tandem_draft_queue_depth") - base    # one runs, two wait
        gate.set()
        await asyncio.gather(*jobs)
        thread.shutdown()
        return depth, REGISTRY.get_sample_value("tandem_draft_queue_depth") - base

    assert asyncio.run(main()) == (2, 0)


@pytest.mark.unit
def test_inference_busy_seconds_counter():
    """The seconds the thread's jobs ran, their wait in the queue excluded, a job that raised included;
    exported at 0 before the first job."""
    import time

    from tandem.engine.thread import InferenceThread
    metrics.register("draft_worker", "verify_worker")      # both export it: registering twice is fine

    def busy() -> float | None:
        return REGISTRY.get_sample_value("tandem_inference_busy_seconds_total", {"thread": "test-busy"})

    def fail():
        time.sleep(0.02)
        raise ValueError("bad job")

    async def main():
        thread = InferenceThread("test-busy")
        first = busy()
        # three at once: two wait while one runs, and their waits must not count
        timed = await asyncio.gather(*(thread.run_timed(time.sleep, 0.03) for _ in range(3)))
        ran, after_three = sum(seconds for _, seconds in timed), busy()
        start = time.perf_counter()
        with pytest.raises(ValueError):
            await thread.run(fail)
        failed = time.perf_counter() - start
        thread.shutdown()
        return first, ran, after_three, failed

    first, ran, after_three, failed = asyncio.run(main())
    assert first == 0
    assert ran >= 0.09 and after_three == pytest.approx(ran)
    assert 0.02 <= busy() - after_three <= failed


@pytest.mark.unit
def test_grafana_dashboard_reads_only_metrics_that_exist():
    import re
    from pathlib import Path
    dash = json.loads((Path(__file__).parent.parent / "deploy/grafana/tandem-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|total|count|sum)$", "", m) for e in exprs for m in re.findall(r"tandem_[a-z0-9_]+", e)}
    served = {obj._name for obj in vars(metrics).values() if isinstance(obj, (Counter, Gauge, Histogram))}
    assert used and used <= served, used - served
    # The autoscalers read these two by name (deploy/k8s/components/autoscaling, deploy/helm).
    assert {"tandem_verify_queue_depth", "tandem_draft_queue_depth"} <= used

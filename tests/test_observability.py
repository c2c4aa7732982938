"""Traces, metrics and logs: in process with an in-memory span exporter, and with all three services
as real processes exporting OTLP to a receiver inside this test, scraped over HTTP."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import build_request
from tandem.launch import Stack
from tandem.service import metrics, telemetry
from tandem.service.logs import REQUEST_ID_KEY
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.stack import start_stack, stop_stack, wait_until_idle

PROMPT = "def add(a, b):\n    return a + b\nfor i in range(10):\n"
GATEWAY, DRAFT, VERIFY = "gateway", "draft_worker", "verify_worker"
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
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )
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


async def test_refused_request_is_counted_with_its_status(traced_stack):
    stack, _ = traced_stack
    before = counter("tandem_requests_total", api="tandem", outcome="error", code="INVALID_ARGUMENT")
    req = request()
    req.sampling.top_p = 2.0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stack.tandem.Generate(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counter("tandem_requests_total", api="tandem", outcome="error", code="INVALID_ARGUMENT") == before + 1


def test_tracing_off_installs_nothing():
    assert not telemetry.enabled()
    assert telemetry.server_interceptors() == [] and telemetry.client_interceptors() == []
    with telemetry.span("x") as s:
        assert s is None


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


# ---- real processes ----

class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span it is sent, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({"name": s.name, "service": service, "kind": _KINDS.get(s.kind, ""),
                                           "trace_id": s.trace_id.hex(),
                                           "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                           "attrs": {a.key: _value(a.value) for a in s.attributes}})
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


_KINDS = {1: "internal", 2: "server", 3: "client"}


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sink = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(None)


@pytest.fixture(scope="module")
def process_stack(tiny_pair, redis_server, receiver, tmp_path_factory):
    _, port = receiver
    target, draft = tiny_pair
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    logs = tmp_path_factory.mktemp("logs")
    # A fixed k, so every request drafts (tiny models' measured costs can make adaptive k choose 0).
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, extra_env=env,
               log_dir=str(logs), draft_args=["--no-adaptive-k"]) as s:
        yield s, logs


def scrape(stack: Stack, name: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from one process's /metrics."""
    with urllib.request.urlopen(stack.metrics_url(name), timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_processes_one_trace_metrics_and_request_id_in_logs(process_stack, receiver):
    stack, log_dir = process_stack
    sink, _ = receiver
    before = {n: scrape(stack, n) for n in (GATEWAY, DRAFT, VERIFY)}
    with grpc.insecure_channel(stack.address(GATEWAY)) as ch:
        call = pb_grpc.GenerationServiceStub(ch).GenerateStream(
            request(), timeout=120, metadata=((REQUEST_ID_KEY, "req-processes-1"),))
        assert dict(call.initial_metadata())[REQUEST_ID_KEY] == "req-processes-1"
        msgs = list(call)
        usage, usage_session = msgs[-1].usage, msgs[-1].session_id
    counts = [m.token_count for m in msgs if m.token_count]
    assert usage.draft_tokens > 0

    trace_id, spans = "", []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with sink.lock:
            req_spans = [s for s in sink.spans if s["name"].startswith(REQUEST_SPAN_PREFIX)
                         and s["attrs"].get("tandem.request_id") == "req-processes-1"]
        if req_spans:
            trace_id = req_spans[0]["trace_id"]
            spans = sink.trace(trace_id)
            if len([s for s in spans if s["name"] == "speculation round"]) == usage.verify_rounds \
                    and {s["service"] for s in spans} == {GATEWAY, DRAFT, VERIFY} \
                    and any(s["name"] == "/tandem.v1.DraftService/Generate" and s["service"] == DRAFT
                            for s in spans):
                break
        time.sleep(0.1)
    assert trace_id, "no request span reached the receiver"
    by_name = check_one_connected_trace(spans, usage)
    assert by_name["prefill"]["service"] == VERIFY
    assert by_name["speculation round"]["service"] == DRAFT

    after = {n: scrape(stack, n) for n in (GATEWAY, DRAFT, VERIFY)}
    d_before, d_after = before[DRAFT], after[DRAFT]
    assert moved(d_before, d_after, "tandem_spec_decode_num_draft_tokens_total", method="model") == usage.draft_tokens
    assert moved(d_before, d_after, "tandem_spec_decode_num_accepted_tokens_total",
                 method="model") == usage.accepted_tokens
    per_pos = sum(moved(d_before, d_after, "tandem_spec_decode_num_accepted_tokens_per_pos_total",
                        method="model", position=str(p)) for p in range(3))
    assert per_pos == usage.accepted_tokens
    assert moved(d_before, d_after, "tandem_spec_decode_num_drafts_total", method="model") == \
        sum(1 for s in spans if s["name"] == "speculation round" and s["attrs"]["tandem.spec.k"] > 0)
    assert moved(d_before, d_after, "tandem_draft_verify_round_trip_seconds_count") == usage.verify_rounds
    g_before, g_after = before[GATEWAY], after[GATEWAY]
    assert moved(g_before, g_after, "tandem_requests_total", api="tandem", outcome="length", code="OK") == 1
    assert moved(g_before, g_after, "tandem_time_to_first_token_seconds_count") == 1
    # Tokens after the first chunk; those sharing the first token's chunk arrive with it.
    assert moved(g_before, g_after, "tandem_inter_token_latency_seconds_count") == sum(counts[1:]) > 0
    assert moved(g_before, g_after, "tandem_generation_tokens_total") == usage.generated_tokens
    v_before, v_after = before[VERIFY], after[VERIFY]
    assert moved(v_before, v_after, "tandem_verify_forward_seconds_count") == usage.verify_rounds
    assert moved(v_before, v_after, "tandem_verify_prefill_tokens_total", source="computed") == \
        usage.prompt_tokens - 1
    assert ("tandem_verify_queue_depth", ()) in v_after and ("tandem_draft_queue_depth", ()) in d_after
    # Each process serves its own service's metrics only.
    assert not any(name.startswith(("tandem_verify_", "tandem_spec_")) for name, _ in g_after)
    assert not any(name.startswith(("tandem_draft_", "tandem_spec_", "tandem_requests")) for name, _ in v_after)
    assert v_after[("tandem_verify_kv_cache_used_tokens", ())] > 0      # the finished session is kept idle

    # Every service logged this request as JSON lines carrying its request id and trace id.
    for name in (GATEWAY, DRAFT, VERIFY):
        lines = [json.loads(line) for line in (log_dir / f"{name}.log").read_text().splitlines()
                 if line.startswith("{")]
        assert lines, f"{name} wrote no JSON log lines"
        assert all({"time", "level", "service", "message"} <= set(line) for line in lines)
        mine = [line for line in lines if line.get("request_id") == "req-processes-1"]
        assert mine, f"{name} logged nothing with the request id"
        assert mine[-1]["trace_id"] == trace_id and mine[-1]["session_id"] == usage_session
    assert mine[-1]["generated_tokens"] == usage.generated_tokens


def test_processes_request_id_made_up_when_absent(process_stack):
    stack, _ = process_stack
    with grpc.insecure_channel(stack.address(GATEWAY)) as ch:
        call = pb_grpc.GenerationServiceStub(ch).GenerateStream(request(max_new_tokens=2), timeout=120)
        rid = dict(call.initial_metadata())[REQUEST_ID_KEY]
        list(call)
    assert len(rid) == 32


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

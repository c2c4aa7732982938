"""Traces, metrics and logs with all three services as real processes: they export OTLP to a
receiver inside this test and are scraped over HTTP (in process: tests/test_observability.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tandem.launch import Stack
from tandem.service.logs import REQUEST_ID_KEY
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.test_observability import REQUEST_SPAN_PREFIX, check_one_connected_trace, request

pytestmark = pytest.mark.system

GATEWAY, DRAFT, VERIFY = "gateway", "draft_worker", "verify_worker"


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

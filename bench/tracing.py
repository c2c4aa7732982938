"""What tracing costs: the same requests through two identical stacks, one with tracing off
(OTEL_TRACES_EXPORTER unset), one exporting every span over OTLP/gRPC to a sink in this
process, and one with everything installed but sampled out; interleaved after a warm-up. Also the cost of one per-round span
against one span event, which decided how verify rounds are recorded.

`python -m bench.tracing` (tiny seeded models: verify rounds of a few ms, the worst case for a
per-round cost) or `--target smollm2-135m-instruct --draft none --method ngram`.
Prints a table and writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from bench.report import machine, write_json
from tandem.client import build_request
from tandem.cluster.redis_conn import RedisServer
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

PROMPT = "def add(a, b):\n    return a + b\nfor i in range(10):\n"


class SpanSink:
    """An OTLP trace receiver that only counts what it is sent (a collector's cheapest case)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        sink = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink.lock:
                    sink.spans += n
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans, self.lock = 0, threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def one_request(stub, method: str, k: int, n: int) -> dict:
    req = build_request(PROMPT, max_new_tokens=n, method=method, k=k, seed=1)
    req.sampling.min_new_tokens = n          # every request does the same work
    start = time.perf_counter()
    usage = [m for m in stub.GenerateStream(req, timeout=600)][-1].usage
    wall = time.perf_counter() - start
    return {"tokens": usage.generated_tokens, "rounds": usage.verify_rounds, "seconds": wall,
            "tok_s": usage.generated_tokens / wall}


def span_vs_event(n: int = 20000) -> dict:
    """Microseconds per verify-round record: a child span with the round's attributes (batch
    processor, exporter that drops) against one event with the same attributes."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=n + 10))
    tracer = provider.get_tracer("bench")
    attrs = {"tandem.spec.k": 4, "tandem.spec.accepted": 3, "tandem.spec.bonus_token": 17,
             "tandem.batch_size": 1, "tandem.verify_seconds": 0.004, "tandem.round_trip_seconds": 0.005}
    out = {}
    with tracer.start_as_current_span("parent") as parent:
        t = time.perf_counter()
        for _ in range(n):
            with tracer.start_as_current_span("speculation round") as s:
                s.set_attributes(attrs)
        out["span_us"] = 1e6 * (time.perf_counter() - t) / n
        t = time.perf_counter()
        for _ in range(n):
            parent.add_event("speculation round", attrs)
        out["event_us"] = 1e6 * (time.perf_counter() - t) / n
    provider.shutdown()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.tracing", description=__doc__)
    p.add_argument("--target", default="", help="model spec; empty = tiny seeded models")
    p.add_argument("--draft", default="", help="model spec or none; empty = tiny seeded draft")
    p.add_argument("--method", default="model", help="model, ngram or none")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds; each runs --requests per config")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default="bench/results/tracing.json")
    a = p.parse_args(argv)

    target, draft = a.target, a.draft
    if not target:
        from tandem.testing import build_tiny_pair
        t, d = build_tiny_pair(Path(tempfile.mkdtemp(prefix="tandem-bench-")))
        target, draft = str(t), draft or str(d)
    sink = SpanSink()
    on_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
              "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink.port}", "OTEL_TRACES_SAMPLER": "always_on"}
    # "sampled_out": everything installed, but the sampler records nothing (a low sampling ratio's
    # common case): what the interceptors and span calls cost without recording or exporting.
    envs = {"off": {"OTEL_TRACES_EXPORTER": "none"}, "on": on_env,
            "sampled_out": {**on_env, "OTEL_TRACES_SAMPLER": "always_off"}}
    # A private Redis server per stack: stacks sharing one would discover each other's workers.
    redis = {name: RedisServer().start() for name in envs}
    # The services' logs go to files, out of the table's way.
    # A fixed k: the same rounds in every configuration, whatever the costs measured at start-up.
    stacks = {name: Stack(target, draft, threads=a.threads, redis_url=redis[name].url, extra_env=env,
                          log_dir=tempfile.mkdtemp(prefix=f"tandem-bench-{name}-"), draft_args=["--no-adaptive-k"])
              for name, env in envs.items()}
    runs: dict[str, list[dict]] = {name: [] for name in envs}
    channels = {}
    try:
        for s in stacks.values():
            s.start()
        channels = {n: grpc.insecure_channel(s.address("gateway")) for n, s in stacks.items()}
        stubs = {n: pb_grpc.GenerationServiceStub(ch) for n, ch in channels.items()}
        for name in stubs:                                           # warm-up
            for _ in range(2):
                one_request(stubs[name], a.method, a.k, a.max_new_tokens)
        spans_before = sink.spans
        names = list(envs)
        for r in range(a.rounds):
            for name in names[r % 3:] + names[:r % 3]:          # each config leads in turn
                for _ in range(a.requests):
                    runs[name].append(one_request(stubs[name], a.method, a.k, a.max_new_tokens))
            print(f"  round {r + 1}/{a.rounds}: " + ", ".join(f"{n} {runs[n][-1]['tok_s']:.1f} tok/s" for n in names),
                  flush=True)
        time.sleep(6)           # the batch span processor exports every 5 s
        spans = sink.spans - spans_before
    finally:
        for ch in channels.values():
            ch.close()
        for s in stacks.values():
            s.stop()
        for r in redis.values():
            r.stop()
        sink.server.stop(None)

    summary = {}
    for name, rs in runs.items():
        rates = [x["tok_s"] for x in rs]
        summary[name] = {"tok_s_median": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
                         "tok_s_total": sum(x["tokens"] for x in rs) / sum(x["seconds"] for x in rs),
                         "requests": len(rs), "rounds_per_request": statistics.median(x["rounds"] for x in rs)}
    for name in summary:
        summary[name]["cost_vs_off_median"] = 1 - summary[name]["tok_s_median"] / summary["off"]["tok_s_median"]
        summary[name]["cost_vs_off_all"] = 1 - summary[name]["tok_s_total"] / summary["off"]["tok_s_total"]
    cost = summary["on"]["cost_vs_off_median"]
    micro = span_vs_event()
    result = {"machine": machine(),
              "setup": {"target": a.target or "tiny seeded", "draft": a.draft or "tiny seeded", "method": a.method,
                        "k": a.k, "max_new_tokens": a.max_new_tokens, "threads_per_process": a.threads,
                        "rounds": a.rounds, "requests_per_round": a.requests, "exporter": "otlp/grpc to a local sink"},
              "summary": summary, "throughput_cost": cost, "spans_per_request": spans / max(1, len(runs["on"])),
              "span_vs_event_us": micro, "runs": runs}
    print("\n| tracing | tokens/s median (min-max) | cost vs off (median) | tokens/s all requests | cost vs off (all) | requests |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, s in summary.items():
        print(f"| {name} | {s['tok_s_median']:.1f} ({s['tok_s_min']:.1f}-{s['tok_s_max']:.1f}) | "
              f"{s['cost_vs_off_median']:.1%} | {s['tok_s_total']:.1f} | {s['cost_vs_off_all']:.1%} | {s['requests']} |")
    print(f"\nthroughput cost of tracing (median): {cost:.1%}; spans exported per request: "
          f"{result['spans_per_request']:.1f}; verify rounds per request: {summary['on']['rounds_per_request']:.0f}")
    print(f"one round as a span: {micro['span_us']:.1f} us; as an event: {micro['event_us']:.1f} us")
    write_json(a.out, result)


if __name__ == "__main__":
    main()

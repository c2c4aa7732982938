"""make bench-load: the service under N concurrent streams, with speculation on and off.

Longer than 300 lines because one run (levels, modes, host probes, the table and the JSON) is read
as one script.

For each model pair the service is started (tandem.launch.Stack); for each level N, N streams on one
grpc.aio channel call tandem.v1 GenerateStream, each sending chat code-editing requests back to back:
until --seconds have passed (a request already running is finished), or, with --requests-per-stream,
that many each. Whatever is still running after --max-level-seconds is cancelled and counted as cut,
so a level ends in bounded time however slowly the service serves many streams. Every level runs
in two modes: "spec" (the pair's draft method; the draft worker's controller decides each round
whether to speculate) and "off" (none), --repeats times each, interleaved (spec off off spec ...):
a shared host's speed drifts by tens of percent within minutes, and a ratio of two runs minutes
apart measured the drift as much as speculation. Each figure is over all runs of its mode; the
JSON also has each run's tokens/s (run_tok_s) and the host's speed just before it (host_gflops:
one thread's float32 matmul rate, measured while the service is idle). Every prompt is sent once
before the first level, so that neither mode pays a prompt's first prefill. Before each run the
previous run's requests have left the gateway and the verify worker (up to 30 s of waiting).

    python -m bench.load                  # SmolLM2-135M + n-gram at 1/4/16/64, Qwen 1.5B + 0.5B at 1/4
    python -m bench.load --quick --skip-qwen

Figures per level and mode:
- tokens/s: tokens streamed (by any request, also ones failed or cut midway) during the first
  --seconds of each run, when every one of the N streams has a request running, / (--seconds x runs): the
  throughput at N concurrent streams. After that window the streams only finish what they run, so
  fewer and fewer are busy; tokens over the whole level's wall time (first request sent to last
  stream done, or the cut) are in the JSON as level_tok_s. With --requests-per-stream there is no
  window and tokens/s is the whole level's. Its ratio spec/off and to the pair's 1-stream level.
- spec/off by run pair: the ratio of each spec run to the off run next to it in time (spec off,
  off spec, ...); the spread shows how far the host's drift moves the pooled ratio.
- TTFT: request sent to the first message that carries tokens (token_count > 0). A request cut
  before its first token has none, so TTFT percentiles of a cut level are low; see cut_waiting.
- ITL, per token: each later token-carrying message gives gap-since-the-previous-one / its
  token_count, counted token_count times (a speculative chunk of 5 tokens 50 ms after the last
  counts 5 x 10 ms), so percentiles are over tokens; the gateway's ITL histogram counts the same way.
- acceptance: accepted / drafted tokens from the final usage of completed requests (cut ones
  have no usage).
- prompt cached: the share of completed requests' prompt tokens whose KV the verify worker copied
  from another session with the same prompt prefix (or kept from a turn) instead of computing it.
  The streams cycle through the same few prompts, so after the first requests most of each prompt
  is shared; with all-different prompts this is near 0 and prefill costs more.
- errors by gRPC status code. A failed request is not retried: its stream pauses --error-pause
  seconds and goes on with its next request (in --requests-per-stream mode it counts as one).
- sampled every --sample-seconds: peaks of the verify worker's gauges (KV used and budget, inference
  queue, an admission queue if a gauge named *admission* exists, else null; all tandem_* gauges of
  it and of the gateway go to the JSON) and of its VmRSS. KV used counts idle sessions kept for a
  next turn too, so it fills towards the budget as requests accumulate over the levels.
- sessions / pass: the verify worker's mean sessions per batched forward pass over the level (from
  its tandem_verify_batch_sessions histogram; null without one).
- verify busy: the share of the level's wall time the verify worker spent in forward passes (its
  tandem_verify_busy_seconds counter).
- CPU cores: CPU seconds per wall second of this client and of each service process over the level
  (from /proc), to see where a shared machine's cores go.
Prints a markdown table and writes JSON (default bench/results/load.json).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.report import fill_defaults, machine, write_json
from tandem.client import build_request
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

_ADD = '''def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)'''
_CART = '''class Cart:
    def __init__(self):
        self.items = []

    def add(self, name, price, qty):
        self.items.append((name, price, qty))

    def total(self):
        x = 0
        for name, price, qty in self.items:
            x += price * qty
        return x'''
_REPORT = '''def report(users):
    for u in users:
        print("%s is %d years old" % (u["name"], u["age"]))
        if u["age"] > 65:
            print("%s is retired" % u["name"])'''
_FIND = '''def find(xs, target):
    x = 0
    for i in range(len(xs)):
        if xs[i] == target:
            x = x + 1
    return x'''

PROMPTS = [
    f"Add type hints to this function. Reply with the complete code only.\n\n```python\n{_ADD}\n```",
    f"Rename the variable x to count in this code. Reply with the complete code only.\n\n```python\n{_FIND}\n```",
    f"Add a docstring to each method of this class. Reply with the complete code only.\n\n```python\n{_CART}\n```",
    (f"Rewrite this function to use f-strings instead of % formatting. Reply with the complete code only."
     f"\n\n```python\n{_REPORT}\n```"),
    (f"Replace the print calls with logging.info calls in this code. Reply with the complete code only."
     f"\n\n```python\n{_REPORT}\n```"),
    f"Rename the method total to subtotal in this class. Reply with the complete code only.\n\n```python\n{_CART}\n```",
]

# name: target, draft (a model spec or "none"), the draft method of mode "spec"
PAIRS = {"smollm": ("smollm2-135m-instruct", "none", "ngram"),
         "qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "model")}
FULL = {"levels": "1,4,16,64", "qwen_levels": "1,4", "seconds": 15.0, "max_level_seconds": 60.0,
        "max_new_tokens": 64, "repeats": 2}
QUICK = {"levels": "1,4", "qwen_levels": "1", "seconds": 4.0, "max_level_seconds": 20.0, "max_new_tokens": 32,
         "repeats": 1}


@dataclass
class Record:
    """One level and mode: what the streams saw."""
    tokens: int = 0                 # streamed, by any request
    window_end: float | None = None  # perf_counter time until which every stream keeps a request running
    window_tokens: int = 0          # of `tokens`, those that arrived before window_end
    generated: int = 0              # usage.generated_tokens of completed requests
    completed: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    prompt_tokens: int = 0          # of completed requests
    cached_prompt_tokens: int = 0   # of those, copied or kept rather than computed
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    cut: int = 0                    # cancelled at --max-level-seconds
    cut_waiting: int = 0            # of those, cut before their first token
    errors: Counter = field(default_factory=Counter)
    error_details: dict[str, str] = field(default_factory=dict)   # the first message per code
    methods: Counter = field(default_factory=Counter)       # usage.draft_method: what actually ran


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile, None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]


async def one_request(stub, req, rec: Record, timeout: float, error_pause: float) -> None:
    call = stub.GenerateStream(req, timeout=timeout)
    start = prev = time.perf_counter()
    first = True
    try:
        async for msg in call:
            if msg.token_count:
                now = time.perf_counter()
                if first:
                    rec.ttft.append(now - start)
                    first = False
                else:
                    rec.itl.extend([(now - prev) / msg.token_count] * msg.token_count)
                prev = now
                rec.tokens += msg.token_count
                if rec.window_end is not None and now <= rec.window_end:
                    rec.window_tokens += msg.token_count
            if msg.HasField("usage"):
                u = msg.usage
                rec.completed += 1
                rec.generated += u.generated_tokens
                rec.drafted += u.draft_tokens
                rec.accepted += u.accepted_tokens
                rec.rounds += u.verify_rounds
                rec.prompt_tokens += u.prompt_tokens
                rec.cached_prompt_tokens += u.cached_prompt_tokens
                rec.methods[u.draft_method] += 1
    except grpc.aio.AioRpcError as e:
        rec.errors[e.code().name] += 1
        rec.error_details.setdefault(e.code().name, e.details())
        await asyncio.sleep(error_pause)
    except asyncio.CancelledError:
        rec.cut += 1
        rec.cut_waiting += first
        call.cancel()
        raise


async def stream(stub, reqs: list, offset: int, rec: Record, end: float, a) -> None:
    """Requests back to back: --requests-per-stream of them, or until the monotonic clock passes `end`."""
    n, count = 0, a.requests_per_stream
    while (n < count) if count else (time.monotonic() < end):
        await one_request(stub, reqs[(offset + n) % len(reqs)], rec, a.timeout, a.error_pause)
        n += 1


BUSY = "tandem_verify_busy_seconds_total"


def scrape(url: str, kind: str = "gauge") -> dict[str, float]:
    """A /metrics page's tandem_* samples of one kind by name, of a histogram only _sum and _count
    ({} if unreachable)."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            if fam.type == kind and fam.name.startswith("tandem_") for s in fam.samples
            if kind != "histogram" or s.name.endswith(("_sum", "_count"))}


def mean_over(delta: dict, histogram: str) -> float | None:
    """A histogram's mean over what it observed between two scrapes, given the difference of their samples
    (None: nothing, or no such metric)."""
    n = delta.get(histogram + "_count", 0)
    return delta[histogram + "_sum"] / n if n else None


def cpu_seconds(pid: int | None = None) -> float | None:
    """User + system CPU seconds of a process so far (this one by default; None if it is gone)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_all(stack: Stack) -> dict[str, float | None]:
    return {"client": cpu_seconds(), **{name: cpu_seconds(p.pid) for name, p in stack.procs.items()}}


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def sample(stack: Stack, stop: asyncio.Event, every: float) -> dict:
    """Peaks of the verify worker's and gateway's gauges and of the verify worker's RSS until `stop`."""
    peaks: dict[str, float] = {}
    rss = None
    while True:
        for name in ("verify_worker", "gateway"):
            for k, v in (await asyncio.to_thread(scrape, stack.metrics_url(name))).items():
                peaks[k] = max(v, peaks.get(k, v))
        r = rss_mib(stack.procs["verify_worker"].pid)
        if r is not None:
            rss = max(r, rss or r)
        if stop.is_set():
            return {"gauges": peaks, "verify_rss_mib": rss}
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def settle(stack: Stack, timeout: float = 30) -> None:
    """Waits until no request is running on the gateway or the verify worker (or `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = {**await asyncio.to_thread(scrape, stack.metrics_url("gateway")),
             **await asyncio.to_thread(scrape, stack.metrics_url("verify_worker"))}
        if not any(g.get(k) for k in ("tandem_gateway_running_requests", "tandem_verify_running_sessions",
                                      "tandem_verify_queue_depth")):
            return
        await asyncio.sleep(0.2)


def host_gflops(seconds: float = 0.25) -> float:
    """The machine's speed now: one thread's float32 matmul GFLOP/s over `seconds` (a shared host's speed
    drifts; a level's runs are interleaved for that, and this shows by how much)."""
    a, threads = torch.ones(256, 256), torch.get_num_threads()
    torch.set_num_threads(1)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        n += 1
    elapsed = time.perf_counter() - start
    torch.set_num_threads(threads)
    return n * 2 * 256 ** 3 / elapsed / 1e9


async def run(stack: Stack, method: str, streams: int, a, rec: Record) -> dict:
    """One run of a level in one mode: adds what the streams saw to `rec`, returns what was measured
    around them (wall time, its window's tokens, CPU and busy seconds, histogram sums, gauge peaks,
    host speed)."""
    reqs = [build_request(p, chat=True, max_new_tokens=a.max_new_tokens, method=method, k=a.k)
            for p in PROMPTS[:a.prompts]]
    stop = asyncio.Event()
    await settle(stack)
    speed, window_before = host_gflops(), rec.window_tokens
    verify_metrics = stack.metrics_url("verify_worker")
    before = await asyncio.to_thread(scrape, verify_metrics, "histogram")
    busy_before = (await asyncio.to_thread(scrape, verify_metrics, "counter")).get(BUSY)
    cpu_before = cpu_all(stack)
    async with grpc.aio.insecure_channel(stack.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        sampler = asyncio.create_task(sample(stack, stop, a.sample_seconds))
        start = time.perf_counter()
        end = time.monotonic() + a.seconds
        rec.window_end = None if a.requests_per_stream else start + a.seconds
        tasks = [asyncio.create_task(stream(stub, reqs, i, rec, end, a))
                 for i in range(streams)]
        done, cut = await asyncio.wait(tasks, timeout=a.max_level_seconds or None)
        for t in cut:
            t.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
        wall = time.perf_counter() - start
        for t in done:
            t.result()                  # a bug in this file, not a gRPC status: raise it
        stop.set()
        peaks = await sampler
    cpu_after = cpu_all(stack)
    after = await asyncio.to_thread(scrape, verify_metrics, "histogram")
    busy_after = (await asyncio.to_thread(scrape, verify_metrics, "counter")).get(BUSY)
    return {"wall": wall, "host_gflops": speed, "window_tokens": rec.window_tokens - window_before,
            "cpu": {name: cpu_after[name] - b for name, b in cpu_before.items()
                    if b is not None and cpu_after.get(name) is not None},
            "busy": busy_after - busy_before if None not in (busy_before, busy_after) else None,
            "hist": {k: v - before.get(k, 0) for k, v in after.items()},
            "gauges": peaks["gauges"], "rss": peaks["verify_rss_mib"]}


def figures(streams: int, method: str, rec: Record, runs: list[dict], a) -> dict:
    """A level's figures in one mode over its runs: totals over total time, peaks over all runs."""
    wall = sum(r["wall"] for r in runs)
    g: dict[str, float] = {}
    for r in runs:
        for k, v in r["gauges"].items():
            g[k] = max(v, g.get(k, v))
    hist = Counter()
    for r in runs:
        hist.update(r["hist"])
    busy = [r["busy"] for r in runs]
    rss = [r["rss"] for r in runs if r["rss"] is not None]
    admission = [v for k, v in g.items() if "admission" in k]
    # All N streams are busy until each run's window ends; after it, fewer and fewer as they finish.
    window = a.seconds * len(runs) if not a.requests_per_stream and a.seconds > 0 else None
    return {"streams": streams, "method": method, "runs": len(runs), "wall_s": wall, "tokens": rec.tokens,
            "tok_s": rec.window_tokens / window if window else rec.tokens / wall,
            "level_tok_s": rec.tokens / wall, "window_tokens": rec.window_tokens,
            "run_tok_s": [r["window_tokens"] / a.seconds if window else None for r in runs],
            "host_gflops": [r["host_gflops"] for r in runs],
            "completed": rec.completed, "cut": rec.cut, "cut_waiting": rec.cut_waiting, "errors": dict(rec.errors),
            "error_details": rec.error_details, "draft_methods": dict(rec.methods),
            "ttft_p50_s": pct(rec.ttft, 50), "ttft_p99_s": pct(rec.ttft, 99),
            "itl_p50_s": pct(rec.itl, 50), "itl_p99_s": pct(rec.itl, 99),
            "acceptance": rec.accepted / rec.drafted if rec.drafted else None,
            "tokens_per_round": rec.generated / rec.rounds if rec.rounds else None,
            "cached_prompt_share": rec.cached_prompt_tokens / rec.prompt_tokens if rec.prompt_tokens else None,
            "kv_used_peak": g.get("tandem_verify_kv_cache_used_tokens"),
            "kv_budget": g.get("tandem_verify_kv_cache_budget_tokens"),
            "verify_queue_peak": g.get("tandem_verify_queue_depth"),
            "admission_queue_peak": max(admission) if admission else None,
            "gateway_running_peak": g.get("tandem_gateway_running_requests"),
            "batch_sessions_mean": mean_over(hist, "tandem_verify_batch_sessions"),
            "batch_tokens_mean": mean_over(hist, "tandem_verify_batch_tokens"),
            "verify_busy_share": sum(busy) / wall if None not in busy else None,
            "cpu_share": {name: sum(r["cpu"].get(name, 0) for r in runs) / wall for name in runs[0]["cpu"]},
            "verify_rss_peak_mib": max(rss) if rss else None, "gauge_peaks": g}


async def level(stack: Stack, modes: list[tuple[str, str]], streams: int, a) -> dict[str, dict]:
    """A level in every mode, --repeats times, the order of the modes reversed every other time (spec
    off off spec ...), so that a machine whose speed drifts favours neither; figures by mode."""
    recs = {mode: Record() for mode, _ in modes}
    runs: dict[str, list[dict]] = {mode: [] for mode, _ in modes}
    for i in range(a.repeats):
        for mode, method in (modes if i % 2 == 0 else modes[::-1]):
            runs[mode].append(await run(stack, method, streams, a, recs[mode]))
    return {mode: figures(streams, method, recs[mode], runs[mode], a) for mode, method in modes}


async def run_levels(stack: Stack, pair: str, spec: str, levels: list[int], a) -> list[dict]:
    warm = argparse.Namespace(**{**vars(a), "seconds": 0, "requests_per_stream": 1, "max_level_seconds": 0,
                                 "max_new_tokens": 8, "repeats": 1})
    # Every prompt once, all at once, before any level: a prompt's first prefill (of the target, and
    # of a draft model) would otherwise fall on whichever mode meets it first, mostly "spec".
    await level(stack, [("spec", spec)], a.prompts, warm)
    await level(stack, [("off", "none")], 1, warm)
    rows = []
    for n in levels:
        for mode, row in (await level(stack, [("spec", spec), ("off", "none")], n, a)).items():
            row = {"pair": pair, "mode": mode, **row}
            rows.append(row)
            print(f"  {n:3d} streams {mode:4s} {row['tok_s']:7.2f} tok/s "
                  f"(runs {', '.join(fmt(t) for t in row['run_tok_s'])}; host GFLOP/s "
                  f"{', '.join(f'{x:.0f}' for x in row['host_gflops'])}), {row['completed']} done, "
                  f"{row['cut']} cut, errors {row['errors'] or 0}, {row['wall_s']:.0f} s", flush=True)
            for code, details in row["error_details"].items():
                print(f"      {code}: {details}", flush=True)
    return rows


def run_pair(pair: str, levels: list[int], a) -> list[dict]:
    """Starts the pair's service, runs every level in both modes, adds the ratios."""
    target, draft, spec = PAIRS[pair]
    draft_args = ["--dtype", a.draft_dtype] if draft != "none" else []
    verify_args = ["--kv-budget-tokens", str(a.kv_budget_tokens)] if a.kv_budget_tokens is not None else []
    print(f"\n{pair}: starting {target} + draft {draft} ...", flush=True)
    with Stack(target, draft, threads=a.threads, draft_args=draft_args, verify_args=verify_args) as stack:
        rows = asyncio.run(run_levels(stack, pair, spec, levels, a))
    by = {(r["streams"], r["mode"]): r for r in rows}
    for r in rows:
        r.update(target=target, draft=draft)
        off, one = by.get((r["streams"], "off")), by.get((1, r["mode"]))
        r["spec_over_off"] = r["tok_s"] / off["tok_s"] if r["mode"] == "spec" and off and off["tok_s"] else None
        # run i of each mode ran next to the other's run i: a slow spell of the host hits both of a pair
        r["spec_over_off_by_run"] = ([s / o if s is not None and o else None
                                      for s, o in zip(r["run_tok_s"], off["run_tok_s"])]
                                     if r["mode"] == "spec" and off else None)
        r["over_1_stream"] = r["tok_s"] / one["tok_s"] if one and one["tok_s"] else None
    return rows


def fmt(x, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


PROCESSES = ("client", "gateway", "draft_worker", "verify_worker")


def table(rows: list[dict]) -> str:
    columns = ["pair", "streams", "mode", "tokens/s", "spec/off", "spec/off by run pair", "vs 1 stream",
               "done", "cut", "errors",
               "TTFT p50 / p99 s", "ITL p50 / p99 ms", "acceptance", "prompt cached", "sessions / pass",
               "verify busy", "CPU cores: client / gateway / draft / verify",
               "KV peak / budget", "verify queue peak", "admission peak", "verify RSS MiB"]
    out = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        out.append(f"| {r['pair']} | {r['streams']} | {r['mode']} ({r['method']}) | {r['tok_s']:.2f} "
                   f"| {fmt(r['spec_over_off'], suffix='x')} "
                   f"| {', '.join(fmt(x, suffix='x') for x in r['spec_over_off_by_run'] or []) or '-'} "
                   f"| {fmt(r['over_1_stream'], suffix='x')} "
                   f"| {r['completed']} | {r['cut']} | {errors} | {fmt(r['ttft_p50_s'])} / {fmt(r['ttft_p99_s'])} "
                   f"| {fmt(r['itl_p50_s'], '.1f', 1000)} / {fmt(r['itl_p99_s'], '.1f', 1000)} "
                   f"| {fmt(r['acceptance'], '.0%')} | {fmt(r['cached_prompt_share'], '.0%')} "
                   f"| {fmt(r['batch_sessions_mean'], '.1f')} | {fmt(r['verify_busy_share'], '.0%')} "
                   f"| {' / '.join(fmt(r['cpu_share'].get(n)) for n in PROCESSES)} "
                   f"| {fmt(r['kv_used_peak'], '.0f')} / {fmt(r['kv_budget'], '.0f')} "
                   f"| {fmt(r['verify_queue_peak'], '.0f')} | {fmt(r['admission_queue_peak'], '.0f')} "
                   f"| {fmt(r['verify_rss_peak_mib'], '.0f')} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--levels", help=f"concurrent streams, SmolLM pair (default {FULL['levels']}; '': skip it)")
    p.add_argument("--qwen-levels", help=f"concurrent streams, Qwen pair (default {FULL['qwen_levels']})")
    p.add_argument("--skip-qwen", action="store_true", help="leave the Qwen pair out")
    p.add_argument("--seconds", type=float, help=f"per level and mode: start requests for this long "
                   f"(default {FULL['seconds']:.0f}), then let the running ones finish")
    p.add_argument("--repeats", type=int, help=f"runs per level and mode, interleaved: spec off off spec ... "
                   f"(default {FULL['repeats']})")
    p.add_argument("--max-level-seconds", type=float, help=f"cancel what still runs after this long "
                   f"(default {FULL['max_level_seconds']:.0f}; 0: never)")
    p.add_argument("--requests-per-stream", type=int, default=0, help="instead of --seconds: this many per stream")
    p.add_argument("--max-new-tokens", type=int, help=f"per request (default {FULL['max_new_tokens']})")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts (round robin)")
    p.add_argument("-k", type=int, default=0, help="speculative tokens per round, an upper bound (0: the gateway's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--draft-dtype", default="int8", help="the Qwen draft worker's --dtype")
    p.add_argument("--kv-budget-tokens", type=int, help="the verify worker's --kv-budget-tokens (default: its own)")
    p.add_argument("--timeout", type=float, default=600, help="per request deadline, seconds")
    p.add_argument("--error-pause", type=float, default=0.5, help="a stream's pause after a failed request")
    p.add_argument("--sample-seconds", type=float, default=0.5, help="metrics and RSS sampling interval")
    p.add_argument("--out", default="bench/results/load.json")
    a = p.parse_args(argv)
    fill_defaults(a, QUICK, FULL)

    rows = []
    for pair, levels in (("smollm", a.levels), ("qwen", "" if a.skip_qwen else a.qwen_levels)):
        if levels:
            rows += run_pair(pair, [int(x) for x in levels.split(",")], a)
    print("\n" + table(rows))
    write_json(a.out, {"machine": machine(), "setup": {**vars(a), "prompts": PROMPTS[:a.prompts]}, "levels": rows})


if __name__ == "__main__":
    main()

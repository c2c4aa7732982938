"""make bench-topology: the draft pool on cores of its own, the layouts side by side in one run.

Longer than 300 lines because one run (the stack, its layouts, the interleaved runs, the table and
the JSON) is read as one script.

Per model pair one stack (tandem.launch.Stack), each worker with --threads torch threads and pinned
by CPU affinity: the verify worker on --verify-cpus; the gateways, the draft workers (except the
co-located one), this client and the link's proxy on --other-cpus. Each layout has a gateway with
static routing (and a draft worker) of its own, so that a request picks its layout:

- plain: the target alone (draft method none), the verify worker's CPUs to itself;
- co-located: a draft worker on the verify worker's CPUs, the two taking turns;
- split: the draft worker on the other CPUs;
- split-stream: split, with --pipeline --no-prepare (the draft worker streams its proposals, drafting
  while the target verifies);
- split-ahead: split-stream with prepared continuations (--prepare, the default: after a verdict that
  takes the draft's second choice where it was unsure, the continuation drafted for it goes out at once);
- link-Nms: split-ahead, dialing the verify worker through tandem.linkproxy (--verify-route) with
  N ms of one-way delay, set before each run;
- with --twin NAME=FLAGS (repeatable), a twin of each chosen layout but plain and the links, named
  with "-NAME", whose draft worker takes FLAGS besides (say --draft-lookup 4; pairs whose draft has
  no model leave the twins out).

The layouts run in a row per prompt (--streams S: S requests at once, the prompts in turn), the
order reversed every other row, so that a host whose speed drifts favours none. Before each row a
one-token plain request per prompt leaves the target's KV for the row to copy (a draft model
prefills its own, as in service). Per run: tokens / wall, rounds (usage.verify_rounds), tokens per
round, each worker's busy share of wall time (the rate of its tandem_inference_busy_seconds_total)
and CPU seconds per wall second (/proc; n-gram drafting runs on the event loop, not the inference
thread), and the verify worker's pass time against what the same passes took at start-up, alone
(tandem_verify_pass_seconds_total: measured over calibrated; above 1 where a draft worker on other
cores of the same machine slows the target's passes, as one sharing its memory bus does). Greedy
outputs must equal plain's for the same prompt and streams: checked, loudly.

    python -m bench.topology                 # both pairs, streams 1 and 4, every layout
    python -m bench.topology --quick         # SmolLM2 + n-gram, 2 prompts, 1 stream, 24 tokens
    python -m bench.topology --pair qwen --prompts 1 --streams 1 --layouts plain,co-located,split
    python -m bench.topology --pair qwen --streams 1 --layouts co-located,split-ahead --delays '' --twin "lookup=--draft-lookup 4"
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.e2e import PROMPTS
from bench.load import PAIRS, cpu_seconds, fmt, scrape
from bench.report import fill_defaults, machine, write_json
from bench.variants import parse_variant
from tandem.client import build_request
from tandem.cpus import cpu_sets, parse_cpu_list
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

BUSY = "tandem_inference_busy_seconds_total"    # one inference thread per worker: one sample
PASS = "tandem_verify_pass_seconds_total"       # by timing: measured, and at the start-up calibration's speed
BASE = ("plain", "co-located", "split", "split-stream", "split-ahead")
FULL = {"pair": ["smollm", "qwen"], "streams": "1,4", "prompts": len(PROMPTS), "max_new_tokens": 64}
QUICK = {"pair": ["smollm"], "streams": "1", "prompts": 2, "max_new_tokens": 24}


@dataclass
class Layout:
    name: str
    gateway: str                   # its gateway's name in the stack
    draft: str | None              # its draft worker's name (None: plain)
    delay_ms: float | None = None  # the link's one-way delay (None: no link)


def chosen_layouts(a) -> list[str]:
    links = [f"link-{d:g}ms" for d in a.delays]
    names = [x.strip() for x in a.layouts.split(",")] if a.layouts else [*BASE, *links]
    names = [y for x in names for y in (links if x == "link" else [x])]
    unknown = sorted(set(names) - {*BASE, *links})
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}; choose from {', '.join([*BASE, *links, 'link'])}")
    names = [y for x in names for y in ([x, *(f"{x}-{t}" for t in a.twin)] if x in BASE[1:] else [x])]
    return list(dict.fromkeys(names))


def affinity(pid: int, pin: set[int] | None = None) -> list[int]:
    """The CPUs any thread of a process may run on, after pinning every one of them to `pin` if
    given (sched_setaffinity(pid) alone moves only the main thread; threads started later inherit)."""
    cpus: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):       # a thread that ended meanwhile
            if pin is not None:
                os.sched_setaffinity(int(tid), pin)
            cpus |= os.sched_getaffinity(int(tid))
    return sorted(cpus)


def start_layouts(stack: Stack, names: list[str], a, proxy) -> dict[str, Layout]:
    """The draft workers and gateways the layouts need, one at a time: a draft worker times its
    passes at start-up (--calibrate), and another one loading beside it would be in the timing."""
    verify = stack.address("verify_worker")
    out, links = {}, [n for n in names if n.startswith("link-")]

    def gateway(draft: str | None) -> str:
        return stack.add_gateway(["--verify-workers", verify, "--draft-workers", stack.address(draft) if draft else ""])

    kinds = {**{b: (b, []) for b in BASE}, **{f"{b}-{t}": (b, flags) for b in BASE for t, flags in a.twin.items()}}
    for name in names:
        if name == "plain":
            out[name] = Layout(name, gateway(None), None)
        elif name in kinds:
            base, twin_flags = kinds[name]
            draft = stack.add_worker("draft_worker", cpus=a.verify_cpus if base == "co-located" else a.other_cpus,
                                     extra_args={"split-stream": ["--pipeline", "--no-prepare"],
                                                 "split-ahead": ["--pipeline"]}.get(base, []) + twin_flags)
            out[name] = Layout(name, gateway(draft), draft)
    if links:
        try:
            draft = stack.add_worker("draft_worker", cpus=a.other_cpus,
                                     extra_args=["--pipeline", "--verify-route", f"{verify}={proxy.address}"])
        except RuntimeError as e:
            raise SystemExit(f"the link's draft worker did not start ({e}): does draft_worker take "
                             f"--verify-route? Leave the link out: --layouts {','.join(BASE)}") from None
        gw = gateway(draft)
        for name in links:
            out[name] = Layout(name, gw, draft, float(name[len("link-"):-len("ms")]))
    return {name: out[name] for name in names}


def measure(stack: Stack, stub, layout: Layout, prompts: list[str], method: str, n: int, timeout: float) -> dict:
    """The prompts' requests at once through the layout's gateway, and each worker's busy and CPU
    seconds over them; a failure is returned as the run's error, so that the other layouts go on."""
    procs = {k: name for k, name in (("verify", "verify_worker"), ("draft", layout.draft),
                                     ("gateway", layout.gateway)) if name}

    def seconds() -> dict[str, dict[str, float | None]]:
        return {"busy": {k: scrape(stack.metrics_url(name), "counter").get(BUSY) for k, name in procs.items()
                         if k != "gateway"},
                "cpu": {k: cpu_seconds(stack.procs[name].pid) for k, name in procs.items()},
                "pass": pass_seconds(stack.metrics_url("verify_worker"))}

    reqs = [build_request(p, chat=True, max_new_tokens=n, method=method) for p in prompts]
    before = seconds()
    with ThreadPoolExecutor(len(reqs)) as pool:
        start = time.perf_counter()
        try:
            done = list(pool.map(lambda r: stub.Generate(r, timeout=timeout), reqs))
        except grpc.RpcError as e:
            return {"error": f"{e.code().name}: {e.details()}", "wall": time.perf_counter() - start}
        wall = time.perf_counter() - start
    after = seconds()
    was, now = before.pop("pass"), after.pop("pass")
    passes = {k: now[k] - v for k, v in was.items() if k in now}
    run = {key: sum(getattr(d.usage, field) for d in done) for key, field in (
        ("tokens", "generated_tokens"), ("rounds", "verify_rounds"), ("drafted", "draft_tokens"),
        ("accepted", "accepted_tokens"))}
    return {"wall": wall, **run, "tok_s": run["tokens"] / wall, "texts": [d.text for d in done], "pass_seconds": passes,
            **{kind: {k: (after[kind][k] - v) / wall if None not in (v, after[kind][k]) else None
                      for k, v in before[kind].items()} for kind in before}}


def pass_seconds(url: str) -> dict[str, float]:
    """The verify worker's forward-pass seconds so far by timing: measured, and calibrated (what the
    same passes took at start-up, alone on its CPUs); {} without a calibrated curve."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    return {s.labels["timing"]: s.value for fam in text_string_to_metric_families(text)
            if fam.name + "_total" == PASS for s in fam.samples if s.name == PASS}


def run_pair(pair: str, names: list[str], a) -> tuple[list[dict], dict[str, list[int]]]:
    """Every run of one pair, and the CPUs each process's threads may use (checked, not assumed)."""
    target, draft, method = PAIRS[pair]
    if method != "model":
        names = [n for n in names if n in BASE or n.startswith("link-")]
    print(f"\n{pair}: {target} + draft {draft} ({method}); layouts {', '.join(names)}", flush=True)
    cpus = {"verify_worker": a.verify_cpus, "draft_worker": a.other_cpus, "gateway": a.other_cpus}
    runs, client_cpus, proxy = [], os.sched_getaffinity(0), None
    with Stack(target, draft, threads=a.threads, draft_workers=0, cpus=cpus) as stack, \
            contextlib.ExitStack() as ex:
        if any(n.startswith("link-") for n in names):
            from tandem.linkproxy import ProxyThread
            proxy = ex.enter_context(ProxyThread(stack.address("verify_worker")))
        layouts = start_layouts(stack, names, a, proxy)
        ex.callback(affinity, os.getpid(), client_cpus)
        affinity(os.getpid(), parse_cpu_list(a.other_cpus))
        stubs = {g: pb_grpc.GenerationServiceStub(ex.enter_context(grpc.insecure_channel(stack.address(g))))
                 for g in {lay.gateway for lay in layouts.values()}}

        def one(lay: Layout, prompts: list[str], n: int) -> dict:
            if lay.delay_ms is not None:
                proxy.set(delay_ms=lay.delay_ms)
            return measure(stack, stubs[lay.gateway], lay, prompts, "none" if lay.draft is None else method, n,
                           a.timeout)

        for lay in layouts.values():
            if "error" in (r := one(lay, ["warm up"], 8)):
                print(f"  {lay.name} FAILED its warm-up: {r['error']}", flush=True)
        pinned = {**{name: affinity(p.pid) for name, p in stack.procs.items()}, "client": affinity(os.getpid())}
        print(f"  affinity: {', '.join(f'{k} {v}' for k, v in pinned.items())}", flush=True)
        turn = 0
        for rep in range(a.repeats):
            for streams in a.streams:
                for row in range(math.ceil(a.prompts / streams)):
                    which = [(row * streams + j) % a.prompts for j in range(streams)]
                    for i in sorted(set(which)):      # the target's KV of each prompt, for the row to copy
                        stubs[layouts[names[0]].gateway].Generate(
                            build_request(PROMPTS[i], chat=True, max_new_tokens=1, method="none"), timeout=a.timeout)
                    turn += 1
                    for name in names if turn % 2 else names[::-1]:
                        r = one(layouts[name], [PROMPTS[i] for i in which], a.max_new_tokens)
                        runs.append({"pair": pair, "layout": name, "streams": streams, "row": row, "repeat": rep,
                                     "prompts": which, **r})
                        print(f"  {streams} stream(s) row {row} {name:12s} " + (
                            f"FAILED: {r['error']}" if "error" in r else
                            f"{r['tok_s']:7.2f} tok/s, {r['rounds']} rounds, busy verify "
                            f"{fmt(r['busy']['verify'], '.0%')} draft {fmt(r['busy'].get('draft'), '.0%')}"),
                              flush=True)
    return runs, pinned


def spread(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def summarize(runs: list[dict], names: list[str]) -> tuple[list[dict], list[dict]]:
    """Figures per pair, streams and layout (ratios: of each run to the plain or co-located run of
    its row, the two side by side in time); the outputs that differ from plain's."""
    rows, mismatches = [], []
    ok = [r for r in runs if "error" not in r]
    by = {(r["pair"], r["streams"], r["row"], r["repeat"], r["layout"]): r for r in ok}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["pair"], r["streams"], r["layout"]), []).append(r)
    for (pair, streams, name), group in groups.items():
        rs, errors = [r for r in group if "error" not in r], [r["error"] for r in group if "error" in r]
        if not rs:
            rows.append({"pair": pair, "streams": streams, "layout": name, "runs": 0, "errors": errors})
            continue

        def base(r: dict, layout: str) -> dict | None:
            return by.get((pair, streams, r["row"], r["repeat"], layout))

        checked = same = 0
        for r in rs:
            for j, text in enumerate(r["texts"]) if (ref := base(r, "plain")) else ():
                checked, same = checked + 1, same + (text == ref["texts"][j])
                if text != ref["texts"][j]:
                    mismatches.append({"pair": pair, "streams": streams, "layout": name, "prompt": r["prompts"][j],
                                       "repeat": r["repeat"], "text": text, "plain": ref["texts"][j]})
        wall, tokens, rounds, drafted, accepted = (sum(r[k] for r in rs)
                                                   for k in ("wall", "tokens", "rounds", "drafted", "accepted"))

        measured, calibrated = (sum(r["pass_seconds"].get(k, 0.0) for r in rs) for k in ("measured", "calibrated"))

        def share(kind: str, proc: str) -> float | None:
            xs = [r[kind].get(proc) for r in rs]
            return sum(x * r["wall"] for x, r in zip(xs, rs)) / wall if None not in xs else None

        rows.append({"pair": pair, "streams": streams, "layout": name, "runs": len(rs), "tok_s": tokens / wall,
                     "tok_s_runs": spread([r["tok_s"] for r in rs]),
                     **{f"vs_{key}": spread([r["tok_s"] / b["tok_s"] for r in rs if (b := base(r, layout))])
                        for key, layout in (("plain", "plain"), ("colocated", "co-located"))},
                     "tokens": tokens, "rounds": rounds, "mean_accepted_length": tokens / rounds if rounds else None,
                     "acceptance": accepted / drafted if drafted else None,
                     "verify_busy": share("busy", "verify"), "draft_busy": share("busy", "draft"),
                     "pass_slowdown": measured / calibrated if calibrated else None,
                     "cpu": {p: share("cpu", p) for p in ("verify", "draft", "gateway")},
                     "outputs_checked": checked, "outputs_equal_plain": same, "errors": errors})
    pairs = list(dict.fromkeys(r["pair"] for r in runs))
    rows.sort(key=lambda x: (pairs.index(x["pair"]), x["streams"], names.index(x["layout"])))
    return rows, mismatches


def times(x: dict | None, suffix: str = "x") -> str:
    return "-" if x is None else f"{x['median']:.2f}{suffix} ({x['min']:.2f}-{x['max']:.2f})"


def table(rows: list[dict]) -> str:
    out = ["| pair | streams | layout | tokens/s | median (min-max) | vs plain | vs co-located | rounds "
           "| mean accepted length | acceptance | verify busy | verify pass time vs start-up | draft busy | draft CPU "
           "| output = plain |",
           "|" + " --- |" * 15]
    for r in rows:
        if r["errors"]:
            out.append(f"| {r['pair']} | {r['streams']} | {r['layout']} | **FAILED** {len(r['errors'])} of "
                       f"{len(r['errors']) + r['runs']} runs: {r['errors'][0]} |" + " |" * 11)
            continue
        check = ("-" if not r["outputs_checked"] else f"{r['outputs_equal_plain']}/{r['outputs_checked']}"
                 + ("" if r["outputs_equal_plain"] == r["outputs_checked"] else " **MISMATCH**"))
        out.append(f"| {r['pair']} | {r['streams']} | {r['layout']} | {r['tok_s']:.2f} | {times(r['tok_s_runs'], '')} "
                   f"| {times(r['vs_plain'])} | {times(r['vs_colocated'])} | {r['rounds']} "
                   f"| {fmt(r['mean_accepted_length'])} | {fmt(r['acceptance'], '.0%')} "
                   f"| {fmt(r['verify_busy'], '.0%')} | {fmt(r['pass_slowdown'], suffix='x')} "
                   f"| {fmt(r['draft_busy'], '.0%')} "
                   f"| {fmt(r['cpu']['draft'], '.0%')} | {check} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.topology", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--pair", action="append", choices=[*PAIRS, "all"],
                   help=f"model pair, repeatable (default {' and '.join(FULL['pair'])}): smollm = SmolLM2-135M + "
                        f"model-free draft worker (ngram), qwen = Qwen2.5-Coder 1.5B + 0.5B (model, int8 draft)")
    p.add_argument("--streams", help=f"concurrent requests per run, comma-separated (default {FULL['streams']})")
    p.add_argument("--prompts", type=int, help=f"use the first N of bench.e2e's prompts (default {FULL['prompts']})")
    p.add_argument("--max-new-tokens", type=int, help=f"per request (default {FULL['max_new_tokens']})")
    p.add_argument("--layouts", default="", help=f"comma-separated subset of {', '.join(BASE)}, link-Nms or link "
                   f"(all --delays) (default: all)")
    p.add_argument("--delays", default="0,1,5", help="the link layouts' one-way delays in ms ('': no link layouts)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the rows (the order reversed every other row)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    p.add_argument("--timeout", type=float, default=600, help="deadline of each request, seconds")
    p.add_argument("--verify-cpus", default="0", help="the verify worker's CPU list")
    p.add_argument("--other-cpus", default="1", help="CPU list of the gateways, split draft workers, this client")
    p.add_argument("--twin", action="append", type=parse_variant, default=[], metavar="NAME=FLAGS",
                   help="also each draft layout with its draft worker taking FLAGS, named with -NAME (repeatable)")
    p.add_argument("--out", default="bench/results/topology.json")
    a = p.parse_args(argv)
    fill_defaults(a, QUICK, FULL)
    pairs = list(PAIRS) if "all" in a.pair else list(dict.fromkeys(a.pair))
    a.streams = [int(s) for s in str(a.streams).split(",")]
    a.delays = [float(d) for d in a.delays.split(",") if d.strip()]
    a.prompts = min(a.prompts, len(PROMPTS))
    a.twin = dict(a.twin)
    names = chosen_layouts(a)
    try:
        cpu_sets({"verify_worker": a.verify_cpus, "draft_worker": a.other_cpus})
    except ValueError as e:
        p.error(f"--verify-cpus/--other-cpus: {e}")
    if min(a.streams) < 1 or a.prompts < 1:
        p.error("--streams and --prompts must be >= 1")

    runs, affinities = [], {}
    for pair in pairs:
        pair_runs, affinities[pair] = run_pair(pair, names, a)
        runs += pair_runs
    rows, mismatches = summarize(runs, names)
    print("\n" + table(rows))
    for m in mismatches:
        print(f"\nMISMATCH {m['pair']} {m['streams']} stream(s) {m['layout']} prompt {m['prompt']}:\n"
              f"  {m['layout']}: {m['text']!r}\n  plain: {m['plain']!r}")
    write_json(a.out, {"machine": machine(),
                       "setup": {**vars(a), "pairs": {p: PAIRS[p] for p in pairs}, "prompts": PROMPTS[:a.prompts],
                                 "affinity": affinities},
                       "layouts": rows, "mismatches": mismatches, "runs": runs})


if __name__ == "__main__":
    main()

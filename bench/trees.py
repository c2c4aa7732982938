"""make bench-trees: chains against trees of candidates, and transformers' assisted generation, in one run.

One stack per layout (tandem.launch.Stack), started in turn with the same models and threads:
- chains: the draft worker with --tree-branches 0;
- trees: the default (--tree-branches 2: branches at the draft's second choices, drafted in the
  same batched steps, verified in one pass with a tree mask).
Each layout serves draft methods model (the Qwen pair, int8 draft; the chat code prompts of
bench/e2e.py) and ngram (the code-editing prompts of bench/load.py, whose outputs repeat their
prompts) at 1, 4 and 16 concurrent streams (S requests at once, the prompts in turn), greedy. Per run: tokens / wall,
tokens per verify round, proposed nodes per round (usage.draft_tokens / verify_rounds) and the
verify worker's seconds per pass (its tandem_verify_seconds histogram). Then, with the stacks
stopped, transformers' generate on the target alone and assisted by the same int8 draft, on the
same prompts. Outputs must equal the chains' for the same prompt: checked, loudly.

    python -m bench.trees                   # 4 prompts, 96 tokens, streams 1, 4 and 16
    python -m bench.trees --quick           # 2 prompts, 32 tokens, 1 stream
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from bench.e2e import PROMPTS, hf_run
from bench.load import PROMPTS as EDITS
from bench.load import scrape
from bench.report import fill_defaults, machine, timed_generate, write_json
from tandem.client import build_request
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

LAYOUTS = {"chains": ["--tree-branches", "0"], "trees": []}
FULL = {"prompts": len(PROMPTS), "max_new_tokens": 96, "streams": "1,4,16"}
QUICK = {"prompts": 2, "max_new_tokens": 32, "streams": "1"}
VERIFY = "tandem_verify_forward_seconds"   # per round: the pass it joined


def run_streams(stub, prompts: list[str], method: str, streams: int, n: int) -> dict:
    """`streams` requests at a time, the prompts in turn, until each prompt ran max(1, streams /
    len(prompts)) times: (runs in prompt order, wall seconds)."""
    jobs = [prompts[i % len(prompts)] for i in range(max(len(prompts), streams))]
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda p: timed_generate(stub, build_request(p, chat=True, max_new_tokens=n,
                                                                         method=method))[0], jobs))
    wall = time.perf_counter() - start
    tokens, rounds, drafted = (sum(r[key] for r in runs) for key in ("tokens", "rounds", "drafted"))
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall, "rounds": rounds,
            "tokens_per_round": tokens / rounds if rounds else None,
            "nodes_per_round": drafted / rounds if rounds else None,
            "texts": [r["text"] for r in runs]}


def layout(name: str, a, methods: list[str], streams: list[int]) -> dict:
    out: dict = {}
    with Stack(a.target, a.draft, threads=a.threads, draft_args=["--dtype", "int8", *LAYOUTS[name]]) as stack, \
            grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        metrics_url = f"http://127.0.0.1:{stack.metrics_ports['verify_worker']}/metrics"
        for method in methods:
            timed_generate(stub, build_request("warm up", chat=True, max_new_tokens=8, method=method))
            for s in streams:
                before = scrape(metrics_url, "histogram")
                prompts = (PROMPTS if method == "model" else EDITS)[:a.prompts]
                run = run_streams(stub, prompts, method, s, a.max_new_tokens)
                after = scrape(metrics_url, "histogram")
                passes = after.get(f"{VERIFY}_count", 0) - before.get(f"{VERIFY}_count", 0)
                busy = after.get(f"{VERIFY}_sum", 0) - before.get(f"{VERIFY}_sum", 0)
                run["pass_ms"] = 1000 * busy / passes if passes else None
                out[f"{method}/{s}"] = run
                print(f"  {name:6s} {method:5s} streams {s:2d}: {run['tok_s']:.2f} tok/s, "
                      f"{run['tokens_per_round']:.2f} tokens/round, {run['nodes_per_round']:.2f} nodes/round, "
                      f"{run['pass_ms'] or 0:.0f} ms/pass", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--streams", help="comma-separated concurrent streams")
    p.add_argument("--methods", default="model,ngram")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' runs")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/trees.json")
    a = p.parse_args(argv)
    fill_defaults(a, QUICK, FULL)
    streams, methods = [int(s) for s in a.streams.split(",")], a.methods.split(",")
    result = {"machine": machine(), "setup": {k: getattr(a, k) for k in ("target", "draft", "threads", "prompts",
                                                                         "max_new_tokens", "streams", "methods")}}
    result["layouts"] = {name: layout(name, a, methods, streams) for name in LAYOUTS}
    chains, trees = result["layouts"]["chains"], result["layouts"]["trees"]
    same = {key: chains[key]["texts"] == trees[key]["texts"] for key in chains}
    result["trees_output_equals_chains"] = same
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        from tandem.engine.modeling import load_tokenizer, load_weights, resolve
        torch.set_num_threads(a.threads)
        tok = load_tokenizer(a.target)
        target = AutoModelForCausalLM.from_pretrained(resolve(a.target), dtype=torch.float32).eval()
        draft = load_weights(resolve(a.draft), "int8", "cpu", batch_invariant=False)
        hf_run(target, draft, tok, "warm up", 8)
        for name, assistant in (("hf_plain", None), ("hf_assisted_int8", draft)):
            runs = [hf_run(target, assistant, tok, prompt, a.max_new_tokens) for prompt in PROMPTS[:a.prompts]]
            result[name] = {"tok_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)}
            print(f"  {name}: {result[name]['tok_s']:.2f} tok/s", flush=True)
    print("\n| method | streams | chains tok/s | trees tok/s | trees / chains | tokens/round (chains, trees) "
          "| nodes/round (chains, trees) | ms/pass (chains, trees) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in chains:
        c, t = chains[key], trees[key]
        method, s = key.split("/")
        print(f"| {method} | {s} | {c['tok_s']:.2f} | {t['tok_s']:.2f} | {t['tok_s'] / c['tok_s']:.2f}x "
              f"| {c['tokens_per_round']:.2f}, {t['tokens_per_round']:.2f} | {c['nodes_per_round']:.2f}, "
              f"{t['nodes_per_round']:.2f} | {c['pass_ms'] or 0:.0f}, {t['pass_ms'] or 0:.0f} |")
    if "hf_assisted_int8" in result and "model/1" in trees:
        ratio = trees["model/1"]["tok_s"] / result["hf_assisted_int8"]["tok_s"]
        result["trees_vs_hf_assisted_int8"] = ratio
        print(f"\ntrees, model, 1 stream against transformers' assisted generation (int8 draft): {ratio:.2f}x "
              f"(transformers plain {result['hf_plain']['tok_s']:.2f} tok/s)")
    for key, ok in same.items():
        if not ok:
            print(f"WARNING: {key}: trees' outputs differ from chains'")
    for runs in result["layouts"].values():
        for run in runs.values():
            del run["texts"]
    write_json(a.out, result)


if __name__ == "__main__":
    main()

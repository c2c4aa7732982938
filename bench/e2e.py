"""make bench: the same prompts through the running service (draft none / model / ngram) and
through transformers' in-process assisted generation with the same models, interleaved in one run.

Also measures one verify round's overhead (gRPC, serialization, bookkeeping) with tiny models:
the same generation through the service and through the same engine in one process.

And the cost of request parameters (bench/params.py): per-token information and a penalty, with
speculation on and off.

And structured output (bench/guided.py): JSON Schema extraction with and without jump-forward, set
against the same prompts' free-text speed-up, and the guide's masks' share of a round.

And the trained head (bench/head.py): SmolLM2-135M-Instruct with its shipped head, none / ngram / head.

And the SMG router in front (bench/router.py): the native face against SMG's OpenAI API, 1 and 4 streams.

Prints tables and writes JSON to bench/results/.

Longer than 300 lines because it is the one entry point that runs every section in order around
the stacks they share, and prints each section's table from one result.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from bench.guided import guided, mask_costs, print_guided
from bench.head import head_section, print_head
from bench.params import parameters, print_parameters
from bench.router import print_router, router_section
from bench.report import fill_defaults, machine, summarize, timed_generate, write_json
from tandem.client import build_request
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
]


def service_run(stub, prompt: str, method: str, k: int, n: int) -> dict:
    return timed_generate(stub, build_request(prompt, chat=True, max_new_tokens=n, method=method, k=k))[0]


def step_ms(model, tok, prompt: str = "def fib(n):" * 16, repeats: int = 7) -> float:
    """Median time of one decode step (one new token after a ~100-token context), in ms."""
    from transformers import DynamicCache
    ids = tok(prompt, return_tensors="pt").input_ids
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
            times.append(time.perf_counter() - start)
            cache.crop(-1)
    return 1000 * statistics.median(times)


def bound(alpha: float, k: int, c: float) -> float:
    """Expected speed-up of speculative decoding with acceptance alpha, k drafts, cost ratio c."""
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def hf_run(target, draft, tok, prompt: str, n: int) -> dict:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    kwargs = {"assistant_model": draft} if draft is not None else {}
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)
    wall = time.perf_counter() - start
    gen = out.shape[1] - ids.shape[1]
    return {"tokens": gen, "seconds": wall, "tok_s": gen / wall,
            "text": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}


def _metric_sums(url: str, names: list[str]) -> dict[str, float]:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families
    text = urlopen(url, timeout=10).read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names}


def overhead(rounds_tokens: int = 96) -> dict:
    """Per verify round, tiny models, k=4, two ways:
    - in-band: the draft worker's round trip (proposal sent -> verdict read) minus the verify worker's
      own time on the round, from the services' metrics: gRPC both ways, serialization, bookkeeping;
    - end to end: (service wall time - the same loop in one process) / rounds, which also counts the
      gateway and any slowdown of the models' Python code in server processes; noisy when the
      machine is shared."""
    from draft_worker.model import ModelDrafter
    from tandem.engine.modeling import CausalLM, load_tokenizer
    from tandem.speculation.sampling import SamplingParams
    from tandem.testing import build_tiny_pair
    from tests.local import speculate
    from verify_worker.engine import VerifyEngine

    root = Path(tempfile.mkdtemp(prefix="tandem-overhead-"))
    target, draft = build_tiny_pair(root)
    tok = load_tokenizer(str(target))
    torch.set_num_threads(1)
    engine, drafter = VerifyEngine(CausalLM(str(target))), ModelDrafter(CausalLM(str(draft)))
    prompt = "def add(a, b):"
    ids = tok(prompt).input_ids
    params = SamplingParams(max_new_tokens=rounds_tokens, min_new_tokens=rounds_tokens)
    local, remote = [], []
    # both sides run the same float32 models without padding, so the difference is the network's
    with Stack(str(target), str(draft), threads=1, verify_args=["--no-calibrate"],
               draft_args=["--dtype", "float32", "--no-calibrate"]) as stack, \
            grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        req = build_request(prompt, max_new_tokens=rounds_tokens, method="model", k=4)
        req.sampling.min_new_tokens = rounds_tokens
        rtt, fwd = "tandem_draft_verify_round_trip_seconds", "tandem_verify_forward_seconds"
        band = []
        for i in range(12):
            before = {**_metric_sums(stack.metrics_url("draft_worker"), [rtt + "_sum", rtt + "_count"]),
                      **_metric_sums(stack.metrics_url("verify_worker"), [fwd + "_sum"])}
            t = time.perf_counter()
            r = stub.Generate(req, timeout=60)
            remote.append((time.perf_counter() - t) / r.usage.verify_rounds)
            after = {**_metric_sums(stack.metrics_url("draft_worker"), [rtt + "_sum", rtt + "_count"]),
                     **_metric_sums(stack.metrics_url("verify_worker"), [fwd + "_sum"])}
            d = {k: after[k] - before[k] for k in after}
            band.append((d[rtt + "_sum"] - d[fwd + "_sum"]) / d[rtt + "_count"])
            t = time.perf_counter()
            speculate(engine, drafter, ids, params, 4)
            local.append((time.perf_counter() - t) / max(1, r.usage.verify_rounds))
    per_round = [1000 * (a - b) for a, b in zip(remote[2:], local[2:])]
    in_band = [1000 * x for x in band[2:]]
    return {"in_band_ms_median": statistics.median(in_band), "in_band_ms_min": min(in_band),
            "in_band_ms_max": max(in_band),
            "overhead_ms_median": statistics.median(per_round), "overhead_ms_min": min(per_round),
            "overhead_ms_max": max(per_round), "service_round_ms": 1000 * statistics.median(remote[2:]),
            "in_process_round_ms": 1000 * statistics.median(local[2:])}


SECTIONS = ("overhead", "models", "params", "guided", "head", "router")
FULL = {"prompts": len(PROMPTS), "max_new_tokens": 96, "params_repeats": 2,
        "guided_prompts": 3, "guided_max_new_tokens": 128, "guided_repeats": 1,
        "head_heldout": 17, "head_max_new_tokens": 128, "head_streams": 16}
QUICK = {"prompts": 2, "max_new_tokens": 48, "params_repeats": 2,
         "guided_prompts": 1, "guided_max_new_tokens": 24, "guided_repeats": 1,
         "head_heldout": 2, "head_max_new_tokens": 32, "head_streams": 4}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.e2e", description=__doc__)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--max-new-tokens", type=int, help=f"per request (default {FULL['max_new_tokens']})")
    p.add_argument("--prompts", type=int, help=f"use the first N prompts (default {FULL['prompts']})")
    p.add_argument("-k", type=int, default=16, help="speculative tokens per round, an upper bound (model)")
    p.add_argument("--ngram-k", type=int, default=16)
    p.add_argument("--draft-dtype", default="int8", help="the draft worker's --dtype")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--skip-models", action="store_true", help="only the overhead measurement")
    p.add_argument("--only", action="append", choices=SECTIONS,
                   help="run only this section (repeatable; default: all of " + ", ".join(SECTIONS) + ")")
    p.add_argument("--params-spec", choices=["model", "ngram"],
                   help="parameters: the speculation measured against none (default: model, or ngram "
                        "with --draft none)")
    p.add_argument("--params-prompts", choices=["e2e", "edit"], default="e2e",
                   help="parameters: this file's prompts (write new code), or bench.load's (edit the code "
                        "in the prompt: where n-gram drafting helps)")
    p.add_argument("--params-repeats", type=int,
                   help=f"parameters: passes over the prompts (default {FULL['params_repeats']})")
    p.add_argument("--guided-prompts", type=int,
                   help=f"guided: use the first N extraction prompts (default {FULL['guided_prompts']})")
    p.add_argument("--guided-max-new-tokens", type=int,
                   help=f"guided: per request (default {FULL['guided_max_new_tokens']})")
    p.add_argument("--guided-repeats", type=int,
                   help=f"guided: passes over the prompts (default {FULL['guided_repeats']})")
    p.add_argument("--head-heldout", type=int, help=f"head: held-out prompts (default {FULL['head_heldout']})")
    p.add_argument("--head-max-new-tokens", type=int, help=f"head: per request (default {FULL['head_max_new_tokens']})")
    p.add_argument("--head", default="shipped", help="head: the verify worker's --head")
    p.add_argument("--head-streams", type=int,
                   help="head: concurrent requests of the under-load part, 0 to skip it "
                        f"(default {FULL['head_streams']})")
    p.add_argument("--head-load-only", action="store_true", help="head: only the part under load")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", default="bench/results/e2e.json")
    a = p.parse_args(argv)
    fill_defaults(a, QUICK, FULL)
    sections = {"overhead"} if a.skip_models else set(a.only or SECTIONS)

    result: dict = {"machine": machine(), "sections": [s for s in SECTIONS if s in sections]}
    if "overhead" in sections:
        result["overhead"] = overhead()
        o = result["overhead"]
        print(f"verify-round overhead (tiny models, k=4): in-band median {o['in_band_ms_median']:.2f} ms "
              f"({o['in_band_ms_min']:.2f}-{o['in_band_ms_max']:.2f}); end to end median {o['overhead_ms_median']:.2f} ms "
              f"(service {o['service_round_ms']:.2f} ms/round vs in-process {o['in_process_round_ms']:.2f} ms/round)",
              flush=True)
    if sections & {"models", "params", "guided"}:
        import transformers
        torch.set_num_threads(a.threads)
        spec = a.params_spec or ("model" if a.draft != "none" else "ngram")
        result["setup"] = {"target": a.target, "draft": a.draft, "draft_dtype": a.draft_dtype, "k": a.k,
                           "ngram_k": a.ngram_k,
                           "max_new_tokens": a.max_new_tokens, "threads_per_process": a.threads,
                           "transformers": transformers.__version__, "prompts": PROMPTS[:a.prompts]}
        draft_args = ["--dtype", a.draft_dtype] if a.draft != "none" else []
        with Stack(a.target, a.draft, threads=a.threads, draft_args=draft_args) as stack, \
                 grpc.insecure_channel(stack.address("gateway")) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            if "models" in sections:
                configs = [("none", 0), ("model", a.k), ("ngram", a.ngram_k)]
                runs: dict[str, list] = {name: [] for name in ["none", "model", "ngram", "hf_plain", "hf_assisted",
                                                               "hf_assisted_int8", "hf_assisted_int8_packed"]}
                service_run(stub, "warm up", "model", a.k, 8)
                service_run(stub, "warm up", "none", 0, 8)
                for prompt in PROMPTS[:a.prompts]:
                    for method, k in configs:
                        runs[method].append(service_run(stub, prompt, method, k, a.max_new_tokens))
                        print(f"  {method:6s} {runs[method][-1]['tok_s']:.2f} tok/s", flush=True)
            if "params" in sections:
                print("parameters:", flush=True)
                if a.params_prompts == "edit":
                    from bench.load import PROMPTS as params_prompts
                else:
                    params_prompts = PROMPTS
                result["parameters"] = parameters(stub, params_prompts[:a.prompts], spec,
                                                  a.k if spec == "model" else a.ngram_k, a.max_new_tokens,
                                                  a.params_repeats)
            if "guided" in sections:     # last: it adds a draft worker and gateways to the stack
                print("guided:", flush=True)
                result["guided"] = guided(stack, a.k, a.guided_max_new_tokens, a.guided_prompts, a.guided_repeats)
    if "guided" in sections:
        mask_costs(result["guided"], a.target)
    if "head" in sections:      # its own stack: SmolLM2 and its shipped head, whatever --target says
        result["head"] = head_section(PROMPTS[:a.prompts], a.head_heldout, a.head_max_new_tokens, a.threads,
                                      a.head, a.ngram_k, a.head_streams, load_only=a.head_load_only)
    if "router" in sections:    # its own stack too: SmolLM2 with n-gram drafting, SMG in front
        result["router"] = router_section(PROMPTS[:a.prompts], a.head_max_new_tokens, a.threads)
    if "models" in sections:
        from transformers import AutoModelForCausalLM

        from tandem.engine.gemm import pack_linears
        from tandem.engine.modeling import load_tokenizer, load_weights, resolve
        tok = load_tokenizer(a.target)
        # The service's processes are stopped now, so the in-process runs get the cores to themselves.
        target = AutoModelForCausalLM.from_pretrained(resolve(a.target), dtype=torch.float32).eval()
        draft = AutoModelForCausalLM.from_pretrained(resolve(a.draft), dtype=torch.float32).eval()
        # the draft worker's own int8 weights (tandem.engine.modeling), so both sides run the same draft
        draft_int8 = load_weights(resolve(a.draft), "int8", "cpu", batch_invariant=False)
        hf_run(target, draft, tok, "warm up", 8)
        hf_run(target, draft_int8, tok, "warm up", 8)
        for prompt in PROMPTS[:a.prompts]:
            runs["hf_plain"].append(hf_run(target, None, tok, prompt, a.max_new_tokens))
            runs["hf_assisted"].append(hf_run(target, draft, tok, prompt, a.max_new_tokens))
            runs["hf_assisted_int8"].append(hf_run(target, draft_int8, tok, prompt, a.max_new_tokens))
            print(f"  hf     {runs['hf_plain'][-1]['tok_s']:.2f} / assisted {runs['hf_assisted'][-1]['tok_s']:.2f}"
                  f" / assisted, int8 draft {runs['hf_assisted_int8'][-1]['tok_s']:.2f} tok/s", flush=True)
        steps = {"target": step_ms(target, tok), "draft": step_ms(draft, tok), "draft_int8": step_ms(draft_int8, tok)}
        # The service multiplies several rows with oneDNN on packed weights (tandem.engine.gemm); the same
        # for transformers' target shows how much of the difference is that kernel alone.
        pack_linears(target)
        for prompt in PROMPTS[:a.prompts]:
            run = hf_run(target, draft_int8, tok, prompt, a.max_new_tokens)
            runs["hf_assisted_int8_packed"].append(run)
            print(f"  hf     assisted, int8 draft, packed target {run['tok_s']:.2f} tok/s", flush=True)
        c = steps["draft_int8" if a.draft_dtype == "int8" else "draft"] / steps["target"]
        result["step_ms"], result["c"] = steps, c
        summary = {name: summarize(r) for name, r in runs.items() if r}
        for name, base in [("none", "none"), ("model", "none"), ("ngram", "none"),
                           ("hf_plain", "hf_plain"), ("hf_assisted", "hf_plain"), ("hf_assisted_int8", "hf_plain"),
                           ("hf_assisted_int8_packed", "hf_plain")]:
            summary[name]["speedup"] = summary[name]["tok_s_total"] / summary[base]["tok_s_total"]
        summary["model"]["bound"] = bound(summary["model"]["acceptance"], a.k, c)
        same = [a_["text"] == b_["text"] for a_, b_ in zip(runs["model"], runs["none"])]
        result["summary"], result["runs"], result["model_output_equals_none"] = summary, runs, same
        print("\n| run | tokens/s (all prompts) | median (min-max) | speed-up | acceptance | mean accepted length |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, s in summary.items():
            acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
            mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] is not None else "-"
            print(f"| {name} | {s['tok_s_total']:.2f} | {s['tok_s_median']:.2f} ({s['tok_s_min']:.2f}-{s['tok_s_max']:.2f})"
                  f" | {s['speedup']:.2f}x | {acc} | {mal} |")
        print(f"\nservice 'model' output identical to 'none': {sum(same)}/{len(same)} prompts")
        print(f"decode step: target {steps['target']:.0f} ms, draft {steps['draft']:.0f} ms (float32), "
              f"{steps['draft_int8']:.0f} ms (int8); c = {c:.3f}; bound for the service's acceptance and "
              f"k={a.k}: {summary['model']['bound']:.2f}x")
    if "params" in sections:
        print_parameters(result["parameters"])
    if "guided" in sections:
        print_guided(result["guided"])
    if "head" in sections:
        print_head(result["head"])
    if "router" in sections:
        print_router(result["router"])
    write_json(a.out, result)


if __name__ == "__main__":
    main()

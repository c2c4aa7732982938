"""python -m bench.decoder: forward passes through transformers' modules against the lean decoder
(tandem/engine/decoder.py), which runs the same operations and gives the same numbers.

For each case, the model is loaded twice through the serving code path (`CausalLM`, lean and not),
a prompt of --context tokens is fed to each, and then passes of the case's new tokens alternate
between the two, --repeats times each, keeping each one's median: a draft's decode step (one
token, its last logits, not batch-invariant, as a draft worker runs it) at one thread and at
--threads, and the target's decode step and 10-token verify pass (batch-invariant, every
position's logits, as a verify worker runs it). Every pair's logits are checked equal.

    python -m bench.decoder
    python -m bench.decoder --draft smollm2-135m-instruct --draft-dtype float32 --target none
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from bench.report import machine, write_json
from tandem.engine.modeling import CausalLM


def measure(model: str, dtype: str, threads: int, invariant: bool, new: int, context: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    pair = {lean: CausalLM(model, dtype=dtype, batch_invariant=invariant, lean=lean, kv_tokens=context + 64)
            for lean in (False, True)}
    caches = {lean: lm.new_cache(context + new + 8) for lean, lm in pair.items()}
    prompt = [100 + i % 5000 for i in range(context)]
    for lean, lm in pair.items():
        lm.forward(prompt, caches[lean], last=1)
    last = None if invariant else 1
    times: dict[bool, list[float]] = {False: [], True: []}
    outputs = {}
    for _ in range(repeats + 2):                       # the first two warm up
        for lean, lm in pair.items():
            start = time.perf_counter()
            outputs[lean] = lm.forward([7] * new, caches[lean], last=last)
            times[lean].append(1000 * (time.perf_counter() - start))
            caches[lean].crop(context)
    hf, lean = (statistics.median(times[k][2:]) for k in (False, True))
    row = {"model": model, "dtype": dtype, "threads": threads, "invariant": invariant, "new_tokens": new,
           "transformers_ms": hf, "lean_ms": lean, "equal": torch.equal(outputs[False], outputs[True])}
    del pair, caches
    gc.collect()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--draft-dtype", default="int4")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="'none' to leave it out")
    p.add_argument("--target-dtype", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default="bench/results/decoder.json")
    a = p.parse_args()
    cases = [(a.draft, a.draft_dtype, t, False, 1) for t in sorted({1, a.threads})]
    if a.target != "none":
        cases += [(a.target, a.target_dtype, a.threads, True, n) for n in (1, 10)]
    rows = []
    for case in cases:
        rows.append(measure(*case, a.context, a.repeats))
        print(rows[-1], flush=True)
    print("| model | dtype | threads | pass | transformers ms | lean ms | lean vs transformers | equal logits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        kind = f"verify, {r['new_tokens']} new" if r["invariant"] else "draft step"
        print(f"| {r['model']} | {r['dtype']} | {r['threads']} | {kind} | {r['transformers_ms']:.1f} | "
              f"{r['lean_ms']:.1f} | {r['transformers_ms'] / r['lean_ms']:.2f}x | {'yes' if r['equal'] else 'NO'} |")
    write_json(a.out, {"machine": machine(), "context": a.context, "repeats": a.repeats, "rows": rows})


if __name__ == "__main__":
    main()

"""python -m bench.kernels: the target's forward pass on Tandem's own CPU kernel against oneDNN's.

For each precision, the target is loaded twice through the serving code path (`CausalLM`,
batch-invariant as a verify worker runs it): on Tandem's kernel (tandem.engine.rowgemm) and on
oneDNN's, as where the kernel is not built. Each times a prefill of --context tokens and then a
pass of n = 1, 2, 5, 9, 16 new tokens after it (one decode step, and verify passes of 1, 4, 8, 15
proposed tokens), in turn, keeping each size's median. Both load the same weights, so the two
rows of a precision differ only in the kernel; their numbers are the same for int8 (exact sums;
except on a CPU without VNNI, where oneDNN's weights take 7 bits) and differ in the last bits for
float32 and bfloat16 (other orders of summation). Each row says whether that kernel is the one a
worker serves the precision on here (bfloat16 takes oneDNN's on CPUs with AMX tiles, gemm.own_kernel).

    python -m bench.kernels                       # Qwen2.5-Coder-1.5B, float32, bfloat16, int8
    python -m bench.kernels --model smollm2-135m-instruct --dtypes float32
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from bench.report import machine, write_json
from tandem.engine import gemm, rowgemm
from tandem.engine.modeling import CausalLM

NEW = (1, 2, 5, 9, 16)


def measure(model: str, dtype: str, context: int, repeats: int) -> dict:
    lm = CausalLM(model, dtype=dtype, kv_tokens=context + 64)
    prompt = [100 + i % 5000 for i in range(context)]
    prefill = []
    for _ in range(2):
        cache = lm.new_cache(context + 32)
        start = time.perf_counter()
        lm.forward(prompt, cache, last=1)
        prefill.append(1000 * (time.perf_counter() - start))
        cache.release()
    cache = lm.new_cache(context + 32)
    lm.forward(prompt, cache, last=1)
    times: dict[int, list[float]] = {n: [] for n in NEW}
    for _ in range(repeats):
        for n in NEW:
            start = time.perf_counter()
            lm.forward([7] * n, cache)
            times[n].append(1000 * (time.perf_counter() - start))
            cache.crop(context)
    cache.release()
    return {"prefill_ms": min(prefill), "pass_ms": {n: statistics.median(t) for n, t in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16,int8")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/kernels.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not rowgemm.available():
        raise SystemExit("Tandem's CPU kernel is not built or does not run here: run `make kernels`")
    own, served = rowgemm.available, gemm.own_kernel
    gemm.own_kernel = lambda dtype: rowgemm.available()     # each kernel at every dtype, whichever serves
    rows = []
    for dtype in a.dtypes.split(","):
        for kernel in ("tandem", "oneDNN"):
            rowgemm.available = own if kernel == "tandem" else (lambda: False)
            try:
                result = measure(a.model, dtype, a.context, a.repeats)
            finally:
                rowgemm.available = own
            tandem_serves = dtype == "int8" or served(getattr(torch, dtype))
            result["serves"] = tandem_serves == (kernel == "tandem")
            rows.append({"dtype": dtype, "kernel": kernel, **result})
            gc.collect()
            print(f"{dtype} {kernel}: {result}", flush=True)
    # A worker's start-up calibration feeds a lone token padded to a longer input where that is
    # faster (CausalLM.calibrate): what a decode step costs it is the cheapest of these passes.
    for row in rows:
        row["decode_ms"] = min(row["pass_ms"].values())
    header = ["precision", "kernel", "serves", f"prefill {a.context} ms", *[f"{n} new ms" for n in NEW],
              "decode step (padded as calibrated) ms", "decode vs oneDNN", "prefill vs oneDNN"]
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for row in rows:
        base = next(r for r in rows if r["dtype"] == row["dtype"] and r["kernel"] == "oneDNN")
        cells = [row["dtype"], row["kernel"], "yes" if row["serves"] else "", f"{row['prefill_ms']:.0f}",
                 *[f"{row['pass_ms'][n]:.1f}" for n in NEW], f"{row['decode_ms']:.1f}",
                 f"{base['decode_ms'] / row['decode_ms']:.2f}x", f"{base['prefill_ms'] / row['prefill_ms']:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    write_json(a.out, {"machine": machine(), "model": a.model, "threads": a.threads, "context": a.context,
                       "isa": rowgemm.isa(), "rows": rows})


if __name__ == "__main__":
    main()

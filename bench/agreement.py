"""python -m bench.agreement: how often a draft at each precision agrees with the target, and what
its step costs, in process.

The target (served precision, --target-dtype) decodes each prompt greedily; each draft then reads
the prompt and the target's tokens in one pass (teacher forcing) and its argmax at each position
is compared with the target's next token. Per prompt set (bench.variants' coding, held-out chat
and held-out code prompts): the share of positions that agree, and the mean run of agreeing tokens
from a position (at most 16): what a chain proposal from there would have kept. Then each draft's
decode step (one token after 128, one thread, median of 30). Speculation's output does not depend
on the draft's precision, only how much of it the target keeps.

`int4-all` is int4 with a 4-bit output layer too (from the model's file, or its embedding where tied),
what `--dtype int4` was before its output layer took 8 bits.

    python -m bench.agreement                           # float32, int8, int4, int4-all where int4 runs
    python -m bench.agreement --dtypes int8,int4 --prompts 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open

from bench.report import machine, write_json
from bench.variants import prompt_sets
from tandem.engine import gemm, rowgemm
from tandem.engine.modeling import CausalLM, load_tokenizer

RUN_CAP = 16


def greedy(lm: CausalLM, prompt: list[int], new: int) -> list[int]:
    cache = lm.new_cache(len(prompt) + new + 1)
    logits, out = lm.forward(prompt, cache, last=1), []
    for _ in range(new):
        out.append(int(logits[-1].argmax()))
        logits = lm.forward(out[-1:], cache, last=1)
    cache.release()
    return out


def load_draft(model: str, dtype: str) -> CausalLM:
    lm = CausalLM(model, threads=1, dtype="int4" if dtype == "int4-all" else dtype, batch_invariant=False)
    if dtype == "int4-all":
        weight = lm.model.get_input_embeddings().weight               # a tied output layer's
        for file in Path(lm.path).glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                if "lm_head.weight" in f.keys():
                    weight = f.get_tensor("lm_head.weight").float()
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        lm.model.set_output_embeddings(gemm.Int4Linear(linear))
    return lm


def measure(lm: CausalLM, runs: list[tuple[str, list[int], list[int]]]) -> dict:
    hits: dict[str, list[int]] = {}
    reach: dict[str, list[int]] = {}
    for kind, prompt, target in runs:
        cache = lm.new_cache(len(prompt) + len(target) + 1)
        agree = [int(a == b) for a, b in zip(lm.forward(prompt + target, cache, last=len(target) + 1)[:-1]
                                             .argmax(-1).tolist(), target)]
        cache.release()
        hits.setdefault(kind, []).extend(agree)
        run = 0
        for hit in reversed(agree):          # the run from a position: one more than the next one's
            run = min(run + 1, RUN_CAP) if hit else 0
            reach.setdefault(kind, []).append(run)
    cache = lm.new_cache(160)
    lm.forward(list(range(100, 228)), cache, last=1)
    steps = []
    for _ in range(30):
        start = time.perf_counter()
        lm.forward([7], cache, last=1)
        steps.append(1000 * (time.perf_counter() - start))
    cache.release()
    return {"agreement": {k: sum(v) / len(v) for k, v in hits.items()},
            "run": {k: sum(v) / len(v) for k, v in reach.items()}, "step_ms": statistics.median(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--target-dtype", default="int8")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtypes", default="", help="comma-separated (default float32,int8 and int4,int4-all where int4 runs)")
    p.add_argument("--prompts", type=int, default=4, help="per prompt set")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="bench/results/agreement.json")
    a = p.parse_args()
    dtypes = a.dtypes.split(",") if a.dtypes else ["float32", "int8", *(["int4", "int4-all"] if rowgemm.int4() else [])]
    target = CausalLM(a.target, threads=2, dtype=a.target_dtype)
    tokenizer = load_tokenizer(a.target)
    runs = []
    for kind, text in prompt_sets(a.prompts):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        prompt = tokenizer(chat, add_special_tokens=False)["input_ids"]
        runs.append((kind, prompt, greedy(target, prompt, a.max_new_tokens)))
    del target
    torch.set_num_threads(1)
    rows = {}
    for dtype in dtypes:
        rows[dtype] = measure(load_draft(a.draft, dtype), runs)
        print(dtype, rows[dtype], flush=True)
    kinds = list(dict.fromkeys(kind for kind, _, _ in runs))
    print(f"\n{a.draft} against {a.target} at {a.target_dtype}, {len(runs)} prompts, {a.max_new_tokens} tokens, "
          "teacher-forced greedy\n")
    print("| draft dtype | " + " | ".join(f"agreement, {k}" for k in kinds) + " | "
          + " | ".join(f"mean run, {k}" for k in kinds) + " | step ms (1 thread) |")
    print("| --- " * (2 * len(kinds) + 2) + "|")
    for dtype, r in rows.items():
        print(f"| {dtype} | " + " | ".join(f"{r['agreement'][k]:.3f}" for k in kinds) + " | "
              + " | ".join(f"{r['run'][k]:.2f}" for k in kinds) + f" | {r['step_ms']:.1f} |")
    write_json(a.out, {"machine": machine(), "args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()

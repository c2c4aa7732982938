"""The trained head, a section of `make bench` (bench/e2e.py):

    .venv/bin/python -m bench.e2e --only head [--quick]

SmolLM2-135M-Instruct as target with the head shipped for it, through the running service: draft
methods `none`, `ngram` and `head`, interleaved prompt by prompt, greedy, on two prompt sets: the
bench's own code prompts (bench/e2e.py PROMPTS) and held-out prompts of tandem/head/prompts.jsonl
(split "heldout": subjects the head never saw in training). Tokens/s, speed-up over `none`,
acceptance and mean accepted length come from the responses' Usage; outputs are compared with
`none`'s. The verify worker serves all three (n-gram drafting comes from a model-free draft worker).

Then, in this process with the service stopped, on the held-out prompts: the head's cost per round
(one head pass over its block, and the verify pass of the positions it proposes, both timed on the
serving engine) and the confidence head's calibration: every round verifies the whole block, and
for each position j the predicted chance that positions 0..j are all accepted (the product of the
confidences) is set against whether they were, in ten bins (expected calibration error per position;
rounds that proposed a prompt lookup instead of the head's block are left out of it).
"""

from __future__ import annotations

import statistics
import time

import grpc

from bench.report import summarize, timed_generate
from tandem.client import build_request
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

TARGET = "smollm2-135m-instruct"
METHODS = ("none", "ngram", "head")


def prompt_sets(bench_prompts: list[str], heldout: int) -> dict[str, list[str]]:
    from tandem.head import prompts
    held = prompts.load("heldout")
    code = [r for r in held if r["kind"] == "code"][:(heldout + 1) // 2]
    chat = [r for r in held if r["kind"] == "chat"][:heldout // 2]
    return {"bench": list(bench_prompts), "heldout": [r["messages"][0]["content"] for r in code + chat]}


def head_section(bench_prompts: list[str], heldout: int, max_new_tokens: int, threads: int,
                 head: str = "shipped", ngram_k: int = 16) -> dict:
    print("head:", flush=True)
    sets = prompt_sets(bench_prompts, heldout)
    runs: dict[str, dict[str, list]] = {name: {m: [] for m in METHODS} for name in sets}
    with Stack(TARGET, "none", threads=threads, verify_args=["--head", head]) as stack, \
            grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for method in METHODS:
            timed_generate(stub, build_request("warm up", chat=True, max_new_tokens=8, method=method))
        for name, texts in sets.items():
            for text in texts:
                for method in METHODS:
                    run, r = timed_generate(stub, build_request(text, chat=True, max_new_tokens=max_new_tokens,
                                                                method=method, k=ngram_k if method == "ngram" else 0))
                    assert r.usage.draft_method == method, (method, r.usage.draft_method)
                    runs[name][method].append(run)
                    print(f"  {name:8s} {method:6s} {run['tok_s']:6.2f} tok/s", flush=True)
    result = {"target": TARGET, "head": head, "max_new_tokens": max_new_tokens, "prompts": sets, "sets": {}}
    for name in sets:
        summary = {m: summarize(runs[name][m]) for m in METHODS}
        for m in METHODS:
            summary[m]["speedup"] = summary[m]["tok_s_total"] / summary["none"]["tok_s_total"]
            summary[m]["speedup_median"] = statistics.median(
                a["tok_s"] / b["tok_s"] for a, b in zip(runs[name][m], runs[name]["none"]))
            summary[m]["output_equals_none"] = sum(a["text"] == b["text"]
                                                   for a, b in zip(runs[name][m], runs[name]["none"]))
        result["sets"][name] = {"summary": summary, "runs": runs[name]}
    result["offline"] = offline(sets["heldout"], head, threads, max_new_tokens)
    return result


def offline(texts: list[str], head: str, threads: int, max_new_tokens: int, bins: int = 10) -> dict:
    """Head cost per round and the confidence head's calibration, in this process (see above)."""
    import torch

    from tandem.engine.modeling import CausalLM, load_tokenizer
    from tandem.head.checkpoint import load_drafter
    from tandem.speculation.sampling import SamplingParams
    from tests.local import open_head_session
    from verify_worker.engine import VerifyEngine
    from verify_worker.headspec import HeadSpeculation

    torch.set_num_threads(threads)
    model = CausalLM(TARGET, threads=threads)
    model.calibrate(17)
    tok = load_tokenizer(TARGET)
    spec = HeadSpeculation(load_drafter(head, model, TARGET), VerifyEngine(model))
    engine, W = spec.engine, spec.drafter.config.block_size
    draft_s, verify_s = [], []
    pred, obs, count = [[0.0] * bins for _ in range(W)], [[0.0] * bins for _ in range(W)], [[0] * bins for _ in range(W)]
    for text in texts:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        s = open_head_session(engine, spec, ids, SamplingParams(max_new_tokens=max_new_tokens), "bench")
        start = time.perf_counter()
        spec.draft(s, s.drafting)
        draft_s.append(time.perf_counter() - start)
        while not s.stop_reason:
            block = s.drafting.proposal
            step, proposed = spec.step(s, s.drafting, k=W)
            start = time.perf_counter()
            rows = model.forward(step.tokens, s.cache, taps=spec.taps)
            verify_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            verdict = step.then(rows)                      # judges, and drafts the next block
            draft_s.append(time.perf_counter() - start)
            if block.ngram:                    # a prompt lookup's, not the confidence head's
                continue
            reach = 1.0
            for j, c in enumerate(block.confidence[:len(proposed)]):
                reach *= c
                b = min(bins - 1, int(reach * bins))
                pred[j][b] += reach
                obs[j][b] += float(verdict.accepted > j)
                count[j][b] += 1
        s.cache.release()
    calibration = []
    for j in range(W):
        n = sum(count[j])
        if not n:
            continue
        calibration.append({"position": j, "rounds": n, "predicted": sum(pred[j]) / n, "observed": sum(obs[j]) / n,
                            "ece": sum(abs(pred[j][b] - obs[j][b]) for b in range(bins)) / n,
                            "bins": [{"bin": b, "n": count[j][b], "predicted": pred[j][b] / count[j][b],
                                      "observed": obs[j][b] / count[j][b]} for b in range(bins) if count[j][b]]})
    return {"head_ms_median": 1000 * statistics.median(draft_s), "verify_ms_median": 1000 * statistics.median(verify_s),
            "plain_step_ms": model.forward_ms[0], "block_size": W, "calibration": calibration}


def print_head(result: dict) -> None:
    for name, part in result["sets"].items():
        print(f"\nhead, {name} prompts ({len(result['prompts'][name])}), {result['target']}, greedy, "
              f"{result['max_new_tokens']} new tokens:")
        print("| method | tokens/s (all prompts) | speed-up (median) | acceptance | mean accepted length | output = none |")
        print("| --- | --- | --- | --- | --- | --- |")
        for m, s in part["summary"].items():
            acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
            mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] is not None else "-"
            print(f"| {m} | {s['tok_s_total']:.2f} | {s['speedup']:.2f}x ({s['speedup_median']:.2f}x) | {acc} | {mal} "
                  f"| {s['output_equals_none']}/{s['runs']} |")
    o = result["offline"]
    print(f"\nround follow-up (verdict, context update, head pass over a block of {o['block_size']}): "
          f"{o['head_ms_median']:.1f} ms; "
          f"verify pass of the whole block: {o['verify_ms_median']:.1f} ms; plain decode step {o['plain_step_ms']:.1f} ms")
    print("\n| position | rounds | predicted reach | observed reach | ECE |")
    print("| --- | --- | --- | --- | --- |")
    for c in o["calibration"]:
        print(f"| {c['position']} | {c['rounds']} | {c['predicted']:.2f} | {c['observed']:.2f} | {c['ece']:.3f} |")

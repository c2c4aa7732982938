"""The trained head, a section of `make bench` (bench/e2e.py):

    .venv/bin/python -m bench.e2e --only head [--quick]

SmolLM2-135M-Instruct as target with the head shipped for it, through the running service: draft
methods `none`, `ngram` and `head` (greedy rounds as trees: the head's chain and its second choices
as leaves, the verify worker's default --head-tree-leaves), and `head-chains` (the head's chains
alone: a second stack, on a Redis of its own, whose verify worker runs --head-tree-leaves 0),
interleaved prompt by prompt, greedy, on two prompt sets: the
bench's own code prompts (bench/e2e.py PROMPTS) and held-out prompts of tandem/head/prompts.jsonl
(split "heldout": subjects the head never saw in training), every family in turn
(tandem.head.prompts.stratified: prompts the trainer evaluates on, none it fits its calibration
on). Tokens/s, speed-up over `none`, acceptance and mean accepted length come from the responses'
Usage; outputs are compared with `none`'s. The verify worker serves all three (n-gram drafting
comes from a model-free draft worker).

Then the same methods under load: `streams` requests at once (the held-out and bench prompts in
turn), each method's batch in turn, the order reversed every other pass: tokens/s is all the
batch's tokens over its wall time, and each output is compared with `none`'s for its prompt.

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
from concurrent.futures import ThreadPoolExecutor

import grpc

from bench.report import summarize, timed_generate
from tandem.client import build_request
from tandem.cluster.redis_conn import RedisServer
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

TARGET = "smollm2-135m-instruct"
METHODS = ("none", "ngram", "head", "head-chains")
CHAINS = "head-chains"       # draft method head on the stack whose verify worker proposes chains only


def prompt_sets(bench_prompts: list[str], heldout: int) -> dict[str, list[str]]:
    from tandem.head import prompts
    held = prompts.stratified(prompts.load("heldout"), heldout)
    return {"bench": list(bench_prompts), "heldout": [r["messages"][0]["content"] for r in held]}


def head_section(bench_prompts: list[str], heldout: int, max_new_tokens: int, threads: int,
                 head: str = "shipped", ngram_k: int = 16, streams: int = 16, passes: int = 2,
                 load_only: bool = False) -> dict:
    """load_only: just the part under load (no one-stream runs, no offline part)."""
    print("head:", flush=True)
    sets = prompt_sets(bench_prompts, heldout)
    runs: dict[str, dict[str, list]] = {name: {m: [] for m in METHODS} for name in sets}
    chains_redis = RedisServer().start()
    try:
        with Stack(TARGET, "none", threads=threads, verify_args=["--head", head]) as stack, \
                Stack(TARGET, "none", threads=threads, redis_url=chains_redis.url,
                      verify_args=["--head", head, "--head-tree-leaves", "0"]) as chains, \
                grpc.insecure_channel(stack.address("gateway")) as ch, \
                grpc.insecure_channel(chains.address("gateway")) as chains_ch:
            stubs = {m: pb_grpc.GenerationServiceStub(chains_ch if m == CHAINS else ch) for m in METHODS}
            for method in METHODS:
                timed_generate(stubs[method], request("warm up", method, 8, ngram_k))
            for name, texts in ({} if load_only else sets).items():
                for text in texts:
                    for method in METHODS:
                        run, r = timed_generate(stubs[method], request(text, method, max_new_tokens, ngram_k))
                        assert r.usage.draft_method == served(method), (method, r.usage.draft_method)
                        runs[name][method].append(run)
                        print(f"  {name:8s} {method:11s} {run['tok_s']:6.2f} tok/s", flush=True)
            texts = sets["heldout"] + sets["bench"]
            loaded = under_load(stubs, texts, streams, passes, max_new_tokens, ngram_k) if streams else None
    finally:
        chains_redis.stop()
    result = {"target": TARGET, "head": head, "max_new_tokens": max_new_tokens, "prompts": sets, "sets": {},
              "under_load": loaded}
    for name in () if load_only else sets:
        summary = {m: summarize(runs[name][m]) for m in METHODS}
        for m in METHODS:
            summary[m]["speedup"] = summary[m]["tok_s_total"] / summary["none"]["tok_s_total"]
            summary[m]["speedup_median"] = statistics.median(
                a["tok_s"] / b["tok_s"] for a, b in zip(runs[name][m], runs[name]["none"]))
            summary[m]["output_equals_none"] = sum(a["text"] == b["text"]
                                                   for a, b in zip(runs[name][m], runs[name]["none"]))
        result["sets"][name] = {"summary": summary, "runs": runs[name], "trees_vs_chains": {
            "total": summary["head"]["tok_s_total"] / summary[CHAINS]["tok_s_total"],
            "median": statistics.median(a["tok_s"] / b["tok_s"] for a, b in zip(runs[name]["head"], runs[name][CHAINS]))}}
    result["offline"] = None if load_only else offline(sets["heldout"], head, threads, max_new_tokens)
    return result


def served(method: str) -> str:
    """The draft method a bench method asks its stack for."""
    return "head" if method == CHAINS else method


def request(text: str, method: str, max_new_tokens: int, ngram_k: int):
    return build_request(text, chat=True, max_new_tokens=max_new_tokens, method=served(method),
                         k=ngram_k if method == "ngram" else 0)


def under_load(stubs: dict, texts: list[str], streams: int, passes: int, max_new_tokens: int, ngram_k: int) -> dict:
    """Each method's `streams` requests at once, `passes` times (see the module's docstring)."""
    chosen = [texts[i % len(texts)] for i in range(streams)]
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    with ThreadPoolExecutor(streams) as pool:
        for n in range(passes):
            for method in METHODS if n % 2 == 0 else METHODS[::-1]:
                reqs = [request(t, method, max_new_tokens, ngram_k) for t in chosen]
                start = time.perf_counter()
                done = list(pool.map(lambda r: timed_generate(stubs[method], r)[0], reqs))
                wall = time.perf_counter() - start
                tokens, rounds = sum(d["tokens"] for d in done), sum(d["rounds"] for d in done)
                runs[method].append({"tok_s": tokens / wall, "tokens": tokens, "rounds": rounds, "wall": wall,
                                     "texts": [d["text"] for d in done]})
                print(f"  {streams} streams {method:11s} {tokens / wall:7.2f} tok/s", flush=True)
    out = {}
    for m, rs in runs.items():
        tokens, wall, rounds = (sum(r[k] for r in rs) for k in ("tokens", "wall", "rounds"))
        out[m] = {"tok_s": tokens / wall, "tokens_per_round": tokens / rounds if rounds else None,
                  "vs_none": [r["tok_s"] / b["tok_s"] for r, b in zip(rs, runs["none"])],
                  "outputs_equal_none": sum(mine == plain for r, base in zip(rs, runs["none"])
                                            for mine, plain in zip(r["texts"], base["texts"])),
                  "outputs": sum(len(r["texts"]) for r in rs)}
    return {"streams": streams, "passes": passes, "methods": out}


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
    spec = HeadSpeculation(load_drafter(head, model, TARGET), VerifyEngine(model), leaves=0)   # the chains' reach
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
        print("| method | tokens/s (all prompts) | speed-up (median) | acceptance | mean accepted length "
              "| proposed per round | output = none |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for m, s in part["summary"].items():
            acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
            mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] is not None else "-"
            nodes = f"{s['nodes_per_round']:.2f}" if s["nodes_per_round"] is not None else "-"
            print(f"| {m} | {s['tok_s_total']:.2f} | {s['speedup']:.2f}x ({s['speedup_median']:.2f}x) | {acc} | {mal} "
                  f"| {nodes} | {s['output_equals_none']}/{s['runs']} |")
        t = part["trees_vs_chains"]
        print(f"head (trees) against head-chains: {t['total']:.2f}x (median per prompt {t['median']:.2f}x)")
    if (load := result.get("under_load")):
        print(f"\nhead, {load['streams']} concurrent streams (held-out and bench prompts in turn), "
              f"{load['passes']} passes:")
        print("| method | tokens/s | vs none, per pass | tokens per round | output = none |")
        print("| --- | --- | --- | --- | --- |")
        for m, s in load["methods"].items():
            tpr = f"{s['tokens_per_round']:.2f}" if s["tokens_per_round"] else "-"
            print(f"| {m} | {s['tok_s']:.2f} | {', '.join(f'{x:.2f}x' for x in s['vs_none'])} | {tpr} "
                  f"| {s['outputs_equal_none']}/{s['outputs']} |")
    if (o := result["offline"]) is None:
        return
    print(f"\nround follow-up (verdict, context update, head pass over a block of {o['block_size']}): "
          f"{o['head_ms_median']:.1f} ms; "
          f"verify pass of the whole block: {o['verify_ms_median']:.1f} ms; plain decode step {o['plain_step_ms']:.1f} ms")
    print("\n| position | rounds | predicted reach | observed reach | ECE |")
    print("| --- | --- | --- | --- | --- |")
    for c in o["calibration"]:
        print(f"| {c['position']} | {c['rounds']} | {c['predicted']:.2f} | {c['observed']:.2f} | {c['ece']:.3f} |")

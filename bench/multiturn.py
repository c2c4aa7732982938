"""Second-turn time to first token: the session's KV cache kept warm on its verify worker vs. evicted
(rebuilt from the token history in Redis), interleaved warm, evicted, warm, ... after a warm-up.

Each pair: a first turn with a long prompt (--history-tokens); then either the second turn at once
(warm: only its new tokens are prefilled), or a same-sized turn of another session first, which
evicts the idle session from the verify worker's KV budget, then the second turn (evicted: the whole
history is prefilled again). Prints a table and writes bench/results/multiturn.json.

    python -m bench.multiturn                     # SmolLM2-135M-Instruct target, verify-only decoding
    python -m bench.multiturn --tiny --reps 3     # tiny random models: a smoke run in seconds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import grpc

from bench.report import machine, write_json
from tandem.client import build_request
from tandem.cluster.redis_conn import RedisServer
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

TEXT = ("def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
        "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
        "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n\n")
QUESTION = "\n# What does merge return for two empty lists?\n"


def long_prompt(tok, tokens: int) -> str:
    reps = max(1, tokens // len(tok(TEXT).input_ids))
    return TEXT * reps


def ttft(stub, prompt: str, session: str, n: int, method: str) -> tuple[float, int]:
    """(seconds to the first streamed token, prompt tokens whose KV was reused)."""
    req = build_request(prompt, max_new_tokens=n, method=method, session_id=session)
    start = time.perf_counter()
    first = None
    for msg in stub.GenerateStream(req, timeout=1800):
        if first is None and msg.token_count:
            first = time.perf_counter() - start
    return first, msg.usage.cached_prompt_tokens


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.multiturn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--tiny", action="store_true", help="tiny random models instead of --target")
    p.add_argument("--history-tokens", type=int, default=1500, help="about how long the first turn is")
    p.add_argument("--new-tokens", type=int, default=8, help="generated per turn")
    p.add_argument("--method", default="none", help="draft method for every turn")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/multiturn.json")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer
    tmp = tempfile.TemporaryDirectory()
    target = a.target
    if a.tiny:
        from tandem.testing import build_tiny_model
        target = str(build_tiny_model(Path(tmp.name) / "target"))
        a.history_tokens = min(a.history_tokens, 300)
    from tandem.presets import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(target))
    history = long_prompt(tok, a.history_tokens)
    need = len(tok(history).input_ids) + len(tok(QUESTION).input_ids) + 2 * a.new_tokens
    budget = need * 3 // 2        # room for one conversation, not two: the next one evicts the idle one

    redis = RedisServer().start()
    rows: dict[str, list[float]] = {"warm": [], "evicted": []}
    cached: dict[str, list[int]] = {"warm": [], "evicted": []}
    try:
        with Stack(target, "none", threads=a.threads, redis_url=redis.url,
                   verify_args=["--kv-budget-tokens", str(budget)]) as stack, \
                grpc.insecure_channel(stack.address("gateway")) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            for rep in range(a.reps + 1):                 # rep 0 warms up and is not counted
                for case in ("warm", "evicted"):
                    session = uuid.uuid4().hex
                    ttft(stub, history, session, a.new_tokens, a.method)
                    if case == "evicted":
                        ttft(stub, history, uuid.uuid4().hex, a.new_tokens, a.method)
                    seconds, reused = ttft(stub, QUESTION, session, a.new_tokens, a.method)
                    if rep:
                        rows[case].append(seconds)
                        cached[case].append(reused)
    finally:
        redis.stop()
        tmp.cleanup()

    result = {
        "target": "tiny" if a.tiny else a.target, "history_tokens": need - len(tok(QUESTION).input_ids)
        - 2 * a.new_tokens, "new_tokens": a.new_tokens, "method": a.method, "kv_budget_tokens": budget,
        "threads": a.threads, "machine": machine(),
        "ttft_s": {case: spread(xs) for case, xs in rows.items()},
        "cached_prompt_tokens": cached,
    }
    w, e = result["ttft_s"]["warm"], result["ttft_s"]["evicted"]
    print(f"\nsecond-turn TTFT, {result['target']}, history {result['history_tokens']} tokens, "
          f"method {a.method}, {a.reps} interleaved pairs\n")
    print("| second turn | TTFT median (min–max) | prompt tokens reused |")
    print("| --- | --- | --- |")
    for case, s in (("KV cache warm", w), ("KV cache evicted", e)):
        reused = cached["warm" if "warm" in case else "evicted"]
        print(f"| {case} | {s['median'] * 1000:.0f} ms ({s['min'] * 1000:.0f}–{s['max'] * 1000:.0f}) | "
              f"{statistics.median(reused):.0f} |")
    print(f"\nevicted / warm: {e['median'] / w['median']:.1f}x")
    write_json(a.out, result)


if __name__ == "__main__":
    main()

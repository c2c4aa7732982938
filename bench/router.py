"""Through the SMG router, a section of `make bench` (bench/e2e.py):

    .venv/bin/python -m bench.e2e --only router [--quick]

SmolLM2-135M-Instruct with n-gram drafting (the gateway's default method here; the router cannot
choose one), greedy chat requests: the same prompts through Tandem's native face (tandem.v1, chat
input) and through the real SMG router's OpenAI API (the `openai` client; SMG renders the chat
template, tokenizes and reaches the gateway's vLLM engine face), taking turns prompt by prompt, at
1 stream and at several concurrent streams (each prompt sent by every stream at once). Reports tokens/s of each path, the ratio, and the router hop's cost per
request (the median, over prompts, of the difference in latency at one stream). A small model
makes the hop's share of a request as large as it gets. Outputs are compared between the paths.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from tandem.client import build_request
from tandem.launch import Stack
from tandem.router import SmgRouter
from tandem.v1 import generation_pb2_grpc as pb_grpc

TARGET = "smollm2-135m-instruct"
PATHS = ("native", "smg")


def _native(stub, prompt: str, n: int) -> dict:
    start = time.perf_counter()
    r = stub.Generate(build_request(prompt, chat=True, max_new_tokens=n, method="ngram"), timeout=600)
    return {"seconds": time.perf_counter() - start, "tokens": r.usage.generated_tokens, "text": r.text}


def _smg(client, model: str, prompt: str, n: int) -> dict:
    start = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=n,
                                       temperature=0)
    return {"seconds": time.perf_counter() - start, "tokens": r.usage.completion_tokens,
            "text": r.choices[0].message.content}


def router_section(prompts: list[str], max_new_tokens: int, threads: int, streams: tuple[int, ...] = (1, 4)) -> dict:
    import openai
    print("router:", flush=True)
    result: dict = {"target": TARGET, "method": "ngram", "max_new_tokens": max_new_tokens, "prompts": prompts,
                    "by_streams": {}}
    with Stack(TARGET, "none", threads=threads, gateway_args=["--default-draft-method", "ngram"]) as stack, \
            SmgRouter(stack.address("gateway")) as router, \
            grpc.insecure_channel(stack.address("gateway")) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        client = openai.OpenAI(base_url=router.url, api_key="unused", max_retries=0, timeout=600)
        run = {"native": lambda p: _native(stub, p, max_new_tokens),
               "smg": lambda p: _smg(client, router.model, p, max_new_tokens)}
        for prompt in ["warm up", *prompts]:     # each prompt's prefix cached alike for both paths
            for path in PATHS:
                run[path](prompt)
        for n in streams:
            row: dict = {path: {"tokens": 0, "seconds": 0.0, "runs": []} for path in PATHS}
            # A batch is each prompt once per stream, all at once; the paths take turns batch by
            # batch, in alternating order, so that neither is measured on a quieter machine.
            for i, prompt in enumerate(prompts):
                for path in (PATHS if i % 2 == 0 else PATHS[::-1]):
                    with ThreadPoolExecutor(n) as pool:
                        start = time.perf_counter()
                        runs = list(pool.map(run[path], [prompt] * n))
                        wall = time.perf_counter() - start
                    row[path]["tokens"] += sum(r["tokens"] for r in runs)
                    row[path]["seconds"] += wall
                    row[path]["runs"] += runs
            for path in PATHS:
                row[path]["tok_s"] = row[path]["tokens"] / row[path]["seconds"]
                print(f"  {n} stream(s) {path:6s} {row[path]['tok_s']:7.2f} tok/s", flush=True)
            row["ratio"] = row["smg"]["tok_s"] / row["native"]["tok_s"]
            row["same_text"] = sum(a["text"] == b["text"] for a, b in zip(row["native"]["runs"], row["smg"]["runs"]))
            if n == 1:
                hop = [(b["seconds"] - a["seconds"]) * 1000 for a, b in zip(row["native"]["runs"], row["smg"]["runs"])]
                row["hop_ms_median"] = statistics.median(hop)
                row["request_ms_median"] = statistics.median(r["seconds"] * 1000 for r in row["native"]["runs"])
            result["by_streams"][str(n)] = row
    return result


def print_router(r: dict) -> None:
    print(f"\nthrough the SMG router ({r['target']}, {r['method']}, greedy, {r['max_new_tokens']} new tokens, "
          f"{len(r['prompts'])} prompts)")
    print("| streams | native tokens/s | through SMG tokens/s | SMG / native | same text |")
    print("| --- | --- | --- | --- | --- |")
    for n, row in r["by_streams"].items():
        print(f"| {n} | {row['native']['tok_s']:.2f} | {row['smg']['tok_s']:.2f} | {row['ratio']:.2f}x | "
              f"{row['same_text']}/{len(row['native']['runs'])} |")
    one = r["by_streams"].get("1")
    if one:
        print(f"router hop at one stream: median {one['hop_ms_median']:.1f} ms per request "
              f"(a request takes {one['request_ms_median']:.0f} ms on the native face)")

"""What every benchmark records with its figures: the machine it ran on, and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch


# the CPU features that decide which kernels a dtype gets (tandem.engine.gemm)
FEATURES = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def machine() -> dict:
    from tandem.engine import gemm, rowgemm
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu": model, "cpu_features": [f for f in FEATURES if f in flags], "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "kernel": rowgemm.isa(), "int8_kernel": rowgemm.int8_isa(),
            "onednn_bfloat16_kernels": gemm.bfloat16_kernels(),
            "int8_weight_bits": gemm.int8_weight_bits()}


def fill_defaults(args, quick: dict, full: dict) -> None:
    """Each option left unset (None) takes its value from `quick` when --quick was given, else from `full`."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def write_json(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


def timed_generate(stub, req) -> tuple[dict, object]:
    start = time.perf_counter()
    r = stub.Generate(req, timeout=1800)
    wall = time.perf_counter() - start
    u = r.usage
    return {"tokens": u.generated_tokens, "seconds": wall, "tok_s": u.generated_tokens / wall,
            "drafted": u.draft_tokens, "accepted": u.accepted_tokens, "rounds": u.verify_rounds,
            "forced": u.forced_tokens, "forced_accepted": u.forced_accepted_tokens, "text": r.text}, r


def timed_stream(stub, req) -> dict:
    """timed_generate's figures through GenerateStream, with the decoding apart from the prompt:
    `decode_tokens` are the tokens after the first message, `decode_seconds` the time from the
    first message to the last (as llama.cpp times its generation: prompt processing and the token
    it yields apart)."""
    start = time.perf_counter()
    first, text, last = None, [], None
    first_tokens = 0
    for msg in stub.GenerateStream(req, timeout=1800):
        if msg.token_count and first is None:
            first, first_tokens = time.perf_counter(), msg.token_count
        text.append(msg.text)
        last = msg
    end = time.perf_counter()
    u = last.usage
    return {"tokens": u.generated_tokens, "seconds": end - start, "rounds": u.verify_rounds, "text": "".join(text),
            "decode_tokens": u.generated_tokens - first_tokens, "decode_seconds": end - (first or end)}


def summarize(runs: list[dict]) -> dict:
    rates = [r["tok_s"] for r in runs]
    drafted = sum(r.get("drafted", 0) for r in runs)
    accepted = sum(r.get("accepted", 0) for r in runs)
    rounds = sum(r.get("rounds", 0) for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    return {"tok_s_median": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
            "tok_s_total": tokens / sum(r["seconds"] for r in runs),
            "acceptance": accepted / drafted if drafted else None,
            "forced": sum(r.get("forced", 0) for r in runs), "forced_accepted": sum(r.get("forced_accepted", 0) for r in runs),
            "mean_accepted_length": tokens / rounds if rounds else None,
            "nodes_per_round": drafted / rounds if rounds else None, "runs": len(runs)}

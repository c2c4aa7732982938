"""make bench-precision: the target at each precision Tandem serves it in, plain and speculative,
beside llama.cpp (the peers section of `make bench`), in one run.

Tandem: two stacks per target dtype (tandem.launch.Stack, --dtype float32, bfloat16, int8 on the
verify worker), one stream, greedy, the chat prompts of bench/e2e.py: one without a draft model
serving draft methods none (plain decoding) and ngram, as a deployment without a draft pool runs
them, and one with the Qwen pair's 0.5B draft (its own dtype int8) on the same cores, serving
model. tokens/s is end to end through the gateway (prompt included). Each speculative row's
outputs are compared with the plain row's at the same dtype: with batch-invariant numerics they
must be equal (tandem.engine.gemm), and a difference is reported loudly.

llama.cpp (bench/llamacpp.py; built once from the sources on PyPI and cached; skipped with a message
when it cannot be built): the same weights converted by its own convert_hf_to_gguf.py to f32 and
q8_0, plain and with the q8_0 0.5B draft, 2 threads, the same prompts with the same chat template
applied. Its tokens/s is its own generation rate (prompt processing apart).

    python -m bench.precision             # 4 prompts, 96 tokens
    python -m bench.precision --quick     # 1 prompt, 24 tokens, float32 and int8 only
    python -m bench.precision --draft-vocab 32768   # and the draft scoring part of its vocabulary
"""

from __future__ import annotations

import argparse
import time

import grpc

from bench.e2e import PROMPTS
from bench.report import fill_defaults, machine, timed_generate, write_json
from tandem.client import build_request
from tandem.engine.modeling import load_tokenizer, resolve
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

FULL = {"prompts": len(PROMPTS), "max_new_tokens": 96, "dtypes": "float32,bfloat16,int8"}
QUICK = {"prompts": 1, "max_new_tokens": 24, "dtypes": "float32,int8"}
METHODS = ("none", "model", "ngram")
LLAMA = {"float32": "f32", "int8": "q8_0"}       # llama.cpp's precision beside each of Tandem's


def tandem_rows(a, dtype: str, prompts: list[str]) -> dict:
    rows = {}
    # Each method as a deployment of it runs: plain decoding and prompt lookup with no draft model
    # (the verify worker then has the cores to itself and spins for OpenMP work, tandem.launch),
    # the draft model beside the target on the same cores.
    # With --draft-vocab, the draft model again from a stack whose draft scores part of its vocabulary.
    layouts = [("none", ("none", "ngram"), []), (a.draft, ("model",), [])]
    if a.draft_vocab:
        layouts.append((a.draft, ("model",), ["--draft-vocab", str(a.draft_vocab)]))
    for draft, methods, draft_args in layouts:
        with Stack(a.target, draft, threads=a.threads, verify_args=["--dtype", dtype], draft_args=draft_args) as stack, \
                grpc.insecure_channel(stack.address("gateway")) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            for method in methods:
                row = f"{method}, vocab {a.draft_vocab}" if draft_args else method
                timed_generate(stub, build_request("warm up", chat=True, max_new_tokens=8, method=method))
                runs = [timed_generate(stub, build_request(p, chat=True, max_new_tokens=a.max_new_tokens,
                                                           method=method))[0] for p in prompts]
                tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
                rounds = sum(r["rounds"] for r in runs)
                rows[row] = {"tok_s": tokens / seconds, "tokens": tokens,
                             "tokens_per_round": tokens / rounds if rounds else None,
                             "texts": [r["text"] for r in runs]}
                print(f"  tandem {dtype:8s} {row:5s}: {rows[row]['tok_s']:.2f} tok/s", flush=True)
    return {row: rows[row] for row in (*METHODS, *(r for r in rows if r not in METHODS))}


def llama_rows(a, prompts: list[str]) -> dict | str:
    from bench import llamacpp
    bin_dir = llamacpp.build()
    if bin_dir is None:
        return "llama.cpp is not built here and could not be built (see the log above)"
    tok = load_tokenizer(a.target)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    draft = llamacpp.gguf(resolve(a.draft), "q8_0")
    rows = {}
    for precision in (LLAMA[d] for d in a.dtypes.split(",") if d in LLAMA):   # the precisions asked for
        model = llamacpp.gguf(resolve(a.target), precision)
        for method, assistant in (("none", None), ("model", draft)):
            try:
                runs = [llamacpp.generate(bin_dir, model, t, a.max_new_tokens, threads=a.threads,
                                          draft_gguf=assistant) for t in texts]
            except RuntimeError as e:                  # a peer's crash costs its row, not the run
                rows[f"{precision}/{method}"] = {"error": str(e).splitlines()[0]}
                print(f"  llama.cpp {precision:5s} {method:5s}: failed: {rows[f'{precision}/{method}']['error']}",
                      flush=True)
                continue
            tokens = sum(r["tokens"] for r in runs)
            rows[f"{precision}/{method}"] = {"tok_s": tokens / sum(r["tokens"] / r["gen_tokens_per_s"] for r in runs),
                                             "tokens": tokens, "texts": [r["text"] for r in runs]}
            print(f"  llama.cpp {precision:5s} {method:5s}: {rows[f'{precision}/{method}']['tok_s']:.2f} tok/s",
                  flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=2, help="torch (and llama.cpp) threads per process")
    p.add_argument("--prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--dtypes", help="comma-separated target dtypes")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="also serve the draft model scoring this many token ids (draft_worker --draft-vocab)")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/precision.json")
    a = p.parse_args(argv)
    fill_defaults(a, QUICK, FULL)
    prompts = PROMPTS[:a.prompts]
    m = machine()
    print(f"{m['cpu']} ({', '.join(m['cpu_features']) or 'no listed features'}): "
          f"Tandem's kernel on {m['kernel']}, int8 on {m['int8_kernel']}, int8 weights in {m['int8_weight_bits']} bits",
          flush=True)
    result = {"machine": m, "setup": {k: getattr(a, k) for k in ("target", "draft", "threads", "prompts",
                                                                         "max_new_tokens", "dtypes", "draft_vocab")}}
    start = time.perf_counter()
    tandem = {dtype: tandem_rows(a, dtype, prompts) for dtype in a.dtypes.split(",")}
    llama = "skipped (--no-llama)" if a.no_llama else llama_rows(a, prompts)
    result.update(tandem=tandem, llama_cpp=llama, seconds=time.perf_counter() - start)
    print("\n| engine | precision | drafting | tokens/s | vs llama.cpp plain, same precision | output = its own plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    problems = []

    def line(engine: str, precision: str, method: str, row: dict, plain: dict, peer: dict | None) -> None:
        # llama.cpp's speculative binary may run past the token budget by a round: its prefix counts
        same = all(t == p or (engine == "llama.cpp" and t.startswith(p)) for t, p in zip(row["texts"], plain["texts"]))
        row["equals_plain"] = same
        if not same:
            problems.append(f"{engine} {precision} {method}: output differs from its plain decoding")
        vs = f"{row['tok_s'] / peer['tok_s']:.2f}x" if peer else "–"
        print(f"| {engine} | {precision} | {method} | {row['tok_s']:.2f} | {vs} | {'yes' if same else 'NO'} |")

    ran = {k: r for k, r in llama.items() if "error" not in r} if isinstance(llama, dict) else {}
    for dtype, rows in tandem.items():
        peer = ran.get(f"{LLAMA[dtype]}/none") if dtype in LLAMA else None
        for method, row in rows.items():
            line("Tandem", dtype, method, row, rows["none"], peer)
    if ran:
        for key, row in llama.items():
            precision, method = key.split("/")
            if key not in ran or f"{precision}/none" not in ran:
                print(f"| llama.cpp | {precision} | {method} | failed: {row.get('error', 'no plain row')} | – | – |")
                continue
            line("llama.cpp", precision, method, row, ran[f"{precision}/none"], ran[f"{precision}/none"])
        best_llama = max(r["tok_s"] for r in ran.values())
        best_tandem = max(r["tok_s"] for rows in tandem.values() for r in rows.values())
        result["best_tandem_vs_best_llama_cpp"] = best_tandem / best_llama
        print(f"\nbest Tandem row against llama.cpp's best: {best_tandem / best_llama:.2f}x")
    else:
        print(f"\nllama.cpp: {llama}")
    for problem in problems:
        print("WARNING:", problem)
    for row in [r for rows in tandem.values() for r in rows.values()] + [*ran.values()]:
        del row["texts"]
    write_json(a.out, result)


if __name__ == "__main__":
    main()

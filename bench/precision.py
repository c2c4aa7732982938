"""make bench-precision: the target at each precision Tandem serves it in, plain and speculative,
beside llama.cpp (the peers section of `make bench`), in one run.

Tandem: stacks per target dtype (tandem.launch.Stack, --dtype float32, bfloat16, int8 on the
verify worker), one stream, greedy, the chat prompts of bench/e2e.py: draft methods none (plain
decoding) and ngram as a deployment without a draft pool runs them, and model with the Qwen pair's
0.5B draft at each --draft-dtypes (int8, and int4 where the CPU runs it) on the same cores.
Requests stream (GenerateStream): a row's decoding tokens/s are its tokens after the first message
over the time from that message to the last, as llama.cpp reports its own, and the ratios to
llama.cpp are taken on them; its end-to-end tokens/s (the prompt's processing and the gateway
included) are shown beside, and the share of that time the target's and the draft's inference
threads were busy (their tandem_inference_busy_seconds_total). Each speculative row's outputs are
compared with the plain row's at the same dtype: with batch-invariant numerics they
must be equal (tandem.engine.gemm), and a difference is reported loudly.

llama.cpp (bench/llamacpp.py; built once from the sources on PyPI and cached; skipped with a message
when it cannot be built): the same weights converted by its own convert_hf_to_gguf.py to f32 and
q8_0, plain and with the q8_0 0.5B draft, 2 threads, the same prompts with the same chat template
applied, and with the draft at q4_0 beside Tandem's int4 draft. Its tokens/s is its own
generation rate (prompt processing apart).

The rows of one precision run interleaved: Tandem's rows in two phases (plain decoding and prompt
lookup from a stack without a draft model, then the draft model's from a stack with it; one
target in memory at a time), and in each phase every prompt goes to every row, Tandem's and
llama.cpp's, before the next prompt, so that a host whose speed drifts during the run (seen up to
2x here) moves every row alike and the ratios between rows stay fair. llama.cpp's rows run in both
phases, their runs counted together. A second table gives each row's tokens/s per prompt.

    python -m bench.precision             # 4 prompts, 96 tokens
    python -m bench.precision --quick     # 1 prompt, 24 tokens, float32 and int8 only
    python -m bench.precision --draft-vocab 32768   # and the draft scoring part of its vocabulary
    python -m bench.precision --dtypes int8 --repeats 3  # 8 bits only, each prompt three times
    python -m bench.precision --draft-threads 1,2   # each draft on one thread and on two
"""

from __future__ import annotations

import argparse
import contextlib
import time
from functools import partial
from urllib.parse import urlsplit, urlunsplit

import grpc

from bench import llamacpp
from bench.e2e import PROMPTS
from bench.load import scrape
from bench.report import fill_defaults, machine, timed_generate, timed_stream, write_json
from bench.topology import BUSY
from tandem.client import build_request
from tandem.cluster.redis_conn import ensure_redis
from tandem.engine import rowgemm
from tandem.engine.modeling import load_tokenizer, resolve
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

FULL = {"prompts": len(PROMPTS), "max_new_tokens": 96, "dtypes": "float32,bfloat16,int8"}
QUICK = {"prompts": 1, "max_new_tokens": 24, "dtypes": "float32,int8"}
# llama.cpp's precision beside each of Tandem's (int4: groups of 64 with a float32 scale each;
# q4_0: groups of 32 with a float16 scale, as llama-quantize makes it)
LLAMA = {"float32": "f32", "int8": "q8_0", "int4": "q4_0"}
KV_TOKENS = 8192        # each bench verify worker's KV pool: room for its calibration and one stream


def redis_db(url: str, db: int) -> str:
    """`url` with its database number set to `db`: the bench's registry apart from any other
    stack's on the same Redis."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{db}"))


def tandem_run(stub, method: str, n_new: int, workers: dict[str, str], prompt: str) -> dict:
    """One request, and the seconds each of `workers` ({"target": metrics URL, "draft": ...}) spent
    in its inference thread meanwhile: one request at a time, so they are all this request's."""
    def busy() -> dict[str, float | None]:
        return {k: scrape(url, "counter").get(BUSY) for k, url in workers.items()}
    before = busy()
    run = timed_stream(stub, build_request(prompt, chat=True, max_new_tokens=n_new, method=method))
    after = busy()
    run["busy"] = {k: after[k] - v for k, v in before.items() if None not in (v, after[k])}
    return run


def tandem_phases(a, dtype: str, redis_url: str) -> list:
    """Tandem's rows at `dtype` in two phases, one stack each, so that one target is in memory at a
    time (two float32 targets and llama.cpp's do not fit in 24 GiB): plain decoding and prompt
    lookup from a stack with no draft model (its verify worker has the cores to itself and spins
    for OpenMP work, tandem.launch), as a deployment without a draft pool runs them; then the
    draft model at each draft dtype (and scoring part of its vocabulary with --draft-vocab) beside
    the target on the same cores, each draft worker reached through a gateway of its own. Each
    phase is a function of an ExitStack that returns its rows, each a function of a prompt."""
    verify_args = ["--dtype", dtype, "--kv-budget-tokens", str(KV_TOKENS)]

    def plain(opened: contextlib.ExitStack) -> dict:
        stack = opened.enter_context(Stack(a.target, "none", threads=a.threads, verify_args=verify_args,
                                           redis_url=redis_db(redis_url, 1)))
        return engines(opened, stack, [("none", "none", "gateway", None), ("ngram", "ngram", "gateway", None)])

    def drafted(opened: contextlib.ExitStack) -> dict:
        stack = opened.enter_context(Stack(a.target, a.draft, threads=a.threads, draft_workers=0,
                                           verify_args=verify_args, redis_url=redis_db(redis_url, 2)))
        drafts = [(("model" if d == "int8" else f"model, {d} draft") + ("" if t == "1" else f", {t} threads"),
                   ["--dtype", d, "--threads", t]) for d in a.draft_dtypes.split(",") for t in a.draft_threads.split(",")]
        if a.draft_vocab:
            drafts.append((f"model, vocab {a.draft_vocab}", ["--draft-vocab", str(a.draft_vocab)]))
        verify, rows = stack.address("verify_worker"), []
        for row, flags in drafts:
            draft = stack.add_worker("draft_worker", extra_args=flags)
            rows.append((row, "model", stack.add_gateway(["--verify-workers", verify, "--draft-workers",
                                                          stack.address(draft)]), draft))
        return engines(opened, stack, rows)

    def engines(opened: contextlib.ExitStack, stack: Stack, rows: list) -> dict:
        out = {}
        for row, method, gateway, draft in rows:
            stub = pb_grpc.GenerationServiceStub(opened.enter_context(grpc.insecure_channel(stack.address(gateway))))
            timed_generate(stub, build_request("warm up", chat=True, max_new_tokens=8, method=method))
            workers = {"target": stack.metrics_url("verify_worker"), **({"draft": stack.metrics_url(draft)} if draft else {})}
            out[("Tandem", dtype, row)] = partial(tandem_run, stub, method, a.max_new_tokens, workers)
        return out

    return [plain, drafted]


def llama_run(bin_dir, model, draft, n_new: int, threads: int, text: str) -> dict:
    run = llamacpp.generate(bin_dir, model, text, n_new, threads=threads, draft_gguf=draft)
    seconds = run["tokens"] / run["gen_tokens_per_s"]   # its own rate (its wall time holds the model's loading)
    return {"tokens": run["tokens"], "seconds": seconds, "rounds": 0, "text": run["text"],
            "decode_tokens": run["tokens"], "decode_seconds": seconds}


def llama_engines(a, dtype: str, bin_dir) -> dict:
    """llama.cpp's rows at Tandem's `dtype` (none where it has no such precision): plain and with
    the draft at each draft precision asked for (q8_0 for Tandem's int8 draft, q4_0 for int4),
    each a function of a prompt already put in the target's chat template."""
    if dtype not in LLAMA or bin_dir is None:
        return {}
    model = llamacpp.gguf(resolve(a.target), LLAMA[dtype])
    engines = {("llama.cpp", LLAMA[dtype], "none"): partial(llama_run, bin_dir, model, None, a.max_new_tokens,
                                                            a.threads)}
    for d in a.draft_dtypes.split(","):
        draft = llamacpp.gguf(resolve(a.draft), LLAMA[d])
        row = "model" if d == "int8" else f"model, {LLAMA[d]} draft"
        engines[("llama.cpp", LLAMA[dtype], row)] = partial(llama_run, bin_dir, model, draft, a.max_new_tokens,
                                                            a.threads)
    return engines


def interleaved(engines: dict, prompts: list[str], chat_texts: list[str], repeats: int) -> dict:
    """Every engine on every prompt, `repeats` times, one prompt at a time: each prompt goes to all
    engines before the next one, their order turned by one each time, so a drift of the host's
    speed falls on every row alike. A row whose engine fails keeps the error and stops running."""
    rows = {key: {"runs": []} for key in engines}
    order = list(engines)
    for _ in range(repeats):
        for prompt, text in zip(prompts, chat_texts):
            for key in order:
                if "error" in rows[key]:
                    continue
                try:
                    rows[key]["runs"].append(engines[key](text if key[0] == "llama.cpp" else prompt))
                except RuntimeError as e:            # a peer's crash costs its row, not the run
                    rows[key]["error"] = str(e).splitlines()[0]
                    print(f"  {' '.join(key)}: failed: {rows[key]['error']}", flush=True)
            order = order[1:] + order[:1]
    return rows


def summarize(key: tuple, row: dict) -> dict:
    """A row's runs (of every phase it ran in) as its decoding and (Tandem's) end-to-end tokens/s,
    its workers' busy shares, tokens per round and texts."""
    runs = row.pop("runs")
    if "error" not in row and runs:
        tokens, seconds, rounds, decoded, decoding = (sum(r[k] for r in runs) for k in (
            "tokens", "seconds", "rounds", "decode_tokens", "decode_seconds"))
        end_to_end = tokens / seconds if key[0] == "Tandem" else None
        # each worker's inference thread's share of the row's end-to-end time
        busy = {k: sum(r["busy"][k] for r in runs if k in r.get("busy", {})) / seconds
                for k in {k for r in runs for k in r.get("busy", {})}}
        row.update(tok_s=decoded / decoding, end_to_end_tok_s=end_to_end, busy=busy, tokens=tokens,
                   tokens_per_round=tokens / rounds if rounds else None,
                   per_prompt_tok_s=[r["decode_tokens"] / r["decode_seconds"] for r in runs],
                   texts=[r["text"] for r in runs])
        print(f"  {key[0]} {key[1]:8s} {key[2]:5s}: {row['tok_s']:.2f} tok/s decoding"
              + (f", {end_to_end:.2f} end to end" if end_to_end else ""), flush=True)
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=2, help="torch (and llama.cpp) threads per process")
    p.add_argument("--prompts", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--dtypes", help="comma-separated target dtypes")
    p.add_argument("--draft-dtypes", help="comma-separated draft dtypes (default int8, and int4 where it runs)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="also serve the draft model scoring this many token ids (draft_worker --draft-vocab)")
    p.add_argument("--draft-threads", default="1", help="comma-separated thread counts of the draft worker")
    p.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    p.add_argument("--repeats", type=int, default=1, help="times each prompt goes to every engine")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="bench/results/precision.json")
    a = p.parse_args(argv)
    fill_defaults(a, QUICK, FULL)
    a.draft_dtypes = a.draft_dtypes or ("int8,int4" if rowgemm.int4() else "int8")
    prompts = PROMPTS[:a.prompts]
    m = machine()
    print(f"{m['cpu']} ({', '.join(m['cpu_features']) or 'no listed features'}): "
          f"Tandem's kernel on {m['kernel']}, int8 on {m['int8_kernel']}, int8 weights in {m['int8_weight_bits']} bits",
          flush=True)
    result = {"machine": m, "setup": {k: getattr(a, k) for k in ("target", "draft", "threads", "prompts",
                                                                         "max_new_tokens", "dtypes", "draft_dtypes", "draft_vocab",
                                                                         "draft_threads", "repeats")}}
    start = time.perf_counter()
    bin_dir = None if a.no_llama else llamacpp.build()
    tok = load_tokenizer(a.target)
    chat_texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                  for p in prompts]
    tandem, llama = {}, {}
    redis_url, private = ensure_redis()
    try:
        for dtype in a.dtypes.split(","):
            # llama.cpp's rows run in each phase beside Tandem's, their runs of both phases together
            rows: dict = {}
            for phase in tandem_phases(a, dtype, redis_url):
                with contextlib.ExitStack() as opened:
                    engines = {**phase(opened), **llama_engines(a, dtype, bin_dir)}
                    for key, row in interleaved(engines, prompts, chat_texts, a.repeats).items():
                        mine = rows.setdefault(key, {"runs": []})
                        mine["runs"] += row["runs"]
                        if "error" in row:
                            mine["error"] = row["error"]
            for (engine, precision, row), stats in rows.items():
                stats = summarize((engine, precision, row), stats)
                if engine == "Tandem":
                    tandem.setdefault(dtype, {})[row] = stats
                else:
                    llama[f"{precision}/{row}"] = stats
    finally:
        if private is not None:
            private.stop()
    if a.no_llama or bin_dir is None:
        llama = "skipped (--no-llama)" if a.no_llama else "llama.cpp is not built here and could not be built (see the log above)"
    result.update(tandem=tandem, llama_cpp=llama, seconds=time.perf_counter() - start)
    print("\n| engine | precision | drafting | decoding tokens/s | vs llama.cpp plain, same precision "
          "| end to end tokens/s | target busy | draft busy | output = its own plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    problems = []

    def line(engine: str, precision: str, method: str, row: dict, plain: dict, peer: dict | None) -> None:
        # llama.cpp's speculative binary may run past the token budget by a round: its prefix counts
        same = all(t == p or (engine == "llama.cpp" and t.startswith(p)) for t, p in zip(row["texts"], plain["texts"]))
        row["equals_plain"] = same
        if not same:
            problems.append(f"{engine} {precision} {method}: output differs from its plain decoding")
        vs = f"{row['tok_s'] / peer['tok_s']:.2f}x" if peer else "–"
        end_to_end = f"{row['end_to_end_tok_s']:.2f}" if engine == "Tandem" else "–"
        target, draft = (f"{row['busy'][k]:.0%}" if k in row.get("busy", {}) else "–" for k in ("target", "draft"))
        print(f"| {engine} | {precision} | {method} | {row['tok_s']:.2f} | {vs} | {end_to_end} | {target} | {draft} "
              f"| {'yes' if same else 'NO'} |")

    ran = {k: r for k, r in llama.items() if "error" not in r} if isinstance(llama, dict) else {}
    for dtype, rows in tandem.items():
        peer = ran.get(f"{LLAMA[dtype]}/none") if dtype in LLAMA else None
        for method, row in rows.items():
            line("Tandem", dtype, method, row, rows["none"], peer)
    if ran:
        for key, row in llama.items():
            precision, method = key.split("/")
            if key not in ran or f"{precision}/none" not in ran:
                print(f"| llama.cpp | {precision} | {method} | failed: {row.get('error', 'no plain row')} | – | – | – | – | – |")
                continue
            line("llama.cpp", precision, method, row, ran[f"{precision}/none"], ran[f"{precision}/none"])
        best_llama = max(r["tok_s"] for r in ran.values())
        best_tandem = max(r["tok_s"] for rows in tandem.values() for r in rows.values())
        best_end_to_end = max(r["end_to_end_tok_s"] for rows in tandem.values() for r in rows.values())
        result["best_tandem_vs_best_llama_cpp"] = best_tandem / best_llama
        result["best_tandem_end_to_end_vs_best_llama_cpp"] = best_end_to_end / best_llama
        print(f"\nbest Tandem row against llama.cpp's best, decoding: {best_tandem / best_llama:.2f}x "
              f"(Tandem's best end to end, prompt included: {best_end_to_end / best_llama:.2f}x)")
    else:
        print(f"\nllama.cpp: {llama}")
    print("\ndecoding tokens/s per prompt, in the order they ran (--repeats rounds of the prompts):")
    every = [(f"Tandem {d} {m}", r) for d, rows in tandem.items() for m, r in rows.items()]
    every += [(f"llama.cpp {k.replace('/', ' ')}", r) for k, r in ran.items()]
    for name, row in every:
        print(f"  {name:28s} " + " ".join(f"{v:6.2f}" for v in row["per_prompt_tok_s"]))
    for problem in problems:
        print("WARNING:", problem)
    for row in [r for rows in tandem.values() for r in rows.values()] + [*ran.values()]:
        del row["texts"]
    write_json(a.out, result)


if __name__ == "__main__":
    main()

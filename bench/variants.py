"""make bench-variants: draft worker settings side by side on one verify worker, in one stack.

Runs of one setting on a shared host can differ by up to 2x between stacks, so settings are
compared inside one: one verify worker (the target at --dtype), a gateway that serves plain
decoding, and per variant a draft worker started with that variant's flags and a gateway routing
to it alone (static routing). Each prompt goes through plain decoding and every variant in turn,
the order reversed every other prompt, so that a host whose speed drifts favours none. Prompts:
the coding prompts of bench/e2e.py and the held-out chat and code prompts of
tandem/head/prompts.jsonl (subjects the trained head never saw). Greedy, one stream, draft method
model. With batch-invariant numerics every variant's output must equal plain decoding's: checked,
and a difference printed.

    python -m bench.variants --variant whole= --variant "vocab=--draft-vocab 32768"
    python -m bench.variants --variant "c04=--confidence 0.4" --variant "c02=--confidence 0.2" --quick
"""

from __future__ import annotations

import argparse
import contextlib
import shlex

import grpc

from bench.e2e import PROMPTS
from bench.report import machine, timed_generate, write_json
from tandem.client import build_request
from tandem.head import prompts as head_prompts
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc


def prompt_sets(per_set: int) -> list[tuple[str, str]]:
    """(set, prompt): the coding prompts of bench/e2e.py, then `per_set` held-out chat and code prompts."""
    chat, code = ([r["messages"][0]["content"] for r in head_prompts.load("heldout", kind)][:per_set]
                  for kind in ("chat", "code"))
    return [*(("e2e", p) for p in PROMPTS[:per_set]), *(("chat", p) for p in chat), *(("code", p) for p in code)]


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name or name == "plain":
        raise argparse.ArgumentTypeError(f"--variant wants NAME=FLAGS (NAME not 'plain'), got {text!r}")
    return name, shlex.split(flags)


def summarize(runs: list[dict], names: list[str]) -> list[dict]:
    """Per prompt set and variant: tokens/s over its runs, against plain's on the same prompts."""
    rows = []
    for group in [*dict.fromkeys(r["set"] for r in runs), "all"]:
        mine = [r for r in runs if group in ("all", r["set"])]
        plain = [r for r in mine if r["variant"] == "plain"]
        plain_rate = sum(r["tokens"] for r in plain) / sum(r["seconds"] for r in plain)
        for name in ["plain", *names]:
            rs = [r for r in mine if r["variant"] == name]
            tokens, seconds, rounds = (sum(r[k] for r in rs) for k in ("tokens", "seconds", "rounds"))
            rows.append({"set": group, "variant": name, "tok_s": tokens / seconds, "vs_plain": tokens / seconds / plain_rate,
                         "tokens_per_round": tokens / rounds, "prompts": len(rs),
                         "equal_plain": sum(r["equal_plain"] for r in rs)})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| prompts | variant | tokens/s | vs plain | tokens per round | output = plain |", "|" + " --- |" * 6]
    out += [f"| {r['set']} | {r['variant']} | {r['tok_s']:.2f} | {r['vs_plain']:.2f}x | {r['tokens_per_round']:.2f} "
            f"| {r['equal_plain']}/{r['prompts']}{'' if r['equal_plain'] == r['prompts'] else ' **MISMATCH**'} |"
            for r in rows]
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", type=parse_variant, required=True, metavar="NAME=FLAGS",
                   help="a draft worker with these flags (repeatable; FLAGS may be empty: the defaults)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", default="int8", help="the target's --dtype")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker process")
    p.add_argument("--prompts", type=int, default=6, help="prompts per set (the e2e set has 4)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--quick", action="store_true", help="one prompt per set, 24 tokens")
    p.add_argument("--out", default="bench/results/variants.json")
    a = p.parse_args(argv)
    names = [name for name, _ in a.variant]
    if len(set(names)) != len(names):
        p.error(f"--variant names must differ, got {', '.join(names)}")
    if a.quick:
        a.prompts, a.max_new_tokens = 1, 24
    prompts = prompt_sets(a.prompts)

    runs = []
    with Stack(a.target, a.draft, threads=a.threads, draft_workers=0, verify_args=["--dtype", a.dtype]) as stack, \
            contextlib.ExitStack() as ex:
        verify = stack.address("verify_worker")
        gateways = {"plain": stack.add_gateway(["--verify-workers", verify, "--draft-workers", ""])}
        for name, flags in a.variant:
            draft = stack.add_worker("draft_worker", extra_args=flags)
            gateways[name] = stack.add_gateway(["--verify-workers", verify, "--draft-workers", stack.address(draft)])
        stubs = {name: pb_grpc.GenerationServiceStub(ex.enter_context(grpc.insecure_channel(stack.address(g))))
                 for name, g in gateways.items()}
        order = list(stubs)
        for name, stub in stubs.items():
            timed_generate(stub, build_request("warm up", chat=True, max_new_tokens=8,
                                               method="none" if name == "plain" else "model"))
        for i, (group, prompt) in enumerate(prompts):
            texts = {}
            for name in order if i % 2 == 0 else order[::-1]:
                r, _ = timed_generate(stubs[name], build_request(prompt, chat=True, max_new_tokens=a.max_new_tokens,
                                                                 method="none" if name == "plain" else "model"))
                texts[name] = r.pop("text")
                runs.append({"set": group, "prompt": i, "variant": name, **r})
                print(f"  {group} {i:2d} {name:10s} {r['tok_s']:6.2f} tok/s, {r['rounds']} rounds", flush=True)
            for r in runs[-len(order):]:
                r["equal_plain"] = texts[r["variant"]] == texts["plain"]
                if not r["equal_plain"]:
                    print(f"MISMATCH {group} {i} {r['variant']}:\n  {texts[r['variant']]!r}\n  plain: {texts['plain']!r}")
    rows = summarize(runs, names)
    print("\n" + table(rows))
    write_json(a.out, {"machine": machine(), "setup": {**vars(a), "variant": dict(a.variant)},
                       "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()

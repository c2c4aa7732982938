"""python -m bench.passcost: what a batched verify pass costs by sessions and positions per session.

The speculation controller's price rests on this curve: a proposed position pays off only when its
chance of being accepted exceeds what the same time would give plain decoding. This times
`CausalLM.forward_batch`, the verify worker's own call, for S sessions feeding n new tokens each (a
round of n - 1 proposed positions), every session holding a prompt of --context tokens, with the
sizes interleaved and each one's median kept (a shared host drifts). --shared gives every session the
same prompt prefix (copied KV, attended as one group, as the benchmark's repeated prompts are).

For each S it also prints the goodput of proposing k = n - 1 positions against plain decoding (n = 1):
tokens per pass are S x (1 + expected accepted), expected accepted being the sum of the acceptance
through each position (--accept, default the n-gram drafter's after a 3-token match on the load
benchmark's prompts; positions beyond the list continue at the last ratio). Prints a table, writes JSON.

With --leaves L, each session's n new tokens are also fed as a token tree of the same size: a chain
of n - 1 - L proposed tokens and L leaves beside its first L positions (siblings, as the head's
second choices are), timed in the same rotation: what a tree's nodes cost against a chain's.

    python -m bench.passcost                    # SmolLM2-135M, S = 1, 4, 16, 64, n = 1, 2, 3, 5, 9
    python -m bench.passcost --sessions 64 --new 1,2 --repeats 9
    python -m bench.passcost --sessions 1 --new 1,6,8 --leaves 2 --context 300
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.report import machine, write_json
from tandem.engine.modeling import CausalLM
from tandem.speculation import tree


def acceptance_through(accept: list[float], k: int) -> list[float]:
    """Chance of acceptance through positions 1..k, extending `accept` at its last ratio."""
    out = list(accept[:k])
    ratio = accept[-1] / accept[-2] if len(accept) > 1 and accept[-2] else 1.0
    while len(out) < k:
        out.append(out[-1] * ratio)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sessions", default="1,4,16,64")
    p.add_argument("--new", default="1,2,3,5,9", help="new tokens per session (1 = plain decoding)")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--shared", type=int, default=0, help="prompt prefix all sessions share (tokens)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--accept", default="0.84,0.72,0.61,0.55,0.49")
    p.add_argument("--leaves", type=int, default=0, help="also time each n as a tree with this many leaves")
    p.add_argument("--out", default="bench/results/passcost.json")
    a = p.parse_args()
    sessions = [int(x) for x in a.sessions.split(",")]
    news = sorted({int(x) for x in a.new.split(",")} | {1})
    accept = [float(x) for x in a.accept.split(",")]

    lm = CausalLM(a.model, threads=a.threads or None, kv_tokens=(max(sessions) + 1) * (a.context + max(news) + 8) + 64)
    rng = random.Random(0)
    words = lambda n: [rng.randrange(1000, lm.vocab_size - 1000) for _ in range(n)]   # noqa: E731
    shared = words(a.shared)
    donor = lm.new_cache(a.context + 8)
    lm.forward(shared + words(a.context - a.shared), donor, last=1)
    caches = []
    for _ in range(max(sessions)):
        cache = lm.new_cache(a.context + max(news) + 4)
        if a.shared:
            cache.copy_prefix(donor, a.shared)
        lm.forward(words(a.context - cache.length), cache, last=1)
        caches.append(cache)

    def one_pass(s: int, n: int, leaves: int = 0) -> float:
        shape = None
        if leaves:
            shape = tree.fed(tree.chain(n - 1 - leaves) + [j - 1 for j in range(leaves)])
        items = [(c, words(n), None, shape) for c in caches[:s]]
        start = time.perf_counter()
        lm.forward_batch(items)
        seconds = time.perf_counter() - start
        for c in caches[:s]:
            c.crop(a.context)
        return seconds

    grid = [(s, n, 0) for s in sessions for n in news]
    grid += [(s, n, a.leaves) for s in sessions for n in news if a.leaves and n - 1 > a.leaves]
    for key in grid[:3]:
        one_pass(*key)                                   # warm-up
    times: dict[tuple[int, int, int], list[float]] = {key: [] for key in grid}
    for _ in range(a.repeats):
        for key in grid:
            times[key].append(one_pass(*key))
    ms = {key: 1000 * statistics.median(v) for key, v in times.items()}

    rows = []
    for s in sessions:
        plain = s / ms[(s, 1, 0)]
        for n in news:
            expected = 1 + sum(acceptance_through(accept, n - 1))
            rows.append({"sessions": s, "new_per_session": n, "positions": s * n, "pass_ms": round(ms[(s, n, 0)], 2),
                         "ms_per_position": round(ms[(s, n, 0)] / (s * n), 3),
                         "spec_over_plain": round(s * expected / ms[(s, n, 0)] / plain, 3),
                         "tree_pass_ms": round(ms[(s, n, a.leaves)], 2) if (s, n, a.leaves) in ms and a.leaves else None})
    print(f"\n{a.model}, context {a.context} (shared {a.shared}), {torch.get_num_threads()} threads, "
          f"acceptance through positions {accept}\n")
    print(f"| sessions | new / session | positions | pass ms | ms / position | goodput vs plain "
          f"| as a tree with {a.leaves} leaves, pass ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        as_tree = f"{r['tree_pass_ms']:.1f}" if r["tree_pass_ms"] is not None else "-"
        print(f"| {r['sessions']} | {r['new_per_session']} | {r['positions']} | {r['pass_ms']:.1f} | "
              f"{r['ms_per_position']:.2f} | {r['spec_over_plain']:.2f}x | {as_tree} |")
    write_json(a.out, {"machine": machine(), "model": a.model, "context": a.context, "shared": a.shared,
                       "threads": torch.get_num_threads(), "accept": accept, "repeats": a.repeats, "leaves": a.leaves,
                       "rows": rows})


if __name__ == "__main__":
    main()

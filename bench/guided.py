"""Structured output, a section of `make bench` (bench/e2e.py):

    .venv/bin/python -m bench.e2e --only guided [--quick]

JSON Schema extraction (invoice, person, event: nested object, array, enum, integer, bounded
strings) through the running service, interleaved in one run: plain decoding by the target under
the guide (`none`), `model` with jump-forward (the draft worker's default) and without it
(`--no-jump-forward`), and the same prompts without the guide (`model` and `none`), so that the
guided speed-up can be set against the free-text one. Both draft workers serve one verify worker,
each behind a gateway of its own with static routing, so that a request picks its draft worker.
Acceptance and mean accepted length come from the responses' Usage; with jump-forward the forced
tokens count as drafted and accepted.

The mask's cost is measured in-process afterwards (the service stopped) with
tandem.speculation.grammar on each generated output, re-tokenized: per token, one mask row and
one advance; per round, the verify worker's work (`allowed` over the proposal, `advance` over what
was kept, `done`) and the draft worker's (jump-forward, one mask row and advance per proposed
token, rollback, advance), rounds shaped by the run's Usage (proposed and kept tokens per round).
Every proposed token is taken as accepted and masked, so this is an upper bound. The share is set
against a round's time in the service, wall / rounds: a one-token request of the same prompt
before each row of runs leaves its KV for them to copy, so that no counted run prefills (checked:
cached_prompt_tokens). Goal: the masks cost under 10% of a round; the service-side check of the
same is plain decoding's tokens/s under the guide / without it (all the guide's costs, different
texts of about the same length).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

import grpc

from bench.report import summarize, timed_generate
from tandem.client import build_request
from tandem.launch import Stack
from tandem.v1 import generation_pb2_grpc as pb_grpc

INT = {"type": "integer", "minimum": 0}


def S(n: int) -> dict:
    """A string of at most n characters: bounded strings keep the outputs short."""
    return {"type": "string", "maxLength": n}


def obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def arr(items: dict, most: int) -> dict:
    return {"type": "array", "items": items, "maxItems": most}


# (schema, text): the prompt names the schema's top-level fields; texts in prompt order (--quick: the first)
TASKS = [
    (obj(invoice_number=S(16), date=S(10), currency={"enum": ["EUR", "USD", "GBP"]}, total_cents=INT,
         status={"enum": ["paid", "unpaid", "overdue"]}, seller=obj(name=S(40), country=S(2)),
         items=arr(obj(description=S(30), quantity=INT), 3)),
     ("Invoice INV-20931 from Nordlicht Bikes GmbH (Germany), dated 2024-03-14. 2 city bike helmets and "
      "1 repair kit, total EUR 189.50, payment still open.")),
    (obj(name=S(40), age=INT, email=S(40), role={"enum": ["engineer", "manager", "designer", "other"]},
         address=obj(city=S(30), country=S(30)), skills=arr(S(20), 4), remote={"type": "boolean"}),
     ("Maria Santos, 34, leads the platform team as engineering manager in Lisbon, Portugal. She works "
      "from home on Fridays, knows Go, Kubernetes and Postgres, and reads mail at maria.santos@example.org.")),
    (obj(title=S(40), date=S(10), start=S(5), duration_minutes=INT,
         kind={"enum": ["meeting", "conference", "workshop", "party"]}, venue=obj(name=S(40), city=S(30)),
         speakers=arr(S(30), 4), capacity=INT),
     ("The Rust Tooling Workshop takes place on 2024-10-02 from 09:30 for three hours at Tech Hub Zuid in "
      "Rotterdam. Talks by Anna de Vries and Tom Okafor; at most 40 seats.")),
]
# name: (guided, method, gateway): the jump-forward gateway also serves the runs that draft nothing
CONFIGS = {"guided/none": (True, "none", "jf"), "guided/model": (True, "model", "jf"),
           "guided/model_nojf": (True, "model", "nojf"), "free/none": (False, "none", "jf"),
           "free/model": (False, "model", "jf")}


def prompt_of(schema: dict, text: str) -> str:
    return f"Extract the following fields as JSON: {', '.join(schema['properties'])}.\n\n{text}"


def run_one(stub, task: int, guided: bool, method: str, k: int, n: int, prompt: str = "") -> dict:
    """One request of TASKS[task] (or `prompt` with its schema). Free text stops where the model
    closes its JSON code block, so that it stays the length of the guided output."""
    schema, text = TASKS[task]
    req = build_request(prompt or prompt_of(schema, text), chat=True, max_new_tokens=n, method=method,
                        k=k if method != "none" else 0, stop=None if guided else ["}\n```"])
    if guided:
        req.guided.json_schema = json.dumps(schema)
    run, r = timed_generate(stub, req)
    run.update({"task": task, "finish": r.finish_reason,
                "prefilled": r.usage.prompt_tokens - 1 - r.usage.cached_prompt_tokens})   # the last is fed with round 1
    return run


def _start_gateway(stack: Stack, draft: str) -> str:
    return stack.add_gateway(["--verify-workers", stack.address("verify_worker"), "--draft-workers", stack.address(draft)])


def guided(stack: Stack, k: int, n: int, tasks: int, repeats: int) -> dict:
    """Adds a draft worker without jump-forward and two gateways with static routing to `stack`
    (whose first draft worker keeps the default), then runs every config per pass and task in a
    row, the order reversed every other time. Before each row, a one-token request of the same
    prompt (not counted) prefills it, so that the counted runs copy its KV and time rounds alone."""
    if stack.draft == "none":
        raise SystemExit("the guided section needs a draft model")
    nojf = stack.add_worker("draft_worker", extra_args=["--no-jump-forward"])
    gateways = {"jf": _start_gateway(stack, "draft_worker"), "nojf": _start_gateway(stack, nojf)}
    with contextlib.ExitStack() as ex:
        stubs = {g: pb_grpc.GenerationServiceStub(ex.enter_context(grpc.insecure_channel(stack.address(name))))
                 for g, name in gateways.items()}
        for t in range(tasks):           # warm-up, short prompts: every path, each guide compiled everywhere
            for gd, m, g in CONFIGS.values():
                if gd or t == 0:
                    run_one(stubs[g], t, gd, m, k, 4, prompt="warm up")
        runs: dict[str, list] = {c: [] for c in CONFIGS}
        turn = 0
        for rep in range(repeats):
            for t in range(tasks):
                run_one(stubs["jf"], t, True, "none", k, 1)
                order = list(CONFIGS) if turn % 2 == 0 else list(CONFIGS)[::-1]
                turn += 1
                for c in order:
                    gd, m, g = CONFIGS[c]
                    run = run_one(stubs[g], t, gd, m, k, n)
                    run["pass"] = rep
                    runs[c].append(run)
                    print(f"  {c:18s} task {t} {run['tok_s']:.2f} tok/s, {run['tokens']} tokens", flush=True)
    summary = {c: summarize(r) for c, r in runs.items()}

    def tot(c: str) -> float:
        return summary[c]["tok_s_total"]

    def paired(num: str, den: str, num2: str | None = None, den2: str | None = None) -> dict:
        xs = []
        for i in range(len(runs[num])):
            x = runs[num][i]["tok_s"] / runs[den][i]["tok_s"]
            if num2:
                x /= runs[num2][i]["tok_s"] / runs[den2][i]["tok_s"]
            xs.append(x)
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}

    ratios = {
        "speedup_guided_jf": {"of_totals": tot("guided/model") / tot("guided/none"),
                              "paired": paired("guided/model", "guided/none"),
                              "what": "speed-up under the guide, model with jump-forward / none"},
        "speedup_guided_nojf": {"of_totals": tot("guided/model_nojf") / tot("guided/none"),
                                "paired": paired("guided/model_nojf", "guided/none"),
                                "what": "speed-up under the guide, model without jump-forward / none"},
        "jump_forward_gain": {"of_totals": tot("guided/model") / tot("guided/model_nojf"),
                              "paired": paired("guided/model", "guided/model_nojf"),
                              "what": "model with jump-forward / without, under the guide"},
        "speedup_free": {"of_totals": tot("free/model") / tot("free/none"),
                         "paired": paired("free/model", "free/none"), "what": "speed-up without a guide, model / none"},
        "guide_cost_plain": {"of_totals": tot("guided/none") / tot("free/none"),
                             "paired": paired("guided/none", "free/none"),
                             "what": "plain decoding under the guide / without it (other texts)"},
        "guided_vs_free": {"of_totals": (tot("guided/model") / tot("guided/none")) / (tot("free/model") / tot("free/none")),
                           "paired": paired("guided/model", "guided/none", "free/model", "free/none"),
                           "what": "guided speed-up (jump-forward) / free-text speed-up"},
    }
    same = {c: sum(a["text"] == b["text"] for a, b in zip(runs[c], runs["guided/none"]))
            for c in ("guided/model", "guided/model_nojf")}
    return {"setup": {"k": k, "max_new_tokens": n, "repeats": repeats,
                      "tasks": [{"schema": s, "prompt": prompt_of(s, x)} for s, x in TASKS[:tasks]]},
            "summary": summary, "ratios": ratios, "output_equals_none": same,
            "prefilled_tokens": sum(x["prefilled"] for rs in runs.values() for x in rs),
            "runs_per_config": tasks * repeats, "runs": runs}


def _timed(fn, *args, repeats: int = 3) -> float:
    """Fastest of `repeats` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def walk_tokens(grammars, guide, ids: list[int]) -> None:
    """Token by token: one mask row, one advance."""
    m = grammars.matcher(guide)
    for t in ids:
        m.allowed()
        m.advance([t])


def walk_rounds(grammars, guide, ids: list[int], prop: int, kept: int, side: str) -> None:
    """Rounds of `prop` proposed and `kept` committed tokens: the verify worker's masks (all proposal
    rows at once) or the draft worker's (jump-forward, then a row per proposed token)."""
    m = grammars.matcher(guide)
    for pos in range(0, len(ids), kept):
        if side == "verify":
            m.allowed(ids[pos:pos + prop])
            m.advance(ids[pos:pos + kept])
            m.done()
        else:
            m.forced(prop)
            took = 0
            for t in ids[pos:pos + prop]:
                m.allowed()
                took += m.advance([t])
            m.rollback(took)
            m.advance(ids[pos:pos + kept])


def mask_costs(result: dict, target: str) -> None:
    """Adds result["masks"]: per guided config, the mask's ms per token and per round and its share of
    a round in the service. Run after the service stopped, so that the timing has the cores."""
    from transformers import AutoConfig, GenerationConfig

    from tandem.engine.modeling import load_tokenizer, resolve
    from tandem.speculation.grammar import Grammars, Guide
    tok, path = load_tokenizer(target), resolve(target)
    eos = GenerationConfig.from_pretrained(path).eos_token_id or AutoConfig.from_pretrained(path).eos_token_id
    grammars = Grammars(tok, AutoConfig.from_pretrained(path).vocab_size, eos if isinstance(eos, list) else [eos])
    masks = {}
    for c in ("guided/none", "guided/model", "guided/model_nojf"):
        per_token, verify, draft, rounds, service, matched, tokens = [], 0.0, 0.0, 0, 0.0, 0, 0
        for run in result["runs"][c]:
            guide = Guide("json_schema", json.dumps(TASKS[run["task"]][0]))
            ids = tok(run["text"], add_special_tokens=False).input_ids
            tokens += len(ids)
            ids = ids[:grammars.matcher(guide).advance(ids)]      # re-tokenized: the prefix the guide takes
            matched += len(ids)
            if not ids or not run["rounds"]:
                continue
            kept = max(1, round(run["tokens"] / run["rounds"]))
            prop = round(run["drafted"] / run["rounds"])
            n_rounds = -(-len(ids) // kept)           # simulated rounds; weighted by the run's own
            per_token.append(_timed(walk_tokens, grammars, guide, ids) / len(ids))
            verify += _timed(walk_rounds, grammars, guide, ids, prop, kept, "verify") / n_rounds * run["rounds"]
            if prop:
                draft += _timed(walk_rounds, grammars, guide, ids, prop, kept, "draft") / n_rounds * run["rounds"]
            rounds, service = rounds + run["rounds"], service + run["seconds"]
        if not rounds:
            continue
        round_s = service / rounds
        masks[c] = {"per_token_ms": 1000 * statistics.median(per_token), "verify_round_ms": 1000 * verify / rounds,
                    "draft_round_ms": 1000 * draft / rounds, "service_round_ms": 1000 * round_s,
                    "share": (verify + draft) / rounds / round_s, "tokens_matched": matched, "tokens": tokens}
    result["masks"] = masks


def _pr(x: dict | None) -> str:
    return f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})" if x else "-"


def print_guided(r: dict) -> None:
    s = r["setup"]
    print(f"\nguided: JSON Schema extraction, {len(s['tasks'])} prompts x {s['repeats']} passes, k={s['k']}, "
          f"max_new_tokens {s['max_new_tokens']}; model = with jump-forward, model_nojf = without")
    print("\n| request | speculation | tokens/s (all prompts) | median (min-max) | tokens | rounds | acceptance "
          "(drafted) | forced tokens (accepted) | mean accepted length |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, x in r["summary"].items():
        g, m = name.split("/")
        acc = f"{x['acceptance']:.0%}" if x["acceptance"] is not None else "-"
        mal = f"{x['mean_accepted_length']:.2f}" if x["mean_accepted_length"] is not None else "-"
        runs = r["runs"][name]
        print(f"| {g} | {m} | {x['tok_s_total']:.2f} | {x['tok_s_median']:.2f} ({x['tok_s_min']:.2f}-"
              f"{x['tok_s_max']:.2f}) | {sum(u['tokens'] for u in runs)} | {sum(u['rounds'] for u in runs)} "
              f"| {acc} | {x.get('forced', 0)} ({x.get('forced_accepted', 0)}) | {mal} |")
    print("\n| ratio | paired by pass and prompt: median (min-max) | of totals | goal |")
    print("| --- | --- | --- | --- |")
    for name, x in r["ratios"].items():
        goal = {"guided_vs_free": ">= 1", "guide_cost_plain": ">= 0.90"}.get(name, "")
        print(f"| {x['what']} | {_pr(x['paired'])} | {x['of_totals']:.3f} | {goal} |")
    print("\n| guided | mask per token (ms) | verify's masks per round (ms) | draft's masks per round (ms) "
          "| round in the service (ms) | mask share of a round | goal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, x in r.get("masks", {}).items():
        print(f"| {name.split('/')[1]} | {x['per_token_ms']:.3f} | {x['verify_round_ms']:.2f} | {x['draft_round_ms']:.2f} "
              f"| {x['service_round_ms']:.0f} | {x['share']:.1%} | < 10% |")
    same = r["output_equals_none"]
    print("\noutput identical to guided none: " + ", ".join(f"{c} {v}/{r['runs_per_config']}" for c, v in same.items()))
    took = sum(m["tokens_matched"] for m in r.get("masks", {}).values())
    tokens = sum(m["tokens"] for m in r.get("masks", {}).values())
    if took != tokens:
        print(f"note: the guide took {took} of {tokens} re-tokenized output tokens (the text tokenizes "
              "otherwise than it was generated); the masks were timed on those")
    if r["prefilled_tokens"]:
        print(f"note: counted runs prefilled {r['prefilled_tokens']} prompt tokens (a prompt's KV was not "
              "kept for them): the round times include that prefill")

"""The cost of request parameters, a section of `make bench` (bench/e2e.py): the same prompts
plain, with per-token information (logprob and rank of every token and the 5 likeliest
alternatives: the native twin of TGIS token_logprobs + token_ranks + top_n_tokens=5), with
repetition_penalty=1.2, and with both, each with speculation on and off, interleaved.
Goals: per-token information costs under 5% of throughput; with the penalty, speculation keeps
at least 90% of its plain-request speed-up.
"""

from __future__ import annotations

import statistics

from bench.report import summarize, timed_generate
from tandem.client import build_request

TOP_N = 5                 # TGIS top_n_tokens=5
PENALTY = 1.2             # repetition_penalty
# name: (logprobs and ranks with the TOP_N likeliest alternatives, repetition penalty)
VARIANTS = {"plain": (False, False), "logprobs": (True, False), "penalty": (False, True), "both": (True, True)}


def param_request(prompt: str, variant: str, method: str, k: int, n: int):
    info, penalty = VARIANTS[variant]
    req = build_request(prompt, chat=True, max_new_tokens=n, method=method, k=k)
    if info:
        req.logprobs.logprobs = True
        req.logprobs.top_logprobs = TOP_N
    if penalty:
        req.sampling.repetition_penalty = PENALTY
    return req


def param_run(stub, prompt: str, variant: str, method: str, k: int, n: int) -> dict:
    run, r = timed_generate(stub, param_request(prompt, variant, method, k, n))
    if VARIANTS[variant][0]:
        # the information was asked for: check it came, one entry per token with TOP_N alternatives
        run["info_complete"] = (len(r.tokens) == r.usage.generated_tokens
                                and all(t.rank > 0 and len(t.top_logprobs) == TOP_N for t in r.tokens))
    return run


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def parameters(stub, prompts: list[str], spec: str, k: int, n: int, repeats: int) -> dict:
    """Every variant with speculation `spec` and "none", interleaved: per pass and prompt all eight
    configurations in a row, the order reversed every other time so that no configuration always
    runs first or last. Ratios are taken two ways: of the totals (all tokens / all seconds), and per
    pass and prompt (the two runs of a ratio ran next to each other), median with min-max."""
    configs = [(v, m) for v in VARIANTS for m in (spec, "none")]
    for v, m in configs:                 # warm-up: every path once, not counted
        param_run(stub, "warm up", v, m, k if m != "none" else 0, 8)
    runs: dict[str, list] = {f"{v}/{m}": [] for v, m in configs}
    keyed: dict[tuple, dict] = {}
    turn = 0
    for rep in range(repeats):
        for i, prompt in enumerate(prompts):
            order = configs if turn % 2 == 0 else configs[::-1]
            turn += 1
            for v, m in order:
                run = param_run(stub, prompt, v, m, k if m != "none" else 0, n)
                run.update({"pass": rep, "prompt": i})
                runs[f"{v}/{m}"].append(run)
                keyed.setdefault((rep, i), {})[(v, m)] = run
                print(f"  {v:8s} {m:6s} {run['tok_s']:.2f} tok/s", flush=True)
    summary = {name: summarize(r) for name, r in runs.items()}

    def total(v: str, m: str) -> float:
        return summary[f"{v}/{m}"]["tok_s_total"]

    def paired(f) -> dict:
        return _spread([f(lambda v, m: g[(v, m)]["tok_s"]) for g in keyed.values()])

    ratios: dict[str, dict] = {}
    for m in (spec, "none"):
        ratios[f"info_cost/{m}"] = {"of_totals": total("logprobs", m) / total("plain", m),
                                    "paired": paired(lambda t, m=m: t("logprobs", m) / t("plain", m)),
                                    "what": f"tokens/s with logprobs+ranks+top {TOP_N} / plain, {m}"}
        ratios[f"info_cost_with_penalty/{m}"] = {
            "of_totals": total("both", m) / total("penalty", m),
            "paired": paired(lambda t, m=m: t("both", m) / t("penalty", m)),
            "what": f"tokens/s with both / with the penalty alone, {m}"}
    for v in VARIANTS:
        ratios[f"speedup/{v}"] = {"of_totals": total(v, spec) / total(v, "none"),
                                  "paired": paired(lambda t, v=v: t(v, spec) / t(v, "none")),
                                  "what": f"speed-up {spec}/none, {v} requests"}
    for v in ("penalty", "both"):
        s_plain, s_v = ratios["speedup/plain"]["of_totals"], ratios[f"speedup/{v}"]["of_totals"]
        ratios[f"kept/{v}"] = {
            "of_totals": s_v / s_plain,
            "paired": paired(lambda t, v=v: (t(v, spec) / t(v, "none")) / (t("plain", spec) / t("plain", "none"))),
            "what": f"speed-up with {v} / plain speed-up"}
        ratios[f"kept_gain/{v}"] = {
            "of_totals": (s_v - 1) / (s_plain - 1) if s_plain != 1 else None,
            "what": f"(speed-up with {v} - 1) / (plain speed-up - 1)"}
    same = {v: sum(a_["text"] == b_["text"] for a_, b_ in zip(runs[f"{v}/{spec}"], runs[f"{v}/none"]))
            for v in VARIANTS}
    info = [r["info_complete"] for name, rs in runs.items() for r in rs if "info_complete" in r]
    return {"setup": {"spec": spec, "k": k, "max_new_tokens": n, "repeats": repeats, "prompts": prompts,
                      "top_n": TOP_N, "repetition_penalty": PENALTY,
                      "variants": {v: {"logprobs": i, "top_logprobs": TOP_N if i else 0,
                                       "repetition_penalty": PENALTY if p_ else 0.0}
                                   for v, (i, p_) in VARIANTS.items()}},
            "summary": summary, "ratios": ratios, "spec_output_equals_none": same,
            "runs_per_config": len(prompts) * repeats, "info_complete": all(info), "runs": runs}


def print_parameters(r: dict) -> None:
    spec = r["setup"]["spec"]
    print(f"\nparameters: {', '.join(VARIANTS)} (logprobs = logprob and rank of every token and the "
          f"{TOP_N} likeliest; penalty = repetition_penalty {PENALTY}); speculation {spec} (k={r['setup']['k']}) "
          f"and none; {r['runs_per_config']} runs each")
    print("\n| request | speculation | tokens/s (all prompts) | median (min-max) | tokens | acceptance "
          "| mean accepted length |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, s in r["summary"].items():
        v, m = name.split("/")
        acc = f"{s['acceptance']:.0%}" if s["acceptance"] is not None else "-"
        mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] is not None else "-"
        tokens = sum(x["tokens"] for x in r["runs"][name])
        print(f"| {v} | {m} | {s['tok_s_total']:.2f} | {s['tok_s_median']:.2f} ({s['tok_s_min']:.2f}-"
              f"{s['tok_s_max']:.2f}) | {tokens} | {acc} | {mal} |")
    goals = {f"info_cost/{spec}": ">= 0.95", "info_cost/none": ">= 0.95", "kept/penalty": ">= 0.90"}
    # The paired median is the figure to read: each of its ratios compares two runs made next to
    # each other, where the ratio of totals weighs every run by its seconds, slow (disturbed) ones most.
    print("\n| ratio | paired by pass and prompt: median (min-max) | of totals | goal |")
    print("| --- | --- | --- | --- |")
    for name, x in r["ratios"].items():
        tot = f"{x['of_totals']:.3f}" if x["of_totals"] is not None else "-"
        pr = x.get("paired")
        pr = f"{pr['median']:.3f} ({pr['min']:.3f}-{pr['max']:.3f})" if pr else "-"
        print(f"| {x['what']} | {pr} | {tot} | {goals.get(name, '')} |")
    same = r["spec_output_equals_none"]
    print(f"\noutput with speculation {spec} identical to none: "
          + ", ".join(f"{v} {n}/{r['runs_per_config']}" for v, n in same.items())
          + f"; per-token information complete in every run that asked: {r['info_complete']}")
    print("(the penalty changes the output, so compare tokens/s, not texts, across variants; "
          "'speed-up with penalty / plain speed-up' is the goal's reading of the kept share, "
          "'(speed-up with penalty - 1) / (plain speed-up - 1)' the stricter one, of the gain alone)")
    if r["ratios"]["speedup/plain"]["paired"]["median"] <= 1:
        print(f"note: {spec} gives no speed-up on plain requests with these models and prompts, so the "
              "kept share says nothing here")



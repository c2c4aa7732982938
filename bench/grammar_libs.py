"""python -m bench.grammar_libs: xgrammar against llguidance for constrained decoding, on this host's CPU.

Each library runs in its own subprocess (memory figures stay apart) with the model's tokenizer (never its
weights) and masks over the model's full vocabulary. Measured: import; tokenizer preparation and the RSS it
adds; the RSS one compiled schema + matcher adds; compiling a JSON Schema, a generic JSON object, two regexes,
a choice and an arithmetic grammar, cold (fresh compiler; llguidance has no cache), warm, and a fresh
matcher's first mask (llguidance builds its lexer lazily). Along a schema instance tokenized as the model
would, per token: fill the bitmask, check the document's token is allowed (else a violation), accept it, then
EOS must be allowed; rollback(8) + re-accept and jump-forward at every position; applying a mask to CPU logits
with the library's helper; the errors for bad inputs; installed size with what each library pulls in. Same
JSON layout for both: no free whitespace, separators ", " and ": ", property order as declared.

    python -m bench.grammar_libs [--model qwen2.5-coder-1.5b-instruct] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata as md
import json
import statistics
import subprocess
import sys
import time

import numpy as np

LIBS = {"xgrammar": ["xgrammar", "apache-tvm-ffi", "triton"], "llguidance": ["llguidance"]}
VOCAB = 151936                                    # model rows: masks cover all of them


def obj(required: list[str], **props) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


STR, NUM = {"type": "string"}, {"type": "number", "minimum": 0}
SCHEMA = obj(["invoice_id", "issued", "status", "currency", "total", "paid", "customer", "lines"],
             invoice_id={"type": "string", "pattern": "^INV-[0-9]{6}$"}, issued={"type": "string", "format": "date"},
             status={"enum": ["draft", "sent", "paid", "overdue"]},
             currency={"type": "string", "enum": ["EUR", "USD", "GBP"]}, total=NUM, paid={"type": "boolean"},
             customer=obj(["name", "address"], name={"type": "string", "maxLength": 80}, email=STR,
                          vat_id={"type": ["string", "null"]},
                          address=obj(["city", "country"], street=STR, city=STR,
                                      country={"type": "string", "minLength": 2, "maxLength": 2})),
             lines={"type": "array", "minItems": 1, "items": obj(
                 ["sku", "quantity", "unit_price"], sku={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                 description=STR, quantity={"type": "integer", "minimum": 1}, unit_price=NUM,
                 tax_rate={"type": "number", "minimum": 0, "maximum": 1})},
             notes=STR, tags={"type": "array", "items": STR, "maxItems": 5}, due_in_days={"type": "integer"})
INSTANCE = {"invoice_id": "INV-004217", "issued": "2024-11-03", "status": "sent", "currency": "EUR", "total": 1289.4,
            "paid": False, "customer": {"name": "Müller & Söhne GmbH", "email": "ap@mueller-soehne.de", "vat_id": None,
                                        "address": {"street": "Hauptstraße 12", "city": "Köln", "country": "DE"}},
            "lines": [{"sku": "KBD-1042", "description": "Mechanical keyboard, ISO layout", "quantity": 4,
                       "unit_price": 89.9, "tax_rate": 0.19}, {"sku": "MON-2701", "quantity": 2, "unit_price": 399.0}],
            "tags": ["hardware", "q4"], "due_in_days": 30}      # the optional "notes" left out on purpose
DOC = json.dumps(INSTANCE, ensure_ascii=False)
DATETIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})"
EMAIL = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"
CHOICES = ["positive", "negative", "neutral", "mixed"]
ARITH = '{0}expr\nexpr{1}term (("+" | "-") term)*\nterm{1}factor (("*" | "/") factor)*\nfactor{1}{2} | "(" expr ")"\n'
EBNF = ARITH.format("root ::= ", " ::= ", "number") + 'number ::= [0-9]+ ("." [0-9]+)?'
LARK = ARITH.format("start: ", ": ", "NUMBER") + r"NUMBER: /[0-9]+(\.[0-9]+)?/"
KINDS = ["schema", "json", "regex_datetime", "regex_email", "choice", "grammar"]
BAD = {"schema": {"type": "object", "properties": {"a": {"type": "integr"}}}, "regex": "[a-z",
       "ebnf": 'root ::= "a" | missing_rule', "lark": 'start: "a" | missing_rule'}


def proc_mb(field: str) -> float:
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(field + ":")) / 1024


def clock(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def dist(xs: list[float]) -> dict:
    us = sorted(x * 1e6 for x in xs)
    return {"median_us": statistics.median(us), "p95_us": us[int(0.95 * (len(us) - 1))], "max_us": us[-1], "n": len(us)}


def error_text(fn) -> str:
    try:
        return f"no exception; {fn()}"[:300]
    except Exception as e:  # noqa: BLE001 - the point is to record what each library raises
        return f"raises {type(e).__module__}.{type(e).__name__}: {str(e).strip()[:240]!r}"


class Xgr:
    """xgrammar: GrammarCompiler -> CompiledGrammar (masks precomputed) -> GrammarMatcher per request."""

    def __init__(self): self.x = importlib.import_module("xgrammar")
    def new_compiler(self): return self.x.GrammarCompiler(self.info)
    def matcher(self, g): return self.x.GrammarMatcher(g)
    def fill(self, m, bm): m.fill_next_token_bitmask(bm)
    def accept(self, m, t): return m.accept_token(t)
    def rollback(self, m, n): m.rollback(n)
    def forced(self, m): return m.find_jump_forward_string()
    def accepting(self, m): return m.is_completed()
    def reset(self, m): m.reset()
    def apply(self, logits, bm): self.x.apply_token_bitmask_inplace(logits, bm)

    def prepare(self, tok) -> None:
        self.info = self.x.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB)
        self.compiler = self.new_compiler()

    def compile(self, kind: str, c=None):
        c = c or self.compiler
        return {"schema": lambda: c.compile_json_schema(SCHEMA, any_whitespace=False, separators=(", ", ": ")),
                "json": c.compile_builtin_json_grammar, "regex_datetime": lambda: c.compile_regex(DATETIME),
                "regex_email": lambda: c.compile_regex(EMAIL),
                "choice": lambda: c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES)),
                "grammar": lambda: c.compile_grammar(EBNF), "bad_schema": lambda: c.compile_json_schema(BAD["schema"]),
                "bad_regex": lambda: c.compile_regex(BAD["regex"]), "bad_ebnf": lambda: c.compile_grammar(BAD["ebnf"]),
                "bad_lark": lambda: c.compile_lark(BAD["lark"])}[kind]()


class Llg:
    """llguidance: grammar text -> LLMatcher (parser + lazy lexer); a matcher per request by deep_copy()."""

    def __init__(self):
        import llguidance
        import llguidance.hf
        self.x = llguidance

    def prepare(self, tok): self.tok = self.x.hf.from_tokenizer(tok, n_vocab=VOCAB)
    def new_compiler(self): return None           # nothing is cached between grammars
    def matcher(self, g): return g.deep_copy()
    def fill(self, m, bm): self.x.torch.fill_next_token_bitmask(m, bm)
    def accept(self, m, t): return m.consume_token(t)
    def rollback(self, m, n): m.rollback(n)
    def forced(self, m): return m.compute_ff_bytes().decode("utf-8", "replace")
    def accepting(self, m): return m.is_accepting()
    def reset(self, m): m.reset()
    def apply(self, logits, bm): self.x.torch.apply_token_bitmask_inplace(logits, bm)

    def build(self, grammar: str):
        m = self.x.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():                          # LLMatcher never raises on a bad grammar: it is a state
            raise ValueError(f"(LLMatcher did not raise; is_error() is True) get_error(): {m.get_error()}")
        return m

    def compile(self, kind: str, c=None):
        if kind == "schema":
            opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
            return self.build(self.x.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=opts))
        return self.build(self.x.grammar_from(*{
            "json": ("json_schema", '{"type": "object"}'), "regex_datetime": ("regex", DATETIME),
            "regex_email": ("regex", EMAIL), "choice": ("choice", json.dumps(CHOICES)), "grammar": ("lark", LARK),
            "bad_schema": ("json_schema", json.dumps(BAD["schema"])), "bad_regex": ("regex", BAD["regex"]),
            "bad_ebnf": ("gbnf", BAD["ebnf"]), "bad_lark": ("lark", BAD["lark"])}[kind]))


def allowed(bm, t: int) -> bool: return bool((int(bm[0, t >> 5]) >> (t & 31)) & 1)


def walk(lib, m, tokens, bm, eos: int) -> dict:
    """Fill, check and accept every document token, then check EOS is allowed; the matcher is left at the end."""
    fills, accepts, sizes, bad = [], [], [], 0
    for t in tokens:
        fills.append(clock(lib.fill, m, bm)[0])
        sizes.append(int(np.unpackbits(bm.numpy().view(np.uint8)).sum()))
        bad += not allowed(bm, t)
        dt, ok = clock(lib.accept, m, t)
        accepts.append(dt)
        if not ok:                                # a failed accept is a violation too, once
            return {"violations": bad + allowed(bm, t), "failed_at": len(fills) - 1}
    lib.fill(m, bm)
    end = lib.accepting(m) and allowed(bm, eos)
    return {"mask": dist(fills), "accept": dist(accepts), "violations": bad, "eos_allowed_at_end": end,
            "allowed_tokens": {"median": statistics.median(sizes), "min": min(sizes), "max": max(sizes)}}


def child(lib_name: str, model: str, repeats: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from tandem.presets import resolve_model
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    tokens = tok.encode(DOC, add_special_tokens=False)
    r0 = proc_mb("VmRSS")
    t_import, lib = clock({"xgrammar": Xgr, "llguidance": Llg}[lib_name])
    t_helpers, _ = clock(importlib.import_module, f"{lib_name}.torch" if lib_name == "llguidance" else lib_name)
    r1 = proc_mb("VmRSS")
    t_prep, _ = clock(lib.prepare, tok)
    r2 = proc_mb("VmRSS")
    g_schema = lib.compile("schema", lib.new_compiler())
    keep = lib.matcher(g_schema)                  # held, so that the RSS below counts a matcher too
    out = {"import_s": t_import, "helpers_import_s": t_helpers, "import_rss_mb": r1 - r0, "prepare_s": t_prep,
           "prepare_rss_mb": r2 - r1, "schema_rss_mb": proc_mb("VmRSS") - r2, "doc_tokens": len(tokens), "compile": {},
           "schema_memory_size_bytes": getattr(g_schema, "memory_size_bytes", None), "version": md.version(lib_name)}
    bm = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    for kind in KINDS:                            # each run: fresh compiler, compile, compile again, 1st mask
        runs = []
        for _ in range(repeats):
            c = lib.new_compiler()
            cold, g = clock(lib.compile, kind, c)
            runs.append((cold, clock(lib.compile, kind, c)[0], clock(lib.fill, lib.matcher(g), bm)[0]))
        medians = [statistics.median(x) * 1e3 for x in zip(*runs)]
        out["compile"][kind] = dict(zip(("cold_ms", "warm_ms", "first_mask_ms"), medians))
    for kind, g in (("schema", g_schema), ("json", lib.compile("json"))):
        m = lib.matcher(g)
        out[f"walk_{kind}"] = walk(lib, m, tokens, bm, tok.eos_token_id)
        lib.reset(m)
        out[f"walk_{kind}_after_reset"] = walk(lib, m, tokens, bm, tok.eos_token_id)
    m, ffs, forced, shown, backs, bad = lib.matcher(g_schema), [], [], {}, [], 0
    for i, t in enumerate(tokens + [None]):       # at each position: jump-forward, accept, rollback 8, re-accept
        text = tok.decode(tokens[:i])
        dt, s = clock(lib.forced, m)
        ffs.append(dt)
        forced.append(s)
        if i == 0 or (text.endswith(('{"', "[", ",", '":')) and len(shown) < 10):
            shown[f"{i}:{text[-12:]}"] = s
        bad += t is not None and not lib.accept(m, t)
        if t is not None and i >= 8:
            backs.append(clock(lib.rollback, m, 8)[0])
            bad += sum(not lib.accept(m, u) for u in tokens[i - 7:i + 1])
    out["rollback8"] = {**dist(backs), "reaccept_failures": bad}
    out["jump_forward"] = {**dist(ffs), "nonempty_positions": sum(map(bool, forced)),
                           "forced_chars": sum(map(len, forced)), "at": shown}
    logits = torch.randn(1, VOCAB)
    lib.fill(keep, bm)                            # the first mask of the schema
    first, _ = clock(lib.apply, logits, bm)
    steady = [clock(lib.apply, logits, bm)[0] for _ in range(20)]
    out["apply"] = {"first_ms": first * 1e3, "steady_us": statistics.median(steady) * 1e6,
                    "allowed_after": int(torch.isfinite(logits).sum())}
    out["errors"] = {k: error_text(lambda k=k: lib.compile(f"bad_{k}")) for k in BAD}
    out["installed"] = installed_mb(LIBS[lib_name])
    return {**out, "peak_rss_mb": proc_mb("VmHWM"), "installed_mb": sum(out["installed"].values())}


def installed_mb(names: list[str]) -> dict:
    """du of every top-level site-packages entry the distributions install."""
    sizes = {}
    for name in names:
        d = md.distribution(name)
        roots = {str(d.locate_file(f.parts[0])) for f in d.files or [] if f.parts[0] != ".."}
        du = subprocess.run(["du", "-sck", *roots], check=True, capture_output=True, text=True).stdout
        sizes[f"{name} {d.version}"] = int(du.splitlines()[-1].split()[0]) / 1024
    return sizes


def table(res: dict) -> str:
    rows = [("import (s)", "import_s", 2), ("import torch helpers (s)", "helpers_import_s", 2),
            ("import + helpers RSS (MB)", "import_rss_mb", 0), ("tokenizer prep (s)", "prepare_s", 2),
            ("tokenizer prep RSS (MB)", "prepare_rss_mb", 0), ("schema compile + matcher RSS (MB)", "schema_rss_mb", 1),
            ("peak RSS (MB)", "peak_rss_mb", 0), ("installed size, with extra deps (MB)", "installed_mb", 0)]
    rows += [(f"compile {k}: {c} (ms)", f"compile.{k}.{c}_ms", 2) for k in KINDS for c in ("cold", "warm", "first_mask")]
    for w in ("walk_schema", "walk_schema_after_reset", "walk_json", "walk_json_after_reset"):
        rows += [(f"{w}: mask median / p95 / max (us)", f"{w}.mask.median_us {w}.mask.p95_us {w}.mask.max_us", 1),
                 (f"{w}: accept median / p95 (us)", f"{w}.accept.median_us {w}.accept.p95_us", 1),
                 (f"{w}: allowed tokens median / min", f"{w}.allowed_tokens.median {w}.allowed_tokens.min", 0),
                 (f"{w}: violations / EOS allowed at end", f"{w}.violations {w}.eos_allowed_at_end", 0)]
    jf = "jump_forward.median_us jump_forward.p95_us jump_forward.nonempty_positions jump_forward.forced_chars"
    rows += [("rollback 8: median / p95 (us) / failures",
              "rollback8.median_us rollback8.p95_us rollback8.reaccept_failures", 1),
             ("jump-forward: median / p95 (us) / positions forcing text / chars", jf, 1),
             ("apply bitmask to CPU logits: first call (ms) / steady (us)", "apply.first_ms apply.steady_us", 1)]

    def cell(r: dict, keys: str, nd: int) -> str:
        vals = [functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key.split("."), r)
                for key in keys.split()]
        return " / ".join("n/a" if v is None else str(v) if isinstance(v, bool)
                          else f"{v:,.{0 if isinstance(v, int) else nd}f}" for v in vals)
    head = ["| measurement | " + " | ".join(res) + " |", "|---|" + "---|" * len(res)]
    return "\n".join(head + [f"| {label} | " + " | ".join(cell(r, k, nd) for r in res.values()) + " |"
                             for label, k, nd in rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--repeats", type=int, default=5, help="compile runs per grammar (median kept)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--lib", choices=list(LIBS), help="(internal) measure one library, print its JSON")
    a = p.parse_args()
    if a.lib:
        print(json.dumps(child(a.lib, a.model, a.repeats)))
        return
    from bench.report import machine, write_json
    res = {}
    for lib in LIBS:
        cmd = [sys.executable, "-m", "bench.grammar_libs", "--lib", lib, "--model", a.model, f"--repeats={a.repeats}"]
        res[lib] = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()[-1])
    print(table(res))
    for lib, r in res.items():
        print(f"\n{lib} {r['version']}: installed MB {json.dumps(r['installed'])}\n  jump-forward (at:text -> forced):")
        for pos, forced in r["jump_forward"]["at"].items():
            print(f"    {pos!r:24} -> {forced!r}")
        print("  errors:\n" + "\n".join(f"    {k}: {v}" for k, v in r["errors"].items()))
    if a.json:
        write_json(a.json, {"machine": machine(), "model": a.model, "vocab": VOCAB, "doc": DOC, "results": res})


if __name__ == "__main__":
    main()

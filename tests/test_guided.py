"""Structured output (guided decoding) through the whole service, both faces.

Proven here:
- Greedy guided decoding is lossless under speculation: on SmolLM2-135M-Instruct, for a JSON Schema
  (nested object, array of objects, enum, integer, boolean), any JSON, a regex, a choice and an EBNF
  grammar, and for the drafters model, ngram and none, the generated tokens equal transformers'
  `generate` of the target alone under xgrammar's own HF logits processor (compiled here straight from
  xgrammar, not through tandem's grammar module). Each finished output validates against its guide,
  and the finish reason is GUIDE_COMPLETE exactly where xgrammar allows nothing but end-of-sequence.
- The TGIS face (params.decoding json_schema / choice / format=JSON) gives the native face's text and
  stop reason EOS_TOKEN; format=TEXT is unconstrained.
- Bad guides are refused on both faces with INVALID_ARGUMENT naming the field, whether the gateway
  (not JSON, empty, empty choices, over the size limit) or the verify worker (does not compile, took
  too long to compile) finds the fault; a good guided request succeeds after each.
- min_new_tokens does not hold off a complete guide; sampled guided output (tiny models) always
  matches and is reproducible under a seed.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import grpc
import jsonschema
import pytest
import pytest_asyncio
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from fmaas import generation_pb2 as fm
from gateway.request import Limits
from tandem.client import build_request
from tandem.presets import resolve_model
from tandem.v1 import generation_pb2 as tpb
from tests.stack import stack, start_stack, stop_stack  # noqa: F401  (stack: the fixture)

pytestmark = pytest.mark.service

NEW = 80
LIMIT = 1000             # the SmolLM2 stack's max_guide_chars
TIMEOUT = 120
GUIDE_DONE = tpb.FINISH_REASON_GUIDE_COMPLETE
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member", "address", "pets"],
          "properties": {
              "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "member": {"type": "boolean"},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "country": {"type": "string", "enum": ["France", "Italy", "Norway"]}}},
              "pets": {"type": "array", "maxItems": 2,
                       "items": {"type": "object", "additionalProperties": False, "required": ["kind", "legs"],
                                 "properties": {"kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
                                                "legs": {"type": "integer"}}}}}}
EVENT = {"type": "object", "additionalProperties": False, "required": ["title", "day", "price", "tags", "venue"],
         "properties": {
             "title": {"type": "string", "maxLength": 16},
             "day": {"type": "string", "enum": ["Monday", "Friday", "Sunday"]},
             "price": {"type": "number"},
             "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
             "venue": {"type": "object", "additionalProperties": False, "required": ["name", "seats"],
                       "properties": {"name": {"type": "string", "maxLength": 12}, "seats": {"type": "integer"}}}}}
DATE = r"\d{4}-\d{2}-\d{2}"
MOODS = ["positive", "negative", "neutral", "mixed"]
SQL = 'root ::= "SELECT " col " FROM " tbl\ncol ::= "name" | "age" | "*"\ntbl ::= "users" | "orders"'

# name: (kind, value, question, validate(text))
CASES = {
    "json_schema": ("json_schema", json.dumps(SCHEMA),
                    "Describe Alice, 31, a club member from Paris, France, who has a cat, as JSON.",
                    lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "json_schema_event": ("json_schema", json.dumps(EVENT),
                          "A jazz concert on Friday at the Blue Hall (200 seats), tickets 12.5 euros. As JSON.",
                          lambda t: jsonschema.validate(json.loads(t), EVENT)),
    "json_object": ("json_object", True, 'Give a short JSON object with the keys "city" and "population" for Rome.',
                    json.loads),
    "regex": ("regex", DATE, "On what date did Apollo 11 land on the Moon? Answer as YYYY-MM-DD.",
              lambda t: re.fullmatch(DATE, t) or pytest.fail(t)),
    "choice": ("choice", MOODS, ("Sentiment of: 'I loved this film, it was wonderful!' "
                                 "Answer positive, negative, neutral or mixed."), lambda t: t in MOODS or pytest.fail(t)),
    "grammar": ("grammar", SQL, "Write an SQL query that lists the names of all users.",
                lambda t: re.fullmatch(r"SELECT (name|age|\*) FROM (users|orders)", t) or pytest.fail(t)),
}


def set_guide(m, kind: str, value) -> None:
    """Sets one kind of a Guided (native) or DecodingParameters (TGIS) oneof."""
    if kind == "choice":
        m.choice.SetInParent()
        m.choice.choices.extend(value)
    elif kind == "json_object":
        m.json_object = value
    else:
        setattr(m, kind, value)


def native(prompt: str, kind: str | None, value=None, method: str = "model", new: int = NEW, **sampling):
    req = build_request(prompt, max_new_tokens=new, method=method, k=4)
    for name, v in sampling.items():
        setattr(req.sampling, name, v)
    req.logprobs.logprobs = True         # to read the generated token ids
    if kind:
        set_guide(req.guided, kind, value)
    return req


def tgis(prompt: str, kind: str | None = None, value=None, new: int = NEW) -> fm.BatchedGenerationRequest:
    p = fm.Parameters(method=fm.GREEDY, stopping=fm.StoppingCriteria(max_new_tokens=new))
    if kind == "format":
        p.decoding.format = value
    elif kind:
        set_guide(p.decoding, kind, value)
    return fm.BatchedGenerationRequest(requests=[fm.GenerationRequest(text=prompt)], params=p)


MD = (("x-tandem-draft-method", "model"), ("x-tandem-num-speculative-tokens", "4"))
MD_NONE = (("x-tandem-draft-method", "none"),)


@pytest.fixture(scope="module")
def oracle():
    """SmolLM2 in transformers, the target alone, with an xgrammar compiler for its vocabulary."""
    folder = str(resolve_model("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size, stop_token_ids=eos)
    return SimpleNamespace(folder=folder, model=model, tok=tok, eos=eos, compiler=xgr.GrammarCompiler(info),
                           cache={})


def chat(oracle, question: str) -> str:
    """The prompt text of a one-question conversation under the model's chat template."""
    return oracle.tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                          add_generation_prompt=True)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def smol(oracle):
    s = await start_stack(oracle.folder, oracle.folder, limits=Limits(max_guide_chars=LIMIT))
    s.draft.drafting.adaptive_k = False      # draft every round, so that every test speculates
    yield s
    await stop_stack(s)


def compiled(compiler: xgr.GrammarCompiler, kind: str, value) -> xgr.CompiledGrammar:
    if kind == "json_schema":
        return compiler.compile_json_schema(value, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in value))
    return compiler.compile_grammar(value)


def reference(oracle, case: str) -> tuple[list[int], bool, bool]:
    """(generated ids without EOS, whether it ended, whether xgrammar allows only EOS after them)."""
    model, tok, eos, cache = oracle.model, oracle.tok, oracle.eos, oracle.cache
    if case not in cache:
        kind, value, question, _ = CASES[case]
        grammar = compiled(oracle.compiler, kind, value)
        ids = tok(chat(oracle, question), return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                 logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)], pad_token_id=eos[0])
        gen = out[0, ids.shape[1]:].tolist()
        ended = gen[-1] in eos
        gen = gen[:-1] if ended else gen
        matcher = xgr.GrammarMatcher(grammar)
        assert all(matcher.accept_token(t) for t in gen)
        scores = torch.zeros(1, model.config.vocab_size)
        mask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(scores, mask)
        cache[case] = gen, ended, set(torch.nonzero(scores[0] == 0).flatten().tolist()) <= set(eos)
    return cache[case]


@pytest.mark.parametrize("method", ["model", "ngram", "none"])
@pytest.mark.parametrize("case", list(CASES))
async def test_greedy_guided_equals_transformers(smol, oracle, case, method):
    kind, value, question, validate = CASES[case]
    want, ended, closed = reference(oracle, case)
    r = await smol.tandem.Generate(native(chat(oracle, question), kind, value, method), timeout=TIMEOUT)
    assert [t.token_id for t in r.tokens] == want, (r.text, oracle.tok.decode(want))
    assert r.text == oracle.tok.decode(want, skip_special_tokens=True)
    if not ended:                        # free JSON may run past max_new_tokens: then only the tokens count
        assert r.finish_reason == tpb.FINISH_REASON_LENGTH and len(want) == NEW
        return
    validate(r.text)
    assert r.finish_reason == (GUIDE_DONE if closed else tpb.FINISH_REASON_EOS)
    if case != "json_object":            # these guides close by themselves
        assert r.finish_reason == GUIDE_DONE
    assert method == "none" or len(want) < 8 or r.usage.draft_tokens > 0


@pytest.mark.parametrize("kind,value,case", [("json_schema", json.dumps(SCHEMA), "json_schema"),
                                             ("choice", MOODS, "choice"),
                                             ("format", fm.DecodingParameters.JSON, "json_object")])
async def test_tgis_guided_equals_native(smol, oracle, kind, value, case):
    prompt = chat(oracle, CASES[case][2])
    want = await smol.tandem.Generate(native(prompt, *CASES[case][:2], "none"), timeout=TIMEOUT)
    [r] = (await smol.tgis.Generate(tgis(prompt, kind, value), metadata=MD_NONE, timeout=TIMEOUT)).responses
    assert r.text == want.text and r.generated_token_count == len(want.tokens)
    assert case == "json_object" or want.finish_reason == GUIDE_DONE
    if want.finish_reason in (GUIDE_DONE, tpb.FINISH_REASON_EOS):
        assert r.stop_reason == fm.EOS_TOKEN
        CASES[case][3](r.text)


async def test_tgis_format_text_is_unconstrained(smol, oracle):
    prompt = chat(oracle, "Say hello to Bob in one short sentence.")
    free = await smol.tandem.Generate(native(prompt, None, new=16), timeout=TIMEOUT)
    [r] = (await smol.tgis.Generate(tgis(prompt, "format", fm.DecodingParameters.TEXT, 16), metadata=MD,
                                    timeout=TIMEOUT)).responses
    assert r.text == free.text and free.text.strip()
    with pytest.raises(ValueError):
        json.loads(r.text)               # what a JSON guide would have made of it


# (kind, value, words in the message); "@" stands for the face's path to the field
BAD = [
    ("json_schema", "{not json", "@json_schema is not JSON"),
    ("json_schema", "", "@json_schema must not be empty"),
    ("json_schema", "[1, 2]", "@json_schema must be a JSON object"),
    ("json_schema", '{"type": "integr"}', 'json_schema does not compile: Unsupported type "integr"'),
    # no value satisfies it: the guide would end the output at once, empty, which is no JSON (found
    # by tests/test_fuzz.py; it answered OK with an empty output before)
    ("json_schema", '{"anyOf": [], "minItems": 3}', "json_schema admits no JSON value"),
    ("regex", "[a-z", "regex does not compile: "),
    ("grammar", 'root ::= "a" undefined_rule', "grammar does not compile: "),
    ("choice", [], "@choice must hold at least one string"),
    ("choice", ["yes", ""], "@choice[1] is empty"),
    ("regex", "a" * (LIMIT + 1), f"@regex is {LIMIT + 1} characters; the limit is {LIMIT}"),
    ("choice", ["x" * 600, "y" * 600], f"@choice is 1200 characters; the limit is {LIMIT}"),
]


async def refused(smol, face: str, kind: str, value) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if face == "native":
            await smol.tandem.Generate(native("Answer:", kind, value, new=8), timeout=TIMEOUT)
        else:
            await smol.tgis.Generate(tgis("Answer:", kind, value, 8), metadata=MD, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


async def still_serves(smol) -> None:
    r = await smol.tandem.Generate(native("Pick one:", "choice", ["up", "down"], new=8), timeout=TIMEOUT)
    assert r.text in ("up", "down") and r.finish_reason == GUIDE_DONE


@pytest.mark.parametrize("face,path", [("native", "guided."), ("tgis", "params.decoding.")])
@pytest.mark.parametrize("kind,value,words", BAD)
async def test_bad_guide_is_invalid_argument(smol, face, path, kind, value, words):
    details = await refused(smol, face, kind, value)
    assert words.replace("@", path) in details, details
    await still_serves(smol)


@pytest.mark.parametrize("face", ["native", "tgis"])
async def test_compile_timeout_is_invalid_argument(smol, face):
    # about a second to compile (nested bounded repetition), so that the timeout cannot miss it
    letter = "z" if face == "native" else "y"
    schema = json.dumps({"type": "array", "items": {"type": "string", "pattern": f"([a-{letter}]{{1,30}}-){{1,20}}"}})
    before, smol.verify.compile_timeout = smol.verify.compile_timeout, 1e-6
    try:
        details = await refused(smol, face, "json_schema", schema)
    finally:
        smol.verify.compile_timeout = before
    assert "json_schema took longer than 1e-06 s to compile" in details, details
    await still_serves(smol)


@pytest.mark.parametrize("method", ["model", "none"])
async def test_min_new_tokens_does_not_hold_off_a_complete_guide(smol, oracle, method):
    kind, value, question, _ = CASES["choice"]
    r = await smol.tandem.Generate(native(chat(oracle, question), kind, value, method, min_new_tokens=20),
                                   timeout=TIMEOUT)
    assert r.text in MOODS and r.finish_reason == GUIDE_DONE and len(r.tokens) < 20


@pytest.mark.parametrize("kind,value,matches", [
    ("choice", ["alpha", "beta", "gamma delta"], lambda t: t in ("alpha", "beta", "gamma delta")),
    ("regex", DATE, lambda t: re.fullmatch(DATE, t)),
    ("regex", "[a-z]{3,8}", lambda t: re.fullmatch("[a-z]{3,8}", t)),
])
async def test_sampled_guided_output_matches_and_repeats(stack, kind, value, matches):  # noqa: F811
    stack.draft.drafting.adaptive_k = False
    try:
        for seed in (1, 2, 3):
            req = native("The quick brown fox", kind, value, "model", 16, temperature=0.8, seed=seed)
            first, again = [await stack.tandem.Generate(req, timeout=TIMEOUT) for _ in range(2)]
            assert matches(first.text), (seed, first.text)
            assert first.finish_reason in (GUIDE_DONE, tpb.FINISH_REASON_EOS)
            assert again.text == first.text and [t.token_id for t in again.tokens] == [t.token_id for t in first.tokens]
    finally:
        stack.draft.drafting.adaptive_k = True


async def test_jump_forward_is_counted_apart_and_changes_no_token(smol, oracle):
    """The tokens a schema forces (keys, punctuation) are proposed by jump-forward and reported as
    forced_tokens, not as the drafter's; turned off, the same output comes with none forced."""
    req = native(chat(oracle, CASES["json_schema"][2]), "json_schema", json.dumps(SCHEMA), "ngram")
    on = await smol.tandem.Generate(req, timeout=TIMEOUT)
    smol.draft.drafting.jump_forward = False
    try:
        off = await smol.tandem.Generate(req, timeout=TIMEOUT)
    finally:
        smol.draft.drafting.jump_forward = True
    assert [t.token_id for t in on.tokens] == [t.token_id for t in off.tokens]
    assert 0 < on.usage.forced_accepted_tokens <= on.usage.forced_tokens
    assert off.usage.forced_tokens == 0 and off.usage.verify_rounds > on.usage.verify_rounds

"""Thousands of hostile requests, every field of the public faces drawn by hypothesis, plus bytes
that are no message at all, while a well-formed stream runs next to them. Each hostile request
must get a proper status (never UNKNOWN or INTERNAL), and every well-formed stream must be the
target's greedy output. TANDEM_FUZZ_EXAMPLES scales the number of examples.

The processing and reporting fields (penalties, typical-p, length penalty, logprobs / TGIS
response options, truncate_input_tokens) are also probed on otherwise valid requests, so their
checks are reached rather than hidden behind an earlier refusal: there the status must be exactly
INVALID_ARGUMENT naming a field out of range, or OK with the counts the request asked for.

Structured output (guided decoding) is fuzzed on its own: JSON Schemas, regexes, choices and EBNF
grammars, well-formed and hostile, on both faces and in oneof combinations, while guided greedy
streams stay what they were before the fuzzing began. What that fuzzing found (JSON nested past
the parser, jump-forward without end, the end-of-sequence token's text, an unbounded compile cache)
is fixed; the tests at the end of the file failed before the fixes."""

import asyncio
import json
import math
import os
import re
import time
from collections import Counter

import grpc
import pytest
import pytest_asyncio
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fmaas import generation_pb2 as tgis_pb
from gateway.guard import ClientGuard, TokenSet
from gateway.request import Limits
from tandem.client import build_request
from tandem.speculation.sampling import MIN_REPETITION_PENALTY, SamplingParams
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.local import reference
from tests.stack import live_sessions, start_stack, stop_stack, wait_until_idle
from vllm_engine import vllm_engine_pb2 as vllm_pb

# The in-process gateway draws from `random` (routing tie-breaks) while hypothesis runs its examples.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "150"))
PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
METHODS = {  # path -> (request class, server streaming)
    "/tandem.v1.GenerationService/Generate": (pb.GenerateRequest, False),
    "/tandem.v1.GenerationService/GenerateStream": (pb.GenerateRequest, True),
    "/fmaas.GenerationService/Generate": (tgis_pb.BatchedGenerationRequest, False),
    "/fmaas.GenerationService/GenerateStream": (tgis_pb.SingleGenerationRequest, True),
    "/fmaas.GenerationService/Tokenize": (tgis_pb.BatchedTokenizeRequest, False),
    "/fmaas.GenerationService/ModelInfo": (tgis_pb.ModelInfoRequest, False),
    "/vllm.grpc.engine.VllmEngine/Generate": (vllm_pb.GenerateRequest, True),
    "/vllm.grpc.engine.VllmEngine/GetLoads": (vllm_pb.GetLoadsRequest, False),
}
GOOD_PROMPT, GOOD_TOKENS = "def add(a, b):", 16

TEXT = st.one_of(st.sampled_from(["", "def f(x):", "user", "system", "assistant", "tool", "\x00", "\ud7ff\U0001f600",
                                  "<|endoftext|>", "{{ raise }}", "model", "ngram"]),
                 st.integers(1000, 5000).map(lambda n: "x" * n), st.text(max_size=64))
INTS = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
        F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
        F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
        F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1)}


# Floats are a third non-finite, a third at the edges of every range the public faces check
# ((0, 1], [-2, 2], (0, 10], [1, 10]: just inside and just outside, the smallest and largest
# float32, negative zero), a third anything. Uniform draws alone left the nested fields (TGIS's
# typical_p, length_penalty.decay_factor) without a NaN in a run's few hundred examples.
NONFINITE = [float("nan"), float("inf"), float("-inf")]
EDGE_FLOATS = [0.0, -0.0, 0.5, 1.0, 1.5, -1.0, -0.5, 2.0, -2.0, 2.5, -2.5, 10.0, 10.5, 0.9, 1e-3,
               1.4e-45, -1.4e-45, 1e30, -1e30, 3.4e38, -3.4e38]


def floats(width: int) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(NONFINITE), st.sampled_from(EDGE_FLOATS), st.floats(width=width))


def scalar(field) -> st.SearchStrategy:
    if field.type in INTS:
        lo, hi = INTS[field.type]
        edges = [v for v in (0, 1, 2, 3, 8, 16, 17, 100, 2**31 - 1, lo, hi, -1) if lo <= v <= hi]
        return st.one_of(st.sampled_from(edges), st.integers(lo, hi))
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return floats(32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-5, 50))
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=32)
    return TEXT


def message(descriptor, cls, depth: int = 0) -> st.SearchStrategy:
    """Any message of this type: each field left unset or set to a hostile value, recursively."""
    fields = {}
    for f in descriptor.fields:
        if f.type == F.TYPE_MESSAGE:
            if depth >= 3 or f.message_type.GetOptions().map_entry:
                continue
            value = message(f.message_type, None, depth + 1)
        else:
            value = scalar(f)
        fields[f.name] = st.lists(value, max_size=4) if f.is_repeated else value

    def build(values: dict):
        m = cls() if cls is not None else _class(descriptor)()
        for name, v in values.items():
            target = getattr(m, name) if descriptor.fields_by_name[name].type == F.TYPE_MESSAGE else None
            if descriptor.fields_by_name[name].is_repeated:
                getattr(m, name).extend(v)
            elif target is not None:
                target.CopyFrom(v)
            else:
                setattr(m, name, v)
        return m
    return st.fixed_dictionaries({}, optional=fields).map(build)


def _class(descriptor):
    from google.protobuf import message_factory
    return message_factory.GetMessageClass(descriptor)


def well_formed() -> st.SearchStrategy:
    """Mostly valid requests with a few fields off: they go deeper than random ones do."""
    return st.builds(lambda prompt, n, temp, k, method, stop: build_request(
        prompt, max_new_tokens=n, temperature=temp, k=k, method=method, stop=stop, seed=7),
        TEXT, st.integers(0, 20), st.sampled_from([0.0, 0.7, 1.0, -0.1, float("nan")]),
        st.integers(0, 20), st.sampled_from(["model", "ngram", "none", ""]), st.lists(TEXT, max_size=3))


# ---- the processing and reporting fields, probed on requests that are valid but for them ----

PROBE_PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog.",
                 "x = [1, 2, 3]\nfor i in x:\n    print(i)"]
UINT32 = st.one_of(st.sampled_from([0, 1, 2, 5, 2**31 - 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
TOPS = st.one_of(st.sampled_from([0, 1, 5, 10, 11, 1000, 2**32 - 1]), st.integers(0, 2**32 - 1))


def maybe(lo: float, hi: float, clean: bool) -> st.SearchStrategy:
    """A float field left unset, anywhere in its range [lo, hi], or (unless clean) hostile."""
    inside = st.floats(lo, hi, width=32)
    return st.one_of(st.none(), inside) if clean else st.one_of(st.none(), floats(32), inside)


def tops(clean: bool) -> st.SearchStrategy:
    return st.integers(0, 10) if clean else TOPS


def truncations(ctx: int, clean: bool) -> st.SearchStrategy:
    if clean:
        return st.one_of(st.sampled_from([0, 0, 1, 3, 7, 8, 9, 30, 100, ctx - 1]), st.integers(0, ctx - 1))
    return st.one_of(st.sampled_from([0, 0, 1, 3, 7, 8, 9, 30, 100, ctx - 1, ctx, ctx + 1, 2**32 - 1]),
                     st.integers(0, 2**32 - 1))


# The ranges both faces accept; each comparison is False for NaN.
def repetition_ok(v: float) -> bool:
    return v == 0 or MIN_REPETITION_PENALTY <= v <= 10          # 0 (or 1) = off


def penalty_ok(v: float) -> bool:
    return -2 <= v <= 2


def typical_ok(v: float) -> bool:
    return v == 0 or 0 < v <= 1           # 0 = off


def decay_ok(v: float) -> bool:
    return 1 <= v <= 10


def kept(n: int, keep: int) -> int:
    """Prompt tokens left by truncate_input_tokens: more than the prompt holds keeps it whole."""
    return keep if 0 < keep < n else n


def check_native_reply(msgs: list, n_prompt: int, want_tokens: bool, top: int, want_prompt: bool) -> str | None:
    last = msgs[-1]
    usage = last.usage
    tokens = [t for m in msgs for t in m.tokens]
    prompt = [t for m in msgs for t in m.prompt_tokens]
    if usage.prompt_tokens != n_prompt:
        return f"usage.prompt_tokens {usage.prompt_tokens}, want {n_prompt}"
    if len(tokens) != (usage.generated_tokens if want_tokens else 0):
        return f"{len(tokens)} token reports for {usage.generated_tokens} tokens (asked: {want_tokens})"
    if any(len(t.top_logprobs) != top or t.rank < 1 or not t.logprob <= 0 for t in tokens):
        return f"token reports not of top {top}: {tokens[:2]}"
    if len(prompt) != (n_prompt if want_prompt else 0):
        return f"{len(prompt)} prompt reports for {n_prompt} prompt tokens (asked: {want_prompt})"
    return None


def check_tgis_reply(msgs: list, n_prompt: int, r: tgis_pb.ResponseOptions) -> str | None:
    if isinstance(msgs[0], tgis_pb.BatchedGenerationResponse):
        msgs = list(msgs[0].responses)
    first, last = msgs[0], msgs[-1]
    tokens = [t for m in msgs for t in m.tokens]
    if first.input_token_count != n_prompt:
        return f"input_token_count {first.input_token_count}, want {n_prompt}"
    if len(tokens) != (last.generated_token_count if r.generated_tokens else 0):
        return f"{len(tokens)} TokenInfos for {last.generated_token_count} tokens"
    for t in tokens:
        if (len(t.top_tokens) != r.top_n_tokens or (t.rank >= 1) != r.token_ranks
                or (r.token_logprobs and not t.logprob <= 0)):
            return f"TokenInfo not as {r} asked: {t}"
    if len(first.input_tokens) != (n_prompt if r.input_tokens else 0):
        return f"{len(first.input_tokens)} input TokenInfos for {n_prompt} prompt tokens"
    return None


@st.composite
def native_probe(draw, ctx: int, lengths: dict):
    """(path, request, metadata, names of the fields out of range, check of an OK reply)."""
    prompt, clean = draw(st.sampled_from(PROBE_PROMPTS)), draw(st.booleans())     # clean: every field in range
    req = build_request(prompt, max_new_tokens=draw(st.integers(1, 3)), temperature=draw(st.sampled_from([0.0, 0.8])),
                        seed=7, method=draw(st.sampled_from(["model", "ngram", "none"])), k=3)
    s, bad = req.sampling, []                # fields out of range
    for name, ok, lo, hi in (("repetition_penalty", repetition_ok, 0, 10), ("presence_penalty", penalty_ok, -2, 2),
                             ("frequency_penalty", penalty_ok, -2, 2), ("typical_p", typical_ok, 0, 1)):
        if (v := draw(maybe(lo, hi, clean))) is not None:
            setattr(s, name, v)
            if not ok(getattr(s, name)):         # as float32 holds it
                bad.append(name)
    if (v := draw(maybe(1, 10, clean))) is not None:
        s.length_penalty.start_index = draw(UINT32)
        s.length_penalty.decay_factor = v
        if not decay_ok(s.length_penalty.decay_factor):
            bad.append("length_penalty.decay_factor")
    lp = req.logprobs
    lp.logprobs, lp.prompt_logprobs, lp.top_logprobs = draw(st.booleans()), draw(st.booleans()), draw(tops(clean))
    if lp.top_logprobs > 10:
        bad.append("logprobs.top_logprobs")
    req.truncate_input_tokens = draw(truncations(ctx, clean))
    if req.truncate_input_tokens >= ctx:
        bad.append("truncate_input_tokens")
    n = kept(lengths[prompt], req.truncate_input_tokens)
    def check(msgs):
        return check_native_reply(msgs, n, lp.logprobs or lp.top_logprobs > 0, lp.top_logprobs, lp.prompt_logprobs)
    return draw(st.sampled_from(list(METHODS)[:2])), req, (), bad, check


@st.composite
def tgis_probe(draw, ctx: int, lengths: dict):
    prompt, clean = draw(st.sampled_from(PROBE_PROMPTS)), draw(st.booleans())
    method = draw(st.sampled_from([tgis_pb.GREEDY, tgis_pb.SAMPLE]))
    p = tgis_pb.Parameters(method=method, stopping=tgis_pb.StoppingCriteria(max_new_tokens=draw(st.integers(1, 3))))
    bad = []
    if method == tgis_pb.SAMPLE:
        p.sampling.temperature, p.sampling.seed = 0.8, 7
    if (v := draw(maybe(0, 1, clean))) is not None:
        p.sampling.typical_p = v                  # read under SAMPLE only: GREEDY ignores sampling
        if method == tgis_pb.SAMPLE and not typical_ok(p.sampling.typical_p):
            bad.append("params.sampling.typical_p")
    if (v := draw(maybe(0, 10, clean))) is not None:
        p.decoding.repetition_penalty = v
        if not repetition_ok(p.decoding.repetition_penalty):
            bad.append("params.decoding.repetition_penalty")
    if (v := draw(maybe(1, 10, clean))) is not None:
        p.decoding.length_penalty.start_index = draw(UINT32)
        p.decoding.length_penalty.decay_factor = v
        if not decay_ok(p.decoding.length_penalty.decay_factor):
            bad.append("params.decoding.length_penalty.decay_factor")
    r = p.response
    r.generated_tokens, r.input_tokens, r.token_logprobs, r.token_ranks = (draw(st.booleans()) for _ in range(4))
    r.top_n_tokens = draw(tops(clean))
    if r.top_n_tokens > 10:
        bad.append("params.response.top_n_tokens")
    p.truncate_input_tokens = draw(truncations(ctx, clean))
    if p.truncate_input_tokens >= ctx:
        bad.append("params.truncate_input_tokens")
    path = draw(st.sampled_from(list(METHODS)[2:4]))
    text = tgis_pb.GenerationRequest(text=prompt)
    req = (tgis_pb.BatchedGenerationRequest(requests=[text], params=p) if path.endswith("/Generate")
           else tgis_pb.SingleGenerationRequest(request=text, params=p))
    md = (("x-tandem-draft-method", draw(st.sampled_from(["model", "ngram", "none"]))),)
    n = kept(lengths[prompt], p.truncate_input_tokens)
    return path, req, md, bad, lambda msgs: check_tgis_reply(msgs, n, r)


def shown(path: str, payload: bytes) -> str | bytes:
    """A failing request, as text when it is a message, else its first bytes."""
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError
    try:
        return text_format.MessageToString(METHODS[path][0].FromString(payload), as_one_line=True)[:600]
    except (KeyError, DecodeError):
        return payload[:200]


REPLIES = {"/tandem.v1.GenerationService/Generate": pb.GenerateResponse,
           "/tandem.v1.GenerationService/GenerateStream": pb.GenerateStreamResponse,
           "/fmaas.GenerationService/Generate": tgis_pb.BatchedGenerationResponse,
           "/fmaas.GenerationService/GenerateStream": tgis_pb.GenerationResponse}


async def _fuzz_stack(tiny_pair):
    limits = Limits(max_new_tokens=GOOD_TOKENS, default_max_new_tokens=4, max_prompt_chars=4000, max_prompt_tokens=512)
    s = await start_stack(*tiny_pair, limits=limits, guard=ClientGuard(TokenSet([])), max_message_bytes=256 * 1024)
    yield s
    await stop_stack(s)


# The fuzz has a stack of its own: should a request fail a worker there, the tests after it still
# find a working one (and say what they test, not what the fuzz broke).
fuzz_stack = pytest_asyncio.fixture(_fuzz_stack, scope="function", loop_scope="session", name="fuzz_stack")
module_stack = pytest_asyncio.fixture(_fuzz_stack, scope="module", loop_scope="session", name="module_stack")


@pytest.fixture(scope="module")
def expected_good(tiny_pair, tiny_models) -> str:
    """The target's greedy output for the well-formed stream."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    return tok.decode(reference(tiny_models[0], tok(GOOD_PROMPT).input_ids,
                                SamplingParams(max_new_tokens=GOOD_TOKENS)), skip_special_tokens=True)


def good_request() -> pb.GenerateRequest:
    return build_request(GOOD_PROMPT, max_new_tokens=GOOD_TOKENS, method="model", k=3)


def hostile_requests(address: str, failures: list, ctx: int, lengths: dict, probes: Counter) -> int:
    """Runs on a thread with a blocking channel, while the event loop serves; returns requests sent.
    probes counts the probes' outcomes: served, refused."""
    sent = 0
    with grpc.insecure_channel(address) as ch:
        def call(path: str, payload: bytes, metadata=(), bad=None, check=None) -> None:
            """bad: None = any proper status; else the request must be refused naming one of these
            fields, or (none named) served, its reply passing check."""
            nonlocal sent
            sent += 1
            streaming = METHODS.get(path, (None, False))[1]
            rpc = (ch.unary_stream if streaming else ch.unary_unary)(path)
            try:
                result = rpc(payload, timeout=60, metadata=metadata or None)
                replies = list(result) if streaming else [result]
            except grpc.RpcError as e:
                if e.code() not in PROPER:
                    failures.append((path, shown(path, payload), e.code(), e.details()))
                elif bad is not None and (e.code() != grpc.StatusCode.INVALID_ARGUMENT
                                          or not any(b in e.details() for b in bad)):
                    failures.append((path, shown(path, payload), bad, e.code(), e.details()))
                probes["refused"] += bad is not None
                return
            probes["served"] += bad is not None
            if bad:
                failures.append((path, shown(path, payload), bad, "served"))
            elif check is not None and (why := check([REPLIES[path].FromString(r) for r in replies])) is not None:
                failures.append((path, shown(path, payload), why))

        def fuzz(cases: st.SearchStrategy) -> None:      # cases: (method path, request bytes)
            settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))(
                given(cases)(lambda case: call(*case)))()

        encoded = lambda s: s.map(lambda m: m.SerializeToString())   # noqa: E731
        for path, (cls, _) in METHODS.items():
            fuzz(st.tuples(st.just(path), encoded(message(cls.DESCRIPTOR, cls))))
        fuzz(st.tuples(st.sampled_from(list(METHODS)[:2]), encoded(well_formed())))
        # Bytes that are no message, and a method that does not exist.
        fuzz(st.tuples(st.sampled_from([*METHODS, "/tandem.v1.GenerationService/Nope"]), st.binary(max_size=512)))
        # Valid requests but for the processing and reporting fields, which must be judged exactly.
        for probe in (native_probe, tgis_probe):
            fuzz(probe(ctx, lengths).map(lambda c: (c[0], c[1].SerializeToString(), *c[2:])))
    return sent


@pytest.mark.service
async def test_hostile_requests_get_proper_statuses_while_a_good_stream_stays_right(fuzz_stack, expected_good):
    stub = pb_grpc.GenerationServiceStub(fuzz_stack.channel)
    done, good, wrong = asyncio.Event(), 0, []

    async def well_formed_streams():
        nonlocal good
        while not done.is_set():
            try:
                msgs = [m async for m in stub.GenerateStream(good_request(), timeout=60)]
            except grpc.aio.AioRpcError as e:
                wrong.append((e.code(), e.details()))
                await asyncio.sleep(0.5)
                continue
            text = "".join(m.text for m in msgs)
            good += 1
            if text != expected_good:
                wrong.append(text)

    runner = asyncio.ensure_future(well_formed_streams())
    failures: list = []
    lengths = {p: len(fuzz_stack.core.encode_prompt(p)) for p in PROBE_PROMPTS}
    probes: Counter = Counter()
    try:
        sent = await asyncio.to_thread(hostile_requests, fuzz_stack.gateway_address, failures,
                                       fuzz_stack.core.max_context, lengths, probes)
    finally:
        done.set()
    await runner
    print(f"\nfuzz: {sent} hostile requests ({probes['served']} probes served, {probes['refused']} refused), "
          f"{good} well-formed streams alongside")
    assert not failures, "\n".join(map(repr, failures[:5]))
    assert not wrong, wrong[:3]
    assert sent >= 10 * EXAMPLES and good >= 3
    assert min(probes["served"], probes["refused"]) >= EXAMPLES // 10, probes      # both sides reached
    assert await wait_until_idle(fuzz_stack) == (0, 0), await live_sessions(fuzz_stack)


# ---- the generic strategy reaches every new field, with hostile values ----

CTX_TINY = 512     # the tiny models' context window (tandem.testing's default)
NEW_FIELDS = {   # request type -> new scalar field (path) -> its valid range: (lo, hi) for floats,
                 # the highest valid integer (None: no limit), or bool
    pb.GenerateRequest: {
        "sampling.repetition_penalty": (0, 10), "sampling.presence_penalty": (-2, 2),
        "sampling.frequency_penalty": (-2, 2), "sampling.typical_p": (0, 1),
        "sampling.length_penalty.start_index": None, "sampling.length_penalty.decay_factor": (1, 10),
        "truncate_input_tokens": CTX_TINY - 1, "logprobs.logprobs": bool, "logprobs.top_logprobs": 10,
        "logprobs.prompt_logprobs": bool},
    tgis_pb.SingleGenerationRequest: {
        "params.truncate_input_tokens": CTX_TINY - 1, "params.decoding.repetition_penalty": (0, 10),
        "params.decoding.length_penalty.start_index": None, "params.decoding.length_penalty.decay_factor": (1, 10),
        "params.sampling.typical_p": (0, 1), "params.response.top_n_tokens": 10,
        **{f"params.response.{f}": bool for f in ("generated_tokens", "input_tokens", "token_logprobs",
                                                   "token_ranks")}},
}
NEW_FIELDS[tgis_pb.BatchedGenerationRequest] = NEW_FIELDS[tgis_pb.SingleGenerationRequest]


def set_fields(m, prefix: str = ""):
    """(path, value) of every scalar set in m, through singular sub-messages."""
    for f, v in m.ListFields():
        if f.type == F.TYPE_MESSAGE and not f.is_repeated:
            yield from set_fields(v, f"{prefix}{f.name}.")
        elif not f.is_repeated:
            yield prefix + f.name, v


def kinds(v, valid) -> set[str]:
    if isinstance(valid, tuple):
        lo, hi = valid
        return {"set"} | {k for k, yes in (("nonfinite", not math.isfinite(v)), ("out", not lo <= v <= hi)) if yes}
    return {"set", "out"} if isinstance(valid, int) and v > valid else {"set"}


@pytest.mark.unit
@pytest.mark.parametrize("cls", list(NEW_FIELDS), ids=lambda c: c.DESCRIPTOR.full_name)
def test_generic_strategy_reaches_every_new_field_with_hostile_values(cls, monkeypatch):
    """In as many examples as the fuzz draws, the descriptor-driven strategy above sets each new
    field (nested ones included): floats non-finite and out of their range, integers past their
    limits. Derandomized, and without the constants hypothesis collects from the project's modules
    imported so far (they would make the sequence depend on which tests ran before): a fixed
    sequence, never a flake."""
    from hypothesis.internal.conjecture import providers
    fixed = providers.Constants()
    monkeypatch.setattr(providers, "_get_local_constants", lambda: fixed)
    providers.CONSTANTS_CACHE.cache.clear()
    fields = NEW_FIELDS[cls]
    seen: dict[str, set] = {path: set() for path in fields}

    @settings(max_examples=max(EXAMPLES, 300), derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(message(cls.DESCRIPTOR, cls))
    def draw(m):
        for path, v in set_fields(m):
            if path in fields:
                seen[path] |= kinds(v, fields[path])
    draw()
    for path, valid in fields.items():
        want = ({"set", "nonfinite", "out"} if isinstance(valid, tuple) else {"set", "out"} if isinstance(valid, int)
                else {"set"})
        assert want <= seen[path], (path, seen[path])


# ---- each new field, hostile, on both faces, next to a good stream ----

NAN, INF = float("nan"), float("inf")
CTX, CTX1 = "ctx", "ctx+1"        # the model's context window (and one more), known once the stack runs
PENALTY = [NAN, INF, -INF, -1.0, -1e-3, 10.5, 1e30]
SIGNED = [NAN, INF, -INF, -2.5, 2.5, -1e30, 1e30]
TYPICAL = [1.5, NAN, INF, -0.5, -INF]
DECAY = [0.5, NAN, INF, 0.0, -1.0, 10.5]
TOP = [11, 1000, 2**32 - 1]
TRUNCATE = [CTX, CTX1, 2**32 - 1]
HOSTILE = [("tandem", f, v) for f, vs in (
    ("repetition_penalty", PENALTY), ("presence_penalty", SIGNED), ("frequency_penalty", SIGNED),
    ("typical_p", TYPICAL), ("length_penalty.decay_factor", DECAY), ("logprobs.top_logprobs", TOP),
    ("truncate_input_tokens", TRUNCATE)) for v in vs] + [("tgis", f, v) for f, vs in (
    ("params.decoding.repetition_penalty", PENALTY), ("params.sampling.typical_p", TYPICAL),
    ("params.decoding.length_penalty.decay_factor", DECAY), ("params.response.top_n_tokens", TOP),
    ("params.truncate_input_tokens", TRUNCATE)) for v in vs]


def set_path(m, path: str, value) -> None:
    *parents, name = path.split(".")
    for p in parents:
        m = getattr(m, p)
    setattr(m, name, value)


def tgis_params(method=tgis_pb.GREEDY, max_new_tokens: int = 4) -> tgis_pb.Parameters:
    p = tgis_pb.Parameters(method=method, stopping=tgis_pb.StoppingCriteria(max_new_tokens=max_new_tokens),
                           response=tgis_pb.ResponseOptions(generated_tokens=True, token_logprobs=True))
    if method == tgis_pb.SAMPLE:
        p.sampling.temperature, p.sampling.seed = 0.8, 7
    return p


def both_calls(stack, native: pb.GenerateRequest | None = None, tgis: tgis_pb.Parameters | None = None) -> list:
    """Generate and GenerateStream of one request: native, or TGIS parameters on GOOD_PROMPT with
    speculation asked for in the metadata."""
    if native is not None:
        return [lambda: stack.tandem.Generate(native, timeout=60), lambda: stack.tandem.GenerateStream(native, timeout=60)]
    text = tgis_pb.GenerationRequest(text=GOOD_PROMPT)
    return [lambda: stack.tgis.Generate(tgis_pb.BatchedGenerationRequest(requests=[text], params=tgis),
                                        metadata=SPEC_MD, timeout=60),
            lambda: stack.tgis.GenerateStream(tgis_pb.SingleGenerationRequest(request=text, params=tgis),
                                              metadata=SPEC_MD, timeout=60)]


SPEC_MD = (("x-tandem-draft-method", "model"), ("x-tandem-num-speculative-tokens", "3"))


async def collect(call) -> list:
    """The messages of a streaming call, or the one reply of a unary one."""
    return [m async for m in call] if hasattr(call, "__aiter__") else [await call]


async def beside_a_good_stream(stack, hostile):
    """Awaits hostile() while a well-formed greedy stream is under way: (its result, the stream's
    text, or its status when it failed)."""
    stream = aiter(stack.tandem.GenerateStream(good_request(), timeout=60))
    try:
        first = (await anext(stream)).text        # the good stream is in flight from here
    except grpc.aio.AioRpcError as e:
        return await hostile(), (e.code(), e.details())
    result = await hostile()
    try:
        return result, first + "".join([m.text async for m in stream])
    except grpc.aio.AioRpcError as e:
        return result, (e.code(), e.details())


async def statuses(calls) -> list[tuple[grpc.StatusCode, str]]:
    out = []
    for c in calls:
        try:
            await collect(c())
            out.append((grpc.StatusCode.OK, ""))
        except grpc.aio.AioRpcError as e:
            out.append((e.code(), e.details()))
    return out


@pytest.mark.service
@pytest.mark.parametrize("face,field,value", HOSTILE, ids=lambda x: str(x))
async def test_each_new_field_hostile_is_invalid_argument_beside_a_good_stream(module_stack, expected_good,
                                                                                face, field, value):
    ctx = module_stack.core.max_context
    value = {CTX: ctx, CTX1: ctx + 1}.get(value, value) if isinstance(value, str) else value
    if face == "tandem":
        req = build_request(GOOD_PROMPT, max_new_tokens=4, method="model", k=3)
        if field.startswith("length_penalty"):
            req.sampling.length_penalty.start_index = 2
        on_request = field in ("truncate_input_tokens", "logprobs.top_logprobs")
        set_path(req, field if on_request else "sampling." + field, value)
        calls = both_calls(module_stack, native=req)
    else:
        p = tgis_params(tgis_pb.SAMPLE if "sampling" in field else tgis_pb.GREEDY)
        if "length_penalty" in field:
            p.decoding.length_penalty.start_index = 2
        set_path(p, field.removeprefix("params."), value)
        calls = both_calls(module_stack, tgis=p)
    got, good = await beside_a_good_stream(module_stack, lambda: statuses(calls))
    for code, details in got:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert field in details, details
    assert good == expected_good


# ---- truncation past the prompt, and every new field valid at once, with speculation ----

LONG_PROMPT = PROBE_PROMPTS[1]


@pytest.mark.service
@pytest.mark.parametrize("face", ["tandem", "tgis"])
async def test_truncation_past_the_prompt_keeps_it_whole(module_stack, face):
    """Above the prompt's length but below the context window, truncate_input_tokens is served
    (TGIS keeps the prompt whole) and the counts are the untruncated prompt's."""
    ctx, n = module_stack.core.max_context, len(module_stack.core.encode_prompt(LONG_PROMPT))
    texts = []
    for keep in (0, n, n + 1, n + 10, ctx - 1):
        if face == "tandem":
            req = build_request(LONG_PROMPT, max_new_tokens=6, method="model", k=3)
            req.truncate_input_tokens = keep
            req.logprobs.prompt_logprobs = True
            for msgs in (await collect(module_stack.tandem.Generate(req, timeout=60)),
                         await collect(module_stack.tandem.GenerateStream(req, timeout=60))):
                assert msgs[-1].usage.prompt_tokens == n, (keep, msgs[-1].usage)
                assert sum(len(m.prompt_tokens) for m in msgs) == n
                texts.append("".join(m.text for m in msgs))
        else:
            p = tgis_params(max_new_tokens=6)
            p.truncate_input_tokens, p.response.input_tokens = keep, True
            text = tgis_pb.GenerationRequest(text=LONG_PROMPT)
            [one] = (await module_stack.tgis.Generate(tgis_pb.BatchedGenerationRequest(requests=[text], params=p),
                                                      metadata=SPEC_MD, timeout=60)).responses
            msgs = await collect(module_stack.tgis.GenerateStream(
                tgis_pb.SingleGenerationRequest(request=text, params=p), metadata=SPEC_MD, timeout=60))
            for first in (one, msgs[0]):
                assert first.input_token_count == n and len(first.input_tokens) == n, (keep, first)
            texts += [one.text, "".join(m.text for m in msgs)]
    assert len(set(texts)) == 1, texts            # the same greedy output as without truncation


def every_new_field_tandem(temperature: float, keep: int, method: str) -> pb.GenerateRequest:
    req = build_request(LONG_PROMPT, max_new_tokens=GOOD_TOKENS, temperature=temperature, seed=11, method=method, k=3)
    s = req.sampling
    s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.typical_p = 1.3, 0.4, -0.3, 0.9
    s.length_penalty.start_index, s.length_penalty.decay_factor = 8, 1.5
    req.truncate_input_tokens = keep
    req.logprobs.logprobs, req.logprobs.top_logprobs, req.logprobs.prompt_logprobs = True, 10, True
    return req


def every_new_field_tgis(method, keep: int) -> tgis_pb.Parameters:
    p = tgis_params(method, max_new_tokens=GOOD_TOKENS)
    if method == tgis_pb.SAMPLE:
        p.sampling.typical_p, p.sampling.top_k = 0.9, 50
    p.decoding.repetition_penalty = 1.3
    p.decoding.length_penalty.start_index, p.decoding.length_penalty.decay_factor = 8, 1.5
    p.response.input_tokens, p.response.token_ranks, p.response.top_n_tokens = True, True, 10
    p.truncate_input_tokens = keep
    return p


@pytest.mark.service
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("face", ["tandem", "tgis"])
async def test_every_new_field_valid_at_once_is_served_with_speculation(module_stack, face, sample):
    keep = 10
    assert len(module_stack.core.encode_prompt(LONG_PROMPT)) > keep
    if face == "tandem":
        req = every_new_field_tandem(0.8 if sample else 0.0, keep, "model")
        results = [await collect(module_stack.tandem.Generate(req, timeout=60)),
                   await collect(module_stack.tandem.GenerateStream(req, timeout=60))]
        for msgs in results:
            u = msgs[-1].usage
            assert u.draft_method == "model" and u.draft_tokens > 0 and u.generated_tokens > 0, u
            why = check_native_reply(msgs, keep, True, 10, True)
            assert why is None, why
            prompt = [t for m in msgs for t in m.prompt_tokens]
            assert not prompt[0].HasField("logprob") and all(len(t.top_logprobs) == 10 for t in prompt[1:])
            for t in [t for m in msgs for t in m.tokens]:
                lps = [x.logprob for x in t.top_logprobs]
                assert lps == sorted(lps, reverse=True) and t.logprob <= lps[0]
        texts = ["".join(m.text for m in msgs) for msgs in results]
        if not sample:        # lossless: speculation changes nothing under greedy, penalties and all
            plain = await module_stack.tandem.Generate(every_new_field_tandem(0.0, keep, "none"), timeout=60)
            texts.append(plain.text)
    else:
        p = every_new_field_tgis(tgis_pb.SAMPLE if sample else tgis_pb.GREEDY, keep)
        text = tgis_pb.GenerationRequest(text=LONG_PROMPT)
        batch = tgis_pb.BatchedGenerationRequest(requests=[text], params=p)
        single = tgis_pb.SingleGenerationRequest(request=text, params=p)
        results = [await collect(module_stack.tgis.Generate(batch, metadata=SPEC_MD, timeout=60)),
                   await collect(module_stack.tgis.GenerateStream(single, metadata=SPEC_MD, timeout=60))]
        for msgs in results:
            why = check_tgis_reply(msgs, keep, p.response)
            assert why is None, why
        one, stream = results[0][0].responses[0], results[1]
        assert one.generated_token_count > 0
        assert math.isnan(one.input_tokens[0].logprob) and all(len(t.top_tokens) == 10 for t in one.input_tokens[1:])
        texts = [one.text, "".join(m.text for m in stream)]
        if not sample:
            plain = await module_stack.tgis.Generate(batch, metadata=(("x-tandem-draft-method", "none"),), timeout=60)
            texts.append(plain.responses[0].text)
    assert len(set(texts)) == 1, texts            # seeded or greedy: Generate and the stream agree
    assert await wait_until_idle(module_stack) == (0, 0), await live_sessions(module_stack)


# ---- values inside every range that push the arithmetic to its edge ----

EXTREME = [("tandem", "repetition_penalty", 1.4e-45), ("tandem", "repetition_penalty", 1e-38),
           ("tandem", "typical_p", 1.4e-45), ("tandem", "temperature", 1e-40),
           ("tgis", "params.decoding.repetition_penalty", 1e-38), ("tgis", "params.sampling.typical_p", 1.4e-45),
           ("tgis", "params.sampling.temperature", 1e-40)]


@pytest_asyncio.fixture(loop_scope="session")
async def own_stack(tiny_pair):
    """A stack of its own: a request that fails a worker leaves the module's stack alone."""
    s = await start_stack(*tiny_pair, limits=Limits(max_new_tokens=GOOD_TOKENS))
    yield s
    await stop_stack(s)


@pytest.mark.service
@pytest.mark.parametrize("face,field,value", EXTREME, ids=lambda x: str(x))
async def test_extreme_valid_values_are_served_or_refused_never_fail_a_worker(own_stack, expected_good,
                                                                              face, field, value):
    """Sampling with a tiny positive repetition penalty, typical-p or temperature: in range, but
    dividing by it overflows the logits. It must be served or refused naming the field; the
    worker must stay up, and a well-formed stream beside it stay right."""
    if face == "tandem":
        req = build_request(GOOD_PROMPT, max_new_tokens=4, temperature=0.8, seed=7, method="model", k=3)
        setattr(req.sampling, field, value)
        calls = both_calls(own_stack, native=req)
    else:
        p = tgis_params(tgis_pb.SAMPLE)
        set_path(p, field.removeprefix("params."), value)
        calls = both_calls(own_stack, tgis=p)
    got, good = await beside_a_good_stream(own_stack, lambda: statuses(calls))
    for code, details in got:
        named = field.rsplit(".", 1)[-1] in details       # TGIS names temperature without its path
        assert code == grpc.StatusCode.OK or (code == grpc.StatusCode.INVALID_ARGUMENT and named), (code, details)
    assert good == expected_good
    after = await collect(own_stack.tandem.GenerateStream(good_request(), timeout=60))   # the workers are still up
    assert "".join(m.text for m in after) == expected_good


# ---- structured output: hostile guides on both faces, next to well-formed guided streams ----
#
# Each guide kind drawn both well-formed and hostile, on requests that are otherwise valid (so the
# guide is what is judged), with at most 8 new tokens. A request ends OK, INVALID_ARGUMENT, or
# RESOURCE_EXHAUSTED (over the message size), never anything else; when it ends OK and its guide's
# language is known here, the output belongs to it (or, cut by max_new_tokens, begins a choice).

GUIDED_PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
GUIDED_EXAMPLES = max(10, EXAMPLES * 2 // 3)    # per strategy, of three: each example compiles a guide
# A regex made of these means the same to Python's re and to xgrammar: literals, escaped
# metacharacters, ASCII classes, groups, alternation and the usual quantifiers (no ., \d, \w, \s,
# anchors or lazy quantifiers, whose dialects differ); a quantifier only ever follows a group.
RX_ATOMS = ["a", "b", "c", "x", "0", "1", "9", "-", "_", " ", "é", "\\.", "\\+", "\\(", "\\?", "\\*",
            "[abc]", "[a-c]", "[0-9]", "[a-z0-9]", "[xyz_]"]
QUANTS = ["?", "*", "+", "{2}", "{0,2}", "{1,3}", "{2,}"]
RX_RAW = ["(", ")", "[", "]", "{", "}", "|", "*", "+", "?", "\\", "^", "$", ".", "a", "-", ",", "1", "3", "\\d",
          "\\w", "\\s", "\\b", "\\1", "(?:", "(?=", "(?!", "(?P<x>", "(?<x>", "[^", "\\p{L}", "\\u00e9", "\\x41",
          "{2,}", "{,3}", "{99999}", "{3,1}", "\x00", "é", "\U0001f600", "*?", "++", "[z-a]", "[]"]
BAD_REGEXES = ["(", ")", "(a|b", "a{3,1}", "[z-a]", "\\", "*a", "a**", "[", "a{", "(?<name", "\\p{Foo}", "|", "()",
               "a{99999}{99999}", "(" * 300 + ")" * 300, "(" * 3000 + ")" * 3000, "[" * 50, "\\1(a)", "a{,}"]
EB_LITS = ["a", "b", "yes", "no", "x y", "0", "é", "-", "日", "ab"]
EB_CLASSES = ["[a-c]", "[0-9]", "[xyz]"]
EB_RAW = ["root", "::=", '"a"', '"', "|", "(", ")", "*", "+", "?", "[a-z]", "[^", "r1", "r9", "\n", " ", "{2}",
          "{3,1}", "\\", "#", "=", "::", "(=", '""', "root ::= ", "[z-a]", "\\u00e9", "\x00"]
BAD_GRAMMARS = ['x ::= "a"', "root ::= root", "root ::= r9", 'root ::= "a', "root ::= [z-a]", 'root ::= ("a"',
                "root ::=", 'root ::= ""', 'root ::= (= "a") "a"', 'root ::= "a"{3,1}',
                'root ::= "a"\nroot ::= "b"', "root ::= [^]", "root ::= (", "::=", 'root ::= r1\nr1 ::= root',
                'root ::= "a" | root "b"', 'root ::= "a" (root)?', "root ::= " + "(" * 3000 + '"a"' + ")" * 3000,
                'root ::= ("a"{0,1000}){0,1000}', "root ::= [\\u0000-\\U0010ffff]*", 'root ::= "\\"', "\x00"]
# The end-of-sequence token's text ends no choice here: see test_a_guide_ending_in_the_eos_text_is_kept.
CHOICE_TEXT = st.one_of(st.sampled_from(["", "a", "ab", "yes", "no", " ", "\n", '"', "\\", "é", "日本", "\U0001f600",
                                         "\x00", "<|endoftext|>", "def", "x" * 300, "\\u0041", "'", "::=", "(a|b)"]),
                        st.text(max_size=20))
# Long choices: over the guide limit (65536 characters) or under it. Two long ones sharing a long
# prefix take xgrammar seconds to compile (quadratic in the prefix: 10,000 characters, about 4 s),
# so a list holds at most one, beside a pair sharing a 2,000-character prefix.
LONG_CHOICES = st.one_of(st.integers(1000, 70000).map(lambda n: ["y" * n]),
                         st.just(["z" * 2000 + "a", "z" * 2000 + "b"]))
NONFINITE_JSON = [float("nan"), float("inf"), -1e308, 1e308, 2**63, -2**63 - 1, 0.5, -0.0]


def safe_regexes() -> st.SearchStrategy:
    def extend(inner):
        return st.one_of(st.lists(inner, min_size=2, max_size=4).map("".join),
                         st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
                         st.tuples(inner, st.sampled_from(QUANTS)).map(lambda t: f"({t[0]}){t[1]}"))
    return st.recursive(st.sampled_from(RX_ATOMS), extend, max_leaves=8)


def hostile_regexes() -> st.SearchStrategy:
    return st.one_of(st.sampled_from(BAD_REGEXES),
                     st.lists(st.sampled_from(RX_RAW), min_size=1, max_size=12).map("".join),
                     st.tuples(safe_regexes(), st.sampled_from(RX_RAW), safe_regexes()).map("".join),
                     st.text(max_size=40))


@st.composite
def regex_guides(draw):
    """(text, the same regex for Python when its language is known here, else None)."""
    if draw(st.booleans()):
        rx = draw(safe_regexes())
        return rx, rx
    return draw(hostile_regexes()), None


def _ebnf_leaves(refs: dict) -> st.SearchStrategy:
    """(EBNF, Python regex) pairs: string literals, classes, and references to the rules in refs."""
    leaves = [st.sampled_from(EB_LITS).map(lambda s: (json.dumps(s, ensure_ascii=False), re.escape(s))),
              st.sampled_from(EB_CLASSES).map(lambda c: (c, c))]
    if refs:
        leaves.append(st.sampled_from(sorted(refs.items())))
    return st.one_of(leaves)


def _ebnf_expr(refs: dict) -> st.SearchStrategy:
    def extend(inner):
        return st.one_of(
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: (" ".join(e for e, _ in xs),
                                                                    "".join(p for _, p in xs))),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: ("(" + " | ".join(e for e, _ in xs) + ")",
                                                                    "(?:" + "|".join(p for _, p in xs) + ")")),
            st.tuples(inner, st.sampled_from(["*", "+", "?", "{2}", "{1,3}"])).map(
                lambda t: (f"({t[0][0]}){t[1]}", f"(?:{t[0][1]}){t[1]}")))
    return st.recursive(_ebnf_leaves(refs), extend, max_leaves=6)


@st.composite
def grammar_guides(draw):
    """(EBNF text, a Python regex of its language when known here, else None). Well-formed ones
    have up to two helper rules, each used only by the rules above it (no recursion)."""
    if draw(st.booleans()):
        refs, rules = {}, []
        for name in draw(st.sampled_from([[], ["r2"], ["r2", "r1"]])):
            body, py = draw(_ebnf_expr(dict(refs)))
            rules.append(f"{name} ::= {body}")
            refs[name] = f"(?:{py})"
        body, py = draw(_ebnf_expr(refs))
        lines = [f"root ::= {body}", *reversed(rules)]
        return "\n".join(lines), py
    good, _ = draw(grammar_guides().filter(lambda g: g[1] is not None))
    return draw(st.one_of(
        st.sampled_from(BAD_GRAMMARS),
        st.one_of(st.lists(st.sampled_from(EB_RAW), min_size=1, max_size=14).map(" ".join), st.text(max_size=60),
                  st.tuples(st.integers(0, len(good)), st.sampled_from(EB_RAW)).map(
                      lambda t: good[:t[0]] + t[1] + good[t[0]:]),
                  st.integers(0, len(good)).map(lambda i: good[:i] + good[i + 1:])).filter(not_recursive))), None


RULE = re.compile(r"(?m)^\s*([A-Za-z_][\w-]*)\s*::=")


def not_recursive(text: str) -> bool:
    """No rule of this EBNF text can reach itself (its names matched anywhere in the bodies, string
    literals included: erring towards recursive). A recursive guide can force endless text, which
    the draft worker's jump-forward follows without bound (see ENDLESS below), so the fuzz leaves
    recursion to the curated lists until that is bounded."""
    heads = list(RULE.finditer(text))
    names = {m.group(1) for m in heads}
    uses = {}
    for m, nxt in zip(heads, heads[1:] + [None]):
        body = text[m.end():nxt.start() if nxt else len(text)]
        uses.setdefault(m.group(1), set()).update(set(re.findall(r"[A-Za-z_][\w-]*", body)) & names)
    seen, stack = set(), []

    def cyclic(name) -> bool:
        if name in stack:
            return True
        if name in seen:
            return False
        seen.add(name)
        stack.append(name)
        found = any(cyclic(u) for u in uses.get(name, ()))
        stack.pop()
        return found
    return not any(cyclic(n) for n in names)


# JSON Schemas: the clean ones use keywords whose meaning jsonschema and xgrammar share.
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=6),
                         st.floats(allow_nan=False, allow_infinity=False, width=32))
PROPERTY_NAMES = st.one_of(st.sampled_from(["a", "b", "name", "x y", "é", "", '"', "\\", "$ref"]), st.text(max_size=6))
HOSTILE_NAMES = PROPERTY_NAMES.filter(lambda k: k != "$ref")     # a "$ref" could close a cycle: see ENDLESS


def _clean_leaf() -> st.SearchStrategy:
    bounds = st.integers(-50, 50)
    def numeric(t, lo, hi):
        s = {"type": t}
        if lo is not None:
            s["minimum"] = lo
        if hi is not None:
            s["maximum"] = max(hi, lo) if lo is not None else hi
        return s
    def string(lo, hi, pattern):
        s = {"type": "string"}
        if lo is not None:
            s["minLength"] = lo
        if hi is not None:
            s["maxLength"] = max(hi, lo or 0)
        if pattern is not None:          # xgrammar ignores lengths next to a pattern (with a warning)
            s = {"type": "string", "pattern": f"^{pattern}$"}
        return s
    return st.one_of(
        st.builds(numeric, st.sampled_from(["integer"]), st.none() | bounds, st.none() | bounds),
        st.builds(string, st.none() | st.integers(0, 4), st.none() | st.integers(0, 6), st.none() | safe_regexes()),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": "number"}, {}, True]),
        st.lists(JSON_SCALARS.filter(lambda v: not isinstance(v, float)), min_size=1, max_size=4, unique_by=json.dumps)
        .map(lambda vs: {"enum": vs}),
        JSON_SCALARS.filter(lambda v: not isinstance(v, float)).map(lambda v: {"const": v}))


def _clean_extend(inner) -> st.SearchStrategy:
    def obj(props, required, extra):
        return {"type": "object", "properties": props, "required": sorted(set(required) & set(props)),
                "additionalProperties": extra}
    return st.one_of(
        st.builds(obj, st.dictionaries(PROPERTY_NAMES, inner, max_size=3), st.lists(PROPERTY_NAMES, max_size=3),
                  st.just(False)),
        st.builds(lambda items, lo, hi: {"type": "array", "items": items, "minItems": lo, "maxItems": max(lo, hi)},
                  inner, st.integers(0, 2), st.integers(0, 3)),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}))


def clean_schemas() -> st.SearchStrategy:
    return st.recursive(_clean_leaf(), _clean_extend, max_leaves=6)


def _hostile_schema_values() -> st.SearchStrategy:
    """A schema object that may be anything: wrong types for keywords, unknown keywords, refs to
    nowhere, bounds that cannot hold, numbers past what any parser keeps."""
    anything = st.recursive(JSON_SCALARS | st.sampled_from(NONFINITE_JSON),
                            lambda v: st.lists(v, max_size=3) | st.dictionaries(HOSTILE_NAMES, v, max_size=3),
                            max_leaves=5)
    keywords = st.sampled_from(["type", "properties", "required", "items", "prefixItems", "enum", "const", "minimum",
                                "maximum", "exclusiveMinimum", "multipleOf", "minLength", "maxLength", "pattern",
                                "format", "minItems", "maxItems", "additionalProperties", "anyOf", "oneOf", "allOf",
                                "not", "if", "then", "else", "$defs", "definitions", "$id", "$schema",
                                "minProperties", "patternProperties", "unevaluatedProperties", "x-unknown",
                                "dependentRequired", "contains", "uniqueItems", "propertyNames"])
    values = st.one_of(anything, clean_schemas(), hostile_regexes(), st.sampled_from(
        ["string", "integer", "number", "object", "array", "boolean", "null", "strange", ["string", "null"], [],
         "#", "#/nowhere", "#/$defs/a", "#/definitions/nope", "http://example.com/x.json", "date", "email", "uuid",
         -1, 0, 2**64, 1e308, float("nan"), float("inf")]))
    def extend(inner):
        return st.dictionaries(keywords, st.one_of(values, inner, st.lists(inner, max_size=2),
                                                   st.dictionaries(HOSTILE_NAMES, inner, max_size=2)), max_size=4)
    return st.recursive(st.dictionaries(keywords, values, max_size=4), extend, max_leaves=8)


def _nested(depth: int, shape: str) -> str:
    """Text nested `depth` deep: a schema of schemas, arrays, or an unknown keyword's objects."""
    head, tail = {"items": ('{"type": "array", "items": ', "}"), "array": ("[", "]"), "unknown": ('{"x": ', "}"),
                  "not": ('{"not": ', "}")}[shape]
    return head * depth + "{}" + tail * depth


# Depths up to here compile in well under a second; deeper schemas (about 600 levels and up)
# take xgrammar tens of seconds each, so only shapes it never compiles (arrays) go deeper, as deep
# as the gateway's JSON parser goes: past Python's recursion limit it fails with UNKNOWN (see
# test_json_nested_past_the_parser_limit_is_invalid_argument); raise this to 5000 once it does not.
CHEAP_DEPTH = 150
PARSER_DEPTH = 5000


@st.composite
def schema_guides(draw):
    """(JSON Schema text, the schema when it is a clean one whose outputs jsonschema can check, else None)."""
    which = draw(st.integers(0, 5))
    if which <= 1:
        schema = draw(clean_schemas())
        return json.dumps(schema, ensure_ascii=draw(st.booleans())), schema
    if which == 2:
        return json.dumps(draw(_hostile_schema_values())), None
    if which == 3:            # $ref: to itself, to nowhere, to a definition that is there or not (no cycle
        # that a value must go round: see ENDLESS)
        target = draw(st.sampled_from(["#/$defs/a", "#/$defs/b", "#/definitions/a", "#/nowhere", "other.json",
                                       "#/$defs/a/items", "", "#", "#/properties/a"]))
        schema = {"$ref": target, "$defs": {"a": draw(clean_schemas())}}
        if target not in ("#", "#/properties/a") and draw(st.booleans()):
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        return json.dumps(schema), None
    if which == 4:            # deep nesting
        shape = draw(st.sampled_from(["items", "unknown", "not", "array"]))
        depth = draw(st.integers(1, PARSER_DEPTH if shape == "array" else CHEAP_DEPTH))
        return _nested(depth, shape), None
    return draw(st.one_of(   # no schema at all: not JSON, or JSON of the wrong type
        st.text(max_size=40), st.sampled_from(["{", "nul", "NaN", "[1, 2]", '"string"', "123", "null", "true", "false",
                                               "{}", "{} {}", '{"type": "string"', "\ufeff{}", " ", "{'a': 1}"]),
        JSON_SCALARS.map(json.dumps))), None


@st.composite
def choice_guides(draw):
    if draw(st.integers(0, 9)) == 0:      # many choices
        n = draw(st.integers(100, 3000))
        return [f"c{i}" for i in range(n)], None
    choices = draw(st.lists(CHOICE_TEXT, max_size=8))
    if draw(st.integers(0, 4)) == 0:
        choices[draw(st.integers(0, len(choices))):0] = draw(LONG_CHOICES)
    return choices, None


# kind -> its strategy of (value, what the output is checked against)
NATIVE_KINDS = {"json_object": st.tuples(st.booleans(), st.none()), "json_schema": schema_guides(),
                "regex": regex_guides(), "choice": choice_guides(), "grammar": grammar_guides()}
TGIS_KINDS = {**{k: v for k, v in NATIVE_KINDS.items() if k != "json_object"},
              "format": st.tuples(st.one_of(st.sampled_from([0, 1]), st.integers(-3, 20)), st.none())}


def set_guide(m, kind: str, value) -> None:
    """Sets one kind of a tandem.v1.Guided or a fmaas DecodingParameters oneof."""
    if kind == "choice":
        m.choice.SetInParent()
        m.choice.choices.extend(value)
    else:
        setattr(m, kind, value)


def guided_of(path: str, payload: bytes):
    """The guide a request holds once parsed, as (kind, value): the oneof's last field wins."""
    req = METHODS[path][0].FromString(payload)
    if path.startswith("/tandem"):
        m, kind = req.guided, req.guided.WhichOneof("kind")
    else:
        m = req.params.decoding
        kind = m.WhichOneof("guided")
    if kind is None:
        return None, None
    value = list(m.choice.choices) if kind == "choice" else getattr(m, kind)
    if kind == "json_object":
        return ("json", None) if value else (None, None)
    if kind == "format":
        return ("json", None) if value == tgis_pb.DecodingParameters.JSON else (None, None)
    return kind, value


def described(kind: str | None, value) -> str:
    """A guide, shortened: its kind, size and beginning."""
    size = sum(map(len, value)) if kind == "choice" else len(value) if isinstance(value, str) else 0
    return f"{kind} ({len(value) if kind == 'choice' else ''} {size} chars) {repr(value)[:120]}"


def _reply(path: str, replies: list[bytes]) -> tuple[str, bool]:
    """(the output, whether it ended because its guide was complete: GUIDE_COMPLETE or EOS, which
    a guide allows only there)."""
    msgs = [REPLIES[path].FromString(r) for r in replies]
    if path.startswith("/tandem"):
        return "".join(m.text for m in msgs), msgs[-1].finish_reason in (pb.FINISH_REASON_GUIDE_COMPLETE,
                                                                          pb.FINISH_REASON_EOS)
    if path.endswith("/Generate"):
        msgs = list(msgs[0].responses)
    return "".join(m.text for m in msgs), msgs[-1].stop_reason == tgis_pb.EOS_TOKEN


def check_guided_output(kind: str | None, value, known, text: str, complete: bool) -> str | None:
    """Why an OK reply's output is not in its guide's language, or None. known: the Python regex
    of a regex or grammar, or a clean JSON Schema (see the strategies above)."""
    if kind == "choice":
        cut_char = "\ufffd" in text and not any("\ufffd" in c for c in value)     # cut inside a character
        if complete and text not in value:
            return f"complete output {text!r} is none of the choices"
        if not cut_char and not any(c.startswith(text) for c in value):
            return f"output {text!r} begins none of the choices"
    elif kind in ("regex", "grammar") and known is not None and complete and not re.fullmatch(known, text):
        return f"complete output {text!r} does not match {known!r}"
    elif kind in ("json", "json_schema") and complete:
        try:
            parsed = json.loads(text)
        except ValueError:
            return f"complete output {text!r} is not JSON"
        if known is not None:
            import jsonschema
            try:
                jsonschema.validate(parsed, known)
            except jsonschema.ValidationError as e:
                return f"complete output {text!r} does not validate: {e.message}"
    return None


@st.composite
def guided_case(draw, face: str, combine: bool = False):
    """(path, request bytes, metadata, {(kind, value): known}) on an otherwise valid request.
    combine: the request's bytes are followed by a second guide of another kind, which protobuf
    merges into the same oneof (the last one wins)."""
    kinds = NATIVE_KINDS if face == "tandem" else TGIS_KINDS
    prompt, n = draw(st.sampled_from(PROBE_PROMPTS)), draw(st.integers(1, 8))
    guides = [(k, *draw(kinds[k])) for k in draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1,
                                                          max_size=2 if combine else 1, unique=True))]
    known = {(k, json.dumps(v)): c for k, v, c in guides}
    if face == "tandem":
        path = draw(st.sampled_from(list(METHODS)[:2]))
        req = build_request(prompt, max_new_tokens=n, temperature=draw(st.sampled_from([0.0, 0.8])), seed=7,
                            method=draw(st.sampled_from(["model", "ngram", "none"])), k=draw(st.integers(1, 4)))
        set_guide(req.guided, *guides[0][:2])
        extra = [pb.GenerateRequest(guided=pb.Guided()) for _ in guides[1:]]
        for e, (k, v, _) in zip(extra, guides[1:]):
            set_guide(e.guided, k, v)
        return path, b"".join(m.SerializeToString() for m in [req, *extra]), (), known
    path = draw(st.sampled_from(list(METHODS)[2:4]))
    method = draw(st.sampled_from([tgis_pb.GREEDY, tgis_pb.SAMPLE]))
    params = []
    for k, v, _ in guides:
        p = tgis_pb.Parameters(method=method, stopping=tgis_pb.StoppingCriteria(max_new_tokens=n))
        if method == tgis_pb.SAMPLE:
            p.sampling.temperature, p.sampling.seed = 0.8, 7
        set_guide(p.decoding, k, v)
        params.append(p)
    text = tgis_pb.GenerationRequest(text=prompt)
    wrap = ((lambda p, first: tgis_pb.BatchedGenerationRequest(requests=[text] if first else [], params=p))
            if path.endswith("/Generate") else
            (lambda p, first: tgis_pb.SingleGenerationRequest(request=text if first else None, params=p)))
    md = (("x-tandem-draft-method", draw(st.sampled_from(["model", "ngram", "none"]))),
          ("x-tandem-num-speculative-tokens", str(draw(st.integers(1, 4)))))
    return path, b"".join(wrap(p, i == 0).SerializeToString() for i, p in enumerate(params)), md, known


def guided_requests(address: str, failures: list, outcomes: Counter, slowest: list) -> int:
    """Runs on a thread with a blocking channel, while the event loop serves; returns requests
    sent. outcomes counts (guide kind, status name) and (kind, "complete"); slowest gets the three
    slowest requests, (seconds, request)."""
    sent = 0
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 1 << 20)]) as ch:
        def call(path: str, payload: bytes, metadata, known: dict) -> None:
            nonlocal sent
            sent += 1
            streaming = METHODS[path][1]
            rpc = (ch.unary_stream if streaming else ch.unary_unary)(path)
            kind, value = guided_of(path, payload)
            start = time.perf_counter()
            try:
                result = rpc(payload, timeout=60, metadata=metadata or None)
                replies = list(result) if streaming else [result]
            except grpc.RpcError as e:
                outcomes[kind, e.code().name] += 1
                if e.code() not in GUIDED_PROPER:
                    failures.append((path, shown(path, payload), dict(metadata), e.code(), e.details()))
                return
            finally:
                slowest[:] = sorted([*slowest, (time.perf_counter() - start, path, payload)], key=lambda x: x[0])[-3:]
            outcomes[kind, "OK"] += 1
            text, complete = _reply(path, replies)
            outcomes[kind, "complete"] += complete
            c = known.get((kind, json.dumps(value)), None) if kind not in ("json", "choice") else None
            if (why := check_guided_output(kind, value, c, text, complete)) is not None:
                failures.append((path, shown(path, payload), dict(metadata), why))

        def fuzz(cases: st.SearchStrategy) -> None:
            settings(max_examples=GUIDED_EXAMPLES, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))(given(cases)(lambda case: call(*case)))()

        fuzz(guided_case("tandem"))
        fuzz(guided_case("tgis"))
        fuzz(st.one_of(guided_case("tandem", combine=True), guided_case("tgis", combine=True)))
    return sent


WELL_FORMED_CHOICES = ["apple", "banana", "cherry pie", "durian"]
WELL_FORMED_REGEX = "[a-z]{2,4}-[0-9]{2}"


def well_formed_guided() -> list[tuple[str, pb.GenerateRequest]]:
    """Guided greedy requests the fuzz runs beside: (what the output is checked against, request)."""
    choice = build_request(GOOD_PROMPT, max_new_tokens=GOOD_TOKENS, method="model", k=3)
    set_guide(choice.guided, "choice", WELL_FORMED_CHOICES)
    regex = build_request(PROBE_PROMPTS[1], max_new_tokens=GOOD_TOKENS, method="ngram", k=3)
    regex.guided.regex = WELL_FORMED_REGEX
    unguided = good_request()
    return [("choice", choice), ("regex", regex), ("none", unguided)]


@pytest.mark.service
async def test_hostile_guides_get_client_statuses_while_guided_streams_stay_right(fuzz_stack, expected_good):
    stub = pb_grpc.GenerationServiceStub(fuzz_stack.channel)
    wells = well_formed_guided()

    async def run(req) -> tuple[str, int]:
        msgs = [m async for m in stub.GenerateStream(req, timeout=60)]
        return "".join(m.text for m in msgs), msgs[-1].finish_reason

    before = [await run(req) for _, req in wells]     # each one's output before the fuzzing begins
    (choice, choice_end), (rx, rx_end), (plain, _) = before
    assert choice in WELL_FORMED_CHOICES and choice_end == pb.FINISH_REASON_GUIDE_COMPLETE, before
    assert re.fullmatch(WELL_FORMED_REGEX, rx) and rx_end == pb.FINISH_REASON_GUIDE_COMPLETE, before
    assert plain == expected_good
    done, good, wrong = asyncio.Event(), 0, []

    async def well_formed_streams():
        nonlocal good
        i = 0
        while not done.is_set():
            i += 1
            (name, req), want = wells[i % len(wells)], before[i % len(wells)]
            try:
                got = await run(req)
            except grpc.aio.AioRpcError as e:
                wrong.append((name, e.code(), e.details()))
                await asyncio.sleep(0.5)
                continue
            good += 1
            if got != want:
                wrong.append((name, got, want))

    runner = asyncio.ensure_future(well_formed_streams())
    failures: list = []
    outcomes: Counter = Counter()
    slowest: list = []
    try:
        sent = await asyncio.to_thread(guided_requests, fuzz_stack.gateway_address, failures, outcomes, slowest)
    finally:
        done.set()
    await runner
    print(f"\nguided fuzz: {sent} requests, {good} well-formed streams alongside; outcomes "
          f"{dict(sorted(outcomes.items(), key=str))}; slowest "
          f"{[(round(t, 2), path, described(*guided_of(path, payload))) for t, path, payload in slowest]}")
    assert not failures, "\n".join(map(repr, failures[:5]))
    assert not wrong, wrong[:3]
    assert sent >= 3 * GUIDED_EXAMPLES and good >= len(wells)
    for kind in ("json_schema", "regex", "choice", "grammar"):        # each kind both served and refused
        assert GUIDED_EXAMPLES < 100 or min(outcomes[kind, "OK"], outcomes[kind, "INVALID_ARGUMENT"]) >= 5, outcomes
    assert await wait_until_idle(fuzz_stack) == (0, 0), await live_sessions(fuzz_stack)


# ---- what fuzzing the guides found, fixed: each of these failed before its fix ----

@pytest.mark.service
@pytest.mark.parametrize("face", ["tandem", "tgis"])
async def test_json_nested_past_the_parser_limit_is_invalid_argument(module_stack, face):
    for text in ("[" * 2000 + "]" * 2000, _nested(1500, "items")):
        if face == "tandem":
            req = build_request(GOOD_PROMPT, max_new_tokens=4, method="model", k=3)
            req.guided.json_schema = text
            calls = both_calls(module_stack, native=req)
        else:
            p = tgis_params()
            p.decoding.json_schema = text
            calls = both_calls(module_stack, tgis=p)
        for code, details in await statuses(calls):
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "json_schema" in details, (code, details)


EOS_TEXT_GUIDES = [("choice", ["<|endoftext|>"]), ("regex", r"(<\|endoftext\|>)+"), ("choice", ["ok", "<|endoftext|>"])]


@pytest.mark.service
@pytest.mark.parametrize("kind,value", EOS_TEXT_GUIDES, ids=lambda x: str(x))
async def test_a_guide_ending_in_the_eos_text_is_kept(module_stack, kind, value):
    """A guide whose language holds the end-of-sequence token's text, on a prompt after which the
    target's likeliest token is end-of-sequence: the output is in the language, or cut by
    max_new_tokens."""
    req = build_request(PROBE_PROMPTS[2], max_new_tokens=GOOD_TOKENS, method="ngram", k=3)
    set_guide(req.guided, kind, value)
    got = await module_stack.tandem.Generate(req, timeout=60)
    if kind == "choice":
        why = check_guided_output(kind, value, None, got.text, got.finish_reason != pb.FINISH_REASON_LENGTH)
    else:
        why = check_guided_output(kind, value, value, got.text, got.finish_reason != pb.FINISH_REASON_LENGTH)
    assert why is None, (why, got.finish_reason)


# Guides under which nothing may follow but more forced text, without end: xgrammar's
# find_jump_forward_tokens (Matcher.forced) collects that text before cutting it to the limit, so it
# allocates until std::bad_alloc, or until the draft worker is killed for memory.
ENDLESS = [("grammar", 'root ::= "a" root'),
           ("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})),
           ("json_schema", json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "minItems": 1,
                                                                            "items": {"$ref": "#/$defs/a"}}}}))]
FORCED_SCRIPT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))   # bad_alloc here, not the machine's memory
from transformers import AutoConfig, AutoTokenizer
from tandem.speculation.grammar import Grammars, Guide
tok = AutoTokenizer.from_pretrained(sys.argv[1])
grammars = Grammars(tok, AutoConfig.from_pretrained(sys.argv[1]).vocab_size, [tok.eos_token_id])
for kind, text in json.loads(sys.argv[2]):
    print(len(grammars.matcher(Guide(kind, text)).forced(3)), flush=True)
"""


@pytest.mark.system
def test_jump_forward_under_a_guide_forcing_endless_text_is_bounded(tiny_pair):
    """In a subprocess with its address space capped: the unbounded walk must not reach this one's."""
    import subprocess
    import sys
    ran = subprocess.run([sys.executable, "-c", FORCED_SCRIPT, str(tiny_pair[0]), json.dumps(ENDLESS)], check=False,
                         capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert ran.returncode == 0, ran.stderr[-800:]
    counts = [int(n) for n in ran.stdout.split()]
    assert len(counts) == len(ENDLESS) and max(counts) <= 3, ran.stdout

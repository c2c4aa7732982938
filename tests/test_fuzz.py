"""Thousands of hostile requests, every field of both public faces drawn by hypothesis, plus bytes
that are no message at all, while a well-formed stream runs next to them. Each hostile request
must get a proper status (never UNKNOWN or INTERNAL), and every well-formed stream must be the
target's greedy output. TANDEM_FUZZ_EXAMPLES scales the number of examples.

The processing and reporting fields (penalties, typical-p, length penalty, logprobs / TGIS
response options, truncate_input_tokens) are also probed on otherwise valid requests, so their
checks are reached rather than hidden behind an earlier refusal: there the status must be exactly
INVALID_ARGUMENT naming a field out of range, or OK with the counts the request asked for."""

import asyncio
import math
import os
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

# The in-process gateway draws from `random` (routing tie-breaks) while hypothesis runs its examples.
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "300"))
PROPER = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
METHODS = {  # path -> (request class, server streaming)
    "/tandem.v1.GenerationService/Generate": (pb.GenerateRequest, False),
    "/tandem.v1.GenerationService/GenerateStream": (pb.GenerateRequest, True),
    "/fmaas.GenerationService/Generate": (tgis_pb.BatchedGenerationRequest, False),
    "/fmaas.GenerationService/GenerateStream": (tgis_pb.SingleGenerationRequest, True),
    "/fmaas.GenerationService/Tokenize": (tgis_pb.BatchedTokenizeRequest, False),
    "/fmaas.GenerationService/ModelInfo": (tgis_pb.ModelInfoRequest, False),
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
def test_generic_strategy_reaches_every_new_field_with_hostile_values(cls):
    """In as many examples as the fuzz draws, the descriptor-driven strategy above sets each new
    field (nested ones included): floats non-finite and out of their range, integers past their
    limits. Derandomized: a fixed sequence, never a flake."""
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

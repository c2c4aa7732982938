"""Thousands of hostile requests, every field of both public faces drawn by hypothesis, plus bytes
that are no message at all, while a well-formed stream runs next to them. Each hostile request
must get a proper status (never UNKNOWN or INTERNAL), and every well-formed stream must be the
target's greedy output. TANDEM_FUZZ_EXAMPLES scales the number of examples."""

import asyncio
import os

import grpc
import pytest
import pytest_asyncio
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draft_worker.local import reference
from fmaas import generation_pb2 as tgis_pb
from gateway.guard import ClientGuard, TokenSet
from gateway.request import Limits
from tandem.client import build_request
from tandem.sampling import SamplingParams
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc
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


def scalar(field) -> st.SearchStrategy:
    if field.type in INTS:
        lo, hi = INTS[field.type]
        edges = [v for v in (0, 1, 2, 3, 8, 16, 17, 100, 2**31 - 1, lo, hi, -1) if lo <= v <= hi]
        return st.one_of(st.sampled_from(edges), st.integers(lo, hi))
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, 1.5, -1.0, float("nan"), float("inf")]),
                         st.floats(width=32 if field.type == F.TYPE_FLOAT else 64))
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


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fuzz_stack(tiny_pair):
    limits = Limits(max_new_tokens=GOOD_TOKENS, default_max_new_tokens=4, max_prompt_chars=4000, max_prompt_tokens=512)
    s = await start_stack(*tiny_pair, limits=limits, guard=ClientGuard(TokenSet([])), max_message_bytes=256 * 1024)
    yield s
    await stop_stack(s)


def hostile_requests(address: str, failures: list) -> int:
    """Runs on a thread with a blocking channel, while the event loop serves; returns requests sent."""
    sent = 0
    with grpc.insecure_channel(address) as ch:
        def call(path: str, payload: bytes) -> None:
            nonlocal sent
            sent += 1
            streaming = METHODS.get(path, (None, False))[1]
            rpc = (ch.unary_stream if streaming else ch.unary_unary)(path)
            try:
                result = rpc(payload, timeout=60)
                if streaming:
                    list(result)
            except grpc.RpcError as e:
                if e.code() not in PROPER:
                    failures.append((path, payload[:200], e.code(), e.details()))

        def fuzz(cases: st.SearchStrategy) -> None:      # cases: (method path, request bytes)
            settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))(
                given(cases)(lambda case: call(*case)))()

        encoded = lambda s: s.map(lambda m: m.SerializeToString())   # noqa: E731
        for path, (cls, _) in METHODS.items():
            fuzz(st.tuples(st.just(path), encoded(message(cls.DESCRIPTOR, cls))))
        fuzz(st.tuples(st.sampled_from(list(METHODS)[:2]), encoded(well_formed())))
        # Bytes that are no message, and a method that does not exist.
        fuzz(st.tuples(st.sampled_from([*METHODS, "/tandem.v1.GenerationService/Nope"]), st.binary(max_size=512)))
    return sent


async def test_hostile_requests_get_proper_statuses_while_a_good_stream_stays_right(fuzz_stack, tiny_pair,
                                                                                    tiny_models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    expected = tok.decode(reference(tiny_models[0], tok(GOOD_PROMPT).input_ids,
                                    SamplingParams(max_new_tokens=GOOD_TOKENS)), skip_special_tokens=True)
    stub = pb_grpc.GenerationServiceStub(fuzz_stack.channel)
    done, good, wrong = asyncio.Event(), 0, []

    async def well_formed_streams():
        nonlocal good
        while not done.is_set():
            msgs = [m async for m in stub.GenerateStream(
                build_request(GOOD_PROMPT, max_new_tokens=GOOD_TOKENS, method="model", k=3), timeout=60)]
            text = "".join(m.text for m in msgs)
            good += 1
            if text != expected:
                wrong.append(text)

    runner = asyncio.ensure_future(well_formed_streams())
    failures: list = []
    try:
        sent = await asyncio.to_thread(hostile_requests, fuzz_stack.gateway_address, failures)
    finally:
        done.set()
    await runner
    print(f"\nfuzz: {sent} hostile requests, {good} well-formed streams alongside")
    assert not failures, failures[:5]
    assert sent >= 8 * EXAMPLES and good >= 3 and not wrong
    assert await wait_until_idle(fuzz_stack) == (0, 0), await live_sessions(fuzz_stack)

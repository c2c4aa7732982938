"""The gateway's limits, each configured small: message size, prompt tokens, max_new_tokens, stop
sequences, concurrent requests per client and request rate per token. Real gRPC, in process."""

import asyncio
import threading

import grpc
import pytest
import pytest_asyncio

from fmaas import generation_pb2 as tgis_pb
from fmaas import generation_pb2_grpc as tgis_grpc
from gateway.guard import ClientGuard, TokenSet
from gateway.request import Limits
from tandem.client import build_request
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tests.stack import start_stack, stop_stack, wait_until_idle

pytestmark = pytest.mark.service

TOKENS = [f"limit-token-{i}" for i in range(8)]
LIMITS = Limits(max_new_tokens=16, max_prompt_tokens=40, max_stop_sequences=2, max_stop_sequence_chars=8)
MAX_BYTES = 64 * 1024
STREAMS, RATE, BURST = 2, 0.2, 4


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def limited(tiny_pair):
    guard = ClientGuard(TokenSet(TOKENS), max_streams_per_client=STREAMS, rate=RATE, burst=BURST)
    s = await start_stack(*tiny_pair, limits=LIMITS, guard=guard, max_message_bytes=MAX_BYTES)
    yield s
    await stop_stack(s)


def auth(i):
    return (("authorization", f"Bearer {TOKENS[i]}"),)


async def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()


@pytest.mark.parametrize("request_, code, words", [
    (build_request("x " * 80, max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "the limit is 40"),
    (build_request("x", max_new_tokens=17), grpc.StatusCode.INVALID_ARGUMENT, "between 1 and 16"),
    (build_request("x", max_new_tokens=4, stop=["a", "b", "c"]), grpc.StatusCode.INVALID_ARGUMENT,
     "at most 2 stop sequences"),
    (build_request("x", max_new_tokens=4, stop=["123456789"]), grpc.StatusCode.INVALID_ARGUMENT, "limit is 8"),
    (build_request("x" * (MAX_BYTES + 1), max_new_tokens=4), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
])
async def test_request_limits(limited, request_, code, words):
    got, details = await code_of(pb_grpc.GenerationServiceStub(limited.channel).Generate(
        request_, timeout=10, metadata=auth(0)))
    assert got == code and words in details, details


async def test_concurrent_requests_per_client(limited):
    """Two streams held open (the verify worker's inference thread is kept busy), the third is
    refused at once; another client is not affected; once they end the client may start again."""
    stub = pb_grpc.GenerationServiceStub(limited.channel)
    release = threading.Event()
    blocker = asyncio.ensure_future(limited._threads[0].run(release.wait, 30))
    try:
        held = [stub.GenerateStream(build_request("def f(x):", max_new_tokens=8, method="none"), timeout=30,
                                    metadata=auth(1)) for _ in range(STREAMS)]
        await asyncio.sleep(0.5)        # both admitted and waiting for the inference thread
        third, other = await asyncio.gather(
            code_of(stub.Generate(build_request("x", max_new_tokens=2, method="none"), timeout=30, metadata=auth(1))),
            code_of(tgis_grpc.GenerationServiceStub(limited.channel).ModelInfo(
                tgis_pb.ModelInfoRequest(), timeout=10, metadata=auth(2))))
        assert third[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and f"at most {STREAMS}" in third[1]
        assert other[0] == grpc.StatusCode.OK
    finally:
        release.set()
        await blocker
    for call in held:
        assert [m async for m in call][-1].usage.generated_tokens == 8
    assert await code_of(stub.Generate(build_request("x", max_new_tokens=2, method="none"), timeout=30,
                                       metadata=auth(1))) == (grpc.StatusCode.OK, "")
    assert await wait_until_idle(limited) == (0, 0)


async def test_request_rate_per_token(limited):
    stub = tgis_grpc.GenerationServiceStub(limited.channel)
    codes = [(await code_of(stub.ModelInfo(tgis_pb.ModelInfoRequest(), timeout=10, metadata=auth(3))))[0]
             for _ in range(BURST + 1)]
    assert codes == [grpc.StatusCode.OK] * BURST + [grpc.StatusCode.RESOURCE_EXHAUSTED]
    # Other tokens have their own buckets.
    assert (await code_of(stub.ModelInfo(tgis_pb.ModelInfoRequest(), timeout=10, metadata=auth(4))))[0] \
        == grpc.StatusCode.OK


@pytest.mark.parametrize("method", ["/tandem.v1.GenerationService/Generate",
                                    "/fmaas.GenerationService/GenerateStream", "/fmaas.GenerationService/Tokenize"])
async def test_bytes_that_are_not_a_message_get_invalid_argument(limited, method):
    call = limited.channel.unary_stream(method) if "Stream" in method else limited.channel.unary_unary(method)
    try:
        result = call(b"\xff\xff\xff\xff\x0f", timeout=10, metadata=auth(5))
        if "Stream" in method:
            [m async for m in result]
        else:
            await result
        raise AssertionError("accepted garbage")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "is not a valid" in e.details(), e.details()

"""Continuous batching through the services as real processes: concurrent streams share the verify
worker's passes, a full KV pool queues and refuses, a later turn is rebuilt (the pool and the batcher
alone: tests/test_batching.py)."""

import asyncio

import grpc
import pytest
from transformers import AutoTokenizer

from tandem.client import build_request
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.local import reference
from tests.test_observability_system import scrape

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def small_pool_stack(tiny_pair, redis_server):
    """A verify worker whose pool holds 450 positions, and a draft worker that streams its proposals."""
    target, draft = tiny_pair
    with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url,
               verify_args=["--kv-budget-tokens", "450", "--admission-timeout", "1"],
               draft_args=["--no-adaptive-k", "--pipeline"]) as s:
        yield s


def test_concurrent_streams_through_the_service_match_greedy(small_pool_stack, tiny_pair, tiny_models):
    """Eight streams at once (model, n-gram and plain decoding mixed) share the verify worker's
    passes, and the greedy ones stream their proposals; each output equals the target's greedy output for
    that request alone."""
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    cases = [(p, m, k) for p in ("def add(a, b):", "for i in range(10):\n", "class Point:", "x = np.zeros(")
             for m, k in (("model", 4), ("ngram", 3))]
    cases[1] = (cases[1][0], "none", 0)

    async def main():
        async with grpc.aio.insecure_channel(small_pool_stack.address("gateway")) as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            return await asyncio.gather(*(stub.Generate(build_request(p, max_new_tokens=20, method=m, k=k),
                                                        timeout=120) for p, m, k in cases))

    for (prompt, _, _), r in zip(cases, asyncio.run(main())):
        expected = reference(tiny_models[0], tok(prompt).input_ids, SamplingParams(max_new_tokens=20))
        assert r.text == tok.decode(expected, skip_special_tokens=True)
    samples = scrape(small_pool_stack, "verify_worker")
    single = samples[("tandem_verify_batch_sessions_bucket", (("le", "1.0"),))]
    assert samples[("tandem_verify_batch_sessions_count", ())] > single, "no pass held more than one session"
    streamed = scrape(small_pool_stack, "draft_worker")
    assert streamed[("tandem_draft_streamed_tokens_total", (("outcome", "sent"),))] > 0


def test_full_pool_queues_a_request_then_admits_or_refuses_it(small_pool_stack):
    """Two sessions reserve 440 of 450 positions. A third waits in the admission queue and gets
    RESOURCE_EXHAUSTED after the 1 s admission timeout; a fourth gets in once one of the first two
    ends, while it waits."""
    def open_request(session_id, max_new):
        return ipb.VerifyRequest(open=ipb.OpenSession(session_id=session_id, prompt_ids=[3, 4, 5],
                                                      sampling=ipb.WorkerSampling(max_new_tokens=max_new,
                                                                                  top_p=1.0)))

    async def main():
        async with grpc.aio.insecure_channel(small_pool_stack.address("verify_worker")) as ch:
            stub = ipb_grpc.VerifyServiceStub(ch)
            holders = []
            for sid in ("a", "b"):                     # 3 + 200 + 17 = 220 positions each
                call = stub.Verify()
                await call.write(open_request(sid, 200))
                assert (await call.read()).WhichOneof("kind") == "opened"
                holders.append(call)
            refused = stub.Verify()
            await refused.write(open_request("c", 10))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await refused.read()
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "KV budget full" in e.value.details()
            waiting = stub.Verify()
            await waiting.write(open_request("d", 10))
            await asyncio.sleep(0.3)
            holders[0].cancel()                         # frees 220 positions
            assert (await waiting.read()).WhichOneof("kind") == "opened"
            for call in (holders[1], waiting):
                call.cancel()

    asyncio.run(main())


def test_a_later_turn_whose_cache_cannot_grow_is_rebuilt_not_refused(small_pool_stack, tiny_models):
    """A finished turn holds 220 of the 450 positions; its next turn needs 423. Its run cannot grow
    in place when a live session holds the slots after it, and there is no room for a second run
    beside it: the earlier turn gives its run up and the history is prefilled again, with the
    target's own output. Before, the run stayed allocated until the last reference to the earlier
    turn went, and one run of the suite got RESOURCE_EXHAUSTED ("KV pool fragmented") here."""
    def opening(session_id, prompt, max_new):
        return ipb.VerifyRequest(open=ipb.OpenSession(session_id=session_id, prompt_ids=prompt,
                                                      sampling=ipb.WorkerSampling(max_new_tokens=max_new,
                                                                                  top_p=1.0)))

    async def turn(stub, session_id, prompt, max_new):
        call = stub.Verify(timeout=120)
        await call.write(opening(session_id, prompt, max_new))
        opened = (await call.read()).opened
        await call.write(ipb.VerifyRequest(proposal=ipb.Proposal(plain_steps=max_new)))
        out = [t for _ in range(max_new) for t in (await call.read()).verdict.token_ids]
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        return opened, out

    async def main():
        async with grpc.aio.insecure_channel(small_pool_stack.address("verify_worker")) as ch:
            stub = ipb_grpc.VerifyServiceStub(ch)
            first = [3, 4, 5]
            _, out = await turn(stub, "grows", first, 200)                # 3 + 200 + 17 = 220
            assert out == reference(tiny_models[0], first, SamplingParams(max_new_tokens=200))
            wall = stub.Verify(timeout=120)                                 # 3 + 7 + 17 = 27 positions
            await wall.write(opening("wall", [6, 7, 8], 7))
            assert (await wall.read()).HasField("opened")
            second = first + out + [9, 10, 11]
            _, out2 = await turn(stub, "grows", second, 200)              # 206 + 200 + 17 = 423
            assert out2 == reference(tiny_models[0], second, SamplingParams(max_new_tokens=200))
            wall.cancel()

    asyncio.run(main())

"""Internal streams refuse out-of-protocol messages, and a refused stream never disturbs another
session: real gRPC to the in-process verify worker, tiny seeded models."""

import itertools
import math

import grpc
import pytest

from tandem.speculation.sampling import SamplingParams
from tandem.v1 import internal_pb2 as pb
from tandem.v1 import internal_pb2_grpc as pb_grpc
from tests.local import reference
from tests.stack import stack  # noqa: F401  (the fixture)
from verify_worker.price import TokenPrice

pytestmark = pytest.mark.service

PROMPT = [5, 17, 42, 99, 7, 63, 12]
N = 24
GREEDY = pb.WorkerSampling(max_new_tokens=N, top_p=1.0)


def opening(session_id="s", prompt=PROMPT, sampling=GREEDY):
    return pb.VerifyRequest(open=pb.OpenSession(session_id=session_id, prompt_ids=prompt, sampling=sampling))


def proposal(tokens, distributions=()):
    return pb.VerifyRequest(proposal=pb.Proposal(token_ids=tokens, distributions=list(distributions)))


async def refused(stub, messages) -> tuple[grpc.StatusCode, str]:
    """Sends messages on one Verify stream until the worker ends it; its status."""
    call = stub.Verify(timeout=30)
    try:
        for m in messages:
            await call.write(m)
            if await call.read() == grpc.aio.EOF:
                break
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    except Exception:           # a write after the worker ended the stream
        pass
    return await call.code(), await call.details()


def vocab(stack):
    return stack.verify.engine.model.vocab_size


def bad_streams(stack):
    """(messages, status, words in the message) for each kind of out-of-protocol stream."""
    v, k_max = vocab(stack), stack.verify.engine.max_proposal
    inv, pre = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    return [
        ([proposal([1, 2])], pre, "before the session was opened"),
        ([pb.VerifyRequest()], inv, "empty VerifyRequest"),
        ([opening("b"), opening("b")], pre, "already open"),
        ([opening("b", prompt=[1, v])], inv, "outside the vocabulary"),
        ([opening("b", prompt=[-3])], inv, "outside the vocabulary"),
        ([opening("b", prompt=[])], inv, "must not be empty"),
        ([opening("b"), proposal(list(range(k_max + 1)))], inv, "exceeds this worker's limit"),
        ([opening("b"), proposal([3, v + 5])], inv, "outside the vocabulary"),
        ([opening("b"), pb.VerifyRequest(proposal=pb.Proposal(token_ids=[3], plain_steps=4))], inv,
         "needs a proposal without tokens"),
        ([opening("b"), proposal([2**31 - 1])], inv, "outside the vocabulary"),
        ([opening("b", sampling=pb.WorkerSampling(temperature=math.nan, max_new_tokens=4))], inv, "temperature"),
        ([opening("b", sampling=pb.WorkerSampling(max_new_tokens=0))], inv, "max_new_tokens"),
        ([opening("b", sampling=pb.WorkerSampling(max_new_tokens=2, min_new_tokens=5))], inv, "min_new_tokens"),
        ([opening("b", sampling=pb.WorkerSampling(max_new_tokens=2, top_p=1.5))], inv, "top_p"),
        ([opening("b", sampling=pb.WorkerSampling(temperature=1.0, max_new_tokens=4, top_p=1.0)),
          proposal([3, 4], [pb.DraftDistribution(token_ids=[3], probs=b"\x00\x00\x80\x3f")])], inv,
         "2 tokens but 1 draft distributions"),
        ([opening("b", sampling=pb.WorkerSampling(temperature=1.0, max_new_tokens=4, top_p=1.0)),
          proposal([3], [pb.DraftDistribution(token_ids=[3], probs=b"\x00\x00")])], inv, "prob bytes"),
        ([opening("b", sampling=pb.WorkerSampling(temperature=1.0, max_new_tokens=4, top_p=1.0)),
          proposal([3], [pb.DraftDistribution(token_ids=[v], probs=b"\x00\x00\x80\x3f")])], inv, "vocabulary"),
    ]


async def test_bad_streams_are_refused_and_another_session_is_untouched(stack, tiny_models):
    """Session A is verified round by round, with bad streams between every two rounds; its output
    must still be the target's greedy output, and nothing may stay reserved afterwards. Each kind
    of bad stream is sent while A is open (A takes 8 rounds: three kinds before each round)."""
    expected = reference(tiny_models[0], PROMPT, SamplingParams(max_new_tokens=N))
    kinds = bad_streams(stack)
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        stub = pb_grpc.VerifyServiceStub(ch)
        a = stub.Verify(timeout=60)
        await a.write(opening("victim"))
        assert (await a.read()).HasField("opened")
        out, bad, tried = [], iter(kinds), 0
        while True:
            for messages, code, words in itertools.islice(bad, 3):
                got, details = await refused(stub, messages)
                assert got == code and words in details, (messages, got, details)
                tried += 1
            # A proposal of two right tokens and a wrong one: accepted, rejected and rolled back.
            i = len(out)
            guess = expected[i:i + 2] + [(expected[i + 2] + 1) % vocab(stack)] if i + 2 < len(expected) else []
            await a.write(proposal(guess))
            verdict = (await a.read()).verdict
            out += list(verdict.token_ids)
            if verdict.stop_reason:
                break
        await a.done_writing()
        assert out == expected
        assert tried == len(kinds), f"A ended after {tried} of {len(kinds)} kinds of bad stream"
        status = await stub.Status(pb.StatusRequest(), timeout=10)
        assert status.live_sessions == 0 and status.reserved_kv_tokens == 0


async def test_a_reopened_session_moves_to_the_new_stream(stack, tiny_models):
    """A migration can open a session whose old stream the worker has not seen die yet: the new
    stream serves it, and the old one is refused on its next message instead of extending it too."""
    expected = reference(tiny_models[0], PROMPT, SamplingParams(max_new_tokens=N))
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        stub = pb_grpc.VerifyServiceStub(ch)
        old, new = stub.Verify(timeout=60), stub.Verify(timeout=60)
        await old.write(opening("moved"))
        await old.read()
        await new.write(opening("moved"))
        await new.read()
        await old.write(proposal(expected[:2]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await old.read()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "reopened" in e.value.details()
        out = []
        while True:
            await new.write(proposal([]))
            verdict = (await new.read()).verdict
            out += list(verdict.token_ids)
            if verdict.stop_reason:
                break
        assert out == expected
        await new.done_writing()
        status = await stub.Status(pb.StatusRequest(), timeout=10)
        assert status.live_sessions == 0 and status.reserved_kv_tokens == 0


async def test_a_run_of_plain_steps_answers_each_step_and_stops_with_the_session(stack, tiny_models):
    """One Proposal with plain_steps=n and no tokens gets n verdicts, each one plain token of the
    target's greedy output; a run longer than the generation ends at its stop."""
    expected = reference(tiny_models[0], PROMPT, SamplingParams(max_new_tokens=N))
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        call = pb_grpc.VerifyServiceStub(ch).Verify(timeout=60)
        await call.write(opening("runs"))
        assert (await call.read()).HasField("opened")
        await call.write(pb.VerifyRequest(proposal=pb.Proposal(plain_steps=5)))
        run = [(await call.read()).verdict for _ in range(5)]
        assert [list(v.token_ids) for v in run] == [[t] for t in expected[:5]]
        assert all(v.accepted == 0 and not v.stop_reason for v in run)
        await call.write(proposal(expected[5:8]))                     # speculation goes on after it
        verdict = (await call.read()).verdict
        assert verdict.accepted == 3 and list(verdict.token_ids) == expected[5:9]
        await call.write(pb.VerifyRequest(proposal=pb.Proposal(plain_steps=1000)))
        rest = []
        while True:
            msg = await call.read()
            if msg == grpc.aio.EOF:
                break
            rest.append(msg.verdict)
        assert [t for v in rest for t in v.token_ids] == expected[9:]
        assert len(rest) == N - 9 and rest[-1].stop_reason == pb.STOP_REASON_LENGTH
        assert await call.code() == grpc.StatusCode.OK


async def test_a_shared_prompt_prefix_is_copied_not_recomputed(stack, tiny_models):
    """A session whose prompt starts like one another session holds (live or kept) copies that
    prefix's KV, and its output is the target's own all the same."""
    prompt = PROMPT * 4                                 # 28 tokens
    params = SamplingParams(max_new_tokens=N)
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        stub = pb_grpc.VerifyServiceStub(ch)

        async def session(session_id: str, ids: list[int]) -> tuple[int, list[int]]:
            call = stub.Verify(timeout=60)
            await call.write(opening(session_id, prompt=ids))
            cached = (await call.read()).opened.cached_tokens
            await call.write(pb.VerifyRequest(proposal=pb.Proposal(plain_steps=N)))
            out = [t for _ in range(N) for t in (await call.read()).verdict.token_ids]
            return cached, out

        donor = await session("prefix-donor", prompt)               # kept idle: it has a session id
        assert donor == (0, reference(tiny_models[0], prompt, params))
        longer = prompt + [3, 1, 4, 1, 5]
        cached, out = await session("prefix-taker", longer)
        assert cached == len(prompt) and out == reference(tiny_models[0], longer, params)
        short = prompt[:10] + [8, 8, 8, 8, 8, 8, 8, 8]             # shares 10 < 16 tokens: computed
        assert (await session("", short))[0] == 0


async def test_each_verdict_carries_the_workers_seconds_per_position(stack, tiny_models):
    """Verdict.position_seconds is the verify worker's fitted marginal seconds per proposed position
    (its price's beta), which the draft worker's controller uses to learn what a plain round in the
    same pass would have taken. Seeded with passes that cost 1 s per position, the verdicts say so."""
    expected = reference(tiny_models[0], PROMPT, SamplingParams(max_new_tokens=N))
    original, price = stack.verify.price, TokenPrice()
    for n in range(1, 41):
        price.observe_pass(n, 0, 0.5 + 1.0 * n)
    stack.verify.price = price
    try:
        async with grpc.aio.insecure_channel(stack.verify_address) as ch:
            call = pb_grpc.VerifyServiceStub(ch).Verify(timeout=60)
            await call.write(opening("position-seconds"))
            assert (await call.read()).HasField("opened")
            done = 0
            for k in (3, 0, 2, 1):
                await call.write(proposal(expected[done:done + k]))
                verdict = (await call.read()).verdict
                assert verdict.accepted == k
                done += k + 1
                assert verdict.position_seconds == pytest.approx(price.position_seconds(1, 1), rel=1e-6)
                assert 0.5 < verdict.position_seconds < 1.5
            await call.done_writing()
    finally:
        stack.verify.price = original

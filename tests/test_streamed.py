"""Streamed proposals (--pipeline, OpenSession.stream): the rules both workers keep for the run of
proposed tokens, the verify worker's run under pieces that arrive late, early or stale, and the
whole service streaming against transformers' generate on the target alone. Every request
parameter under streaming is covered by test_parameters, which runs each test streamed too."""

import asyncio

import grpc
import pytest
import torch

from draft_worker.drafters import Draft
from draft_worker.streamed import BranchRows, Streaming
from tandem.speculation.survival import Survival
from tandem.client import build_request
from tandem.service import metrics
from tandem.speculation.drafting import Drawn
from tandem.speculation.sampling import SamplingParams
from tandem.speculation.stream import after_verdict, place
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.stack import stack, wait_until_idle  # noqa: F401  (stack: the fixture)
from verify_worker.streamed import StreamedRun


# ---- the rules (unit) ----

@pytest.mark.unit
def test_a_verdict_keeps_the_run_only_beyond_a_prefix_it_confirms():
    assert after_verdict([5, 6, 7, 8], [5, 6]) == [7, 8]            # accepted 1, bonus = the run's next
    assert after_verdict([5, 6, 7, 8], [5, 9]) == []                # rejected at 1: the rest was drafted after 6
    assert after_verdict([5], [5, 6]) == []                         # the run ran out: the bonus is new
    assert after_verdict([], [4]) == []                             # a plain step


@pytest.mark.unit
def test_a_piece_must_continue_the_known_tokens():
    tokens = [1, 2, 3]
    assert place(tokens, [], 3, 3, [4, 5]) == [4, 5]                # right after the committed tokens
    assert place(tokens, [4, 5], 5, 5, [6]) == [4, 5, 6]            # after the run
    assert place(tokens, [4, 5], 5, 9, [6]) is None                 # drafted after another token at 4
    assert place(tokens, [4, 5], 6, 6, [7]) is None                 # a gap: the piece before it was dropped
    assert place(tokens, [], 2, 2, [3, 4, 5]) == [4, 5]             # a verdict committed its first token
    assert place(tokens, [], 2, 2, [9, 4]) is None                  # ... or another one there: stale
    assert place(tokens, [], 0, 0, [1]) is None                     # index 0 is the prompt's


class _Session:
    def __init__(self, tokens):
        self.tokens = tokens


@pytest.mark.unit
async def test_the_verify_side_run_takes_pieces_while_a_pass_commits():
    run = StreamedRun(_Session([1, 2, 3]), max_proposal=2)
    run.add(ipb.Proposal(token_ids=[4], start=3, after=3))
    run.add(ipb.Proposal(token_ids=[5, 6], start=4, after=4))
    assert await run.next() == [4, 5]                               # at most max_proposal
    run.judged([4, 7], 2, 1)                                        # 5 rejected, 7 the target's own
    assert run.run == [] and run.tokens == [1, 2, 3, 4, 7]
    run.add(ipb.Proposal(token_ids=[8], start=6, after=6))          # drafted after 6: stale
    assert run.run == []
    run.add(ipb.Proposal(token_ids=[7, 8], start=4, after=4))       # the draft caught up: 7 is known
    assert run.run == [8]
    run.judged([8, 9], 1, 1)
    run.add(ipb.Proposal(start=0))                                  # nothing to propose: plain steps
    assert await run.next() == []
    run.end()
    run.plain = False
    assert await run.next() is None


@pytest.mark.unit
async def test_under_load_a_pass_takes_only_the_positions_worth_their_price():
    price = [0.0]
    run = StreamedRun(_Session([1]), max_proposal=8, price=lambda: price[0])
    run.add(ipb.Proposal(token_ids=[2, 3, 4, 5, 6], start=1, after=1))
    assert await run.next() == [2, 3, 4, 5, 6]                      # alone in its passes: no price
    price[0] = 0.6
    assert await run.next() == [2]                                  # nothing measured: one position
    for _ in range(20):
        run.survival.add(5, 5)                                      # runs accepted whole, often
    assert await run.next() == [2, 3, 4, 5, 6]
    for _ in range(40):
        run.survival.add(5, 1)                                      # then only their first tokens
    assert await run.next() == [2]
    for _ in range(30):                                             # each pass judges one token and the
        run.judged([2, 3], 1, 1)                                    # target's next agrees with the run's
        run.tokens, run.run = [1], [2, 3, 4, 5, 6]
    assert len(await run.next()) > 1                                # so the cut grows back


@pytest.mark.unit
async def test_alone_a_pass_waits_briefly_for_a_short_run_and_cuts_a_long_one():
    def curve(n):                                                   # flat to 6 positions, then dearer
        return 0.3 if n <= 6 else 0.3 + 0.1 * (n - 6)
    run = StreamedRun(_Session([1]), max_proposal=8, pass_seconds=curve)
    for _ in range(30):
        run.survival.add(8, 8)                                      # runs accepted whole, often
    run.gap = 0.01                                                  # the draft sends a token every 10 ms
    run.add(ipb.Proposal(token_ids=[2], start=1, after=1))
    waiting = asyncio.ensure_future(run.next())
    await asyncio.sleep(0.005)
    assert not waiting.done()                                       # 4 more come for 40 ms: worth it
    run.add(ipb.Proposal(token_ids=[3, 4, 5, 6, 7, 8, 9], start=2, after=2))
    assert await waiting == [2, 3, 4, 5, 6]                         # 6 positions cost what 2 do
    assert await run.next() == [2, 3, 4, 5, 6]                      # and no more: the 7th costs more than it gives
    run.judged([2, 3, 4, 5, 6, 7], 5, 5)
    run.add(ipb.Proposal(start=0))                                  # paused: nothing more is coming
    assert await asyncio.wait_for(run.next(), 0.1) == [8, 9]
    shared = StreamedRun(_Session([1]), max_proposal=8, pass_seconds=curve, price=lambda: 0.5)
    shared.gap = 0.01
    shared.add(ipb.Proposal(token_ids=[2], start=1, after=1))
    assert await asyncio.wait_for(shared.next(), 0.1) == [2]        # sharing passes: no waiting


@pytest.mark.unit
async def test_a_new_streamed_session_starts_from_the_acceptance_of_the_workers_earlier_ones():
    prior = Survival()
    first = StreamedRun(_Session([1]), max_proposal=8, price=lambda: 0.6, prior=prior)
    first.add(ipb.Proposal(token_ids=[2, 3, 4, 5, 6], start=1, after=1))
    assert await first.next() == [2]                                # nothing measured yet: one position
    for _ in range(10):
        first.tokens, first.run = [1], [2, 3, 4, 5, 6]
        first.judged([2, 3, 4, 5, 6, 7], 5, 5)                      # runs accepted whole
    assert prior.reach(5)[-1] > 0.6                                 # the worker's prior learnt it too
    later = StreamedRun(_Session([1]), max_proposal=8, price=lambda: 0.6, prior=prior)
    later.add(ipb.Proposal(token_ids=[2, 3, 4, 5, 6], start=1, after=1))
    assert await later.next() == [2, 3, 4, 5, 6]                    # from its first pass
    for _ in range(8):
        later.survival.add(5, 0)                                    # its own passes soon outweigh it
    assert await later.next() == [2]


class _Scripted:
    """A request's speculation as the draft side's streaming sees it, with a drafter that follows a
    rule (each token the last + 1, second choice the last + 50, q 0.6 and 0.3) and verdicts given
    by the test, every message written kept."""

    def __init__(self, prompt: list[int]) -> None:
        self.tokens, self.prompt = list(prompt), list(prompt)
        self.params = SamplingParams(max_new_tokens=64)
        self.opened = ipb.Opened(max_proposal=4, max_context=512)
        self.drafter = type("D", (), {"uses_model": True, "name": "model"})()
        self.state, self.verdicts, self.written = "first", asyncio.Queue(), []
        self.call = self
        self.started = 0

    async def write(self, request: ipb.VerifyRequest) -> None:
        self.written.append(request.proposal)

    def cancel(self) -> None:
        pass

    async def read(self) -> ipb.VerifyResponse:
        return ipb.VerifyResponse(verdict=await self.verdicts.get())

    def propose(self, tokens: list[int], k: int, state=None, steps: int = 0) -> asyncio.Future:
        async def one():
            await asyncio.sleep(0.001)
            last = tokens[-1]
            return Draft([last + 1], drawn=[Drawn(last + 1, 0.6, last + 50, 0.3)]), 0.0
        return asyncio.ensure_future(one())

    def start_state(self):
        self.started += 1
        return f"line-{self.started}"

    def chunk(self, verdict, drafted, accepted):
        return verdict.token_ids


def prepared(outcome: str) -> float:
    return metrics.PREPARED.labels(outcome)._value.get()


async def _drafted(streaming: Streaming, run: int, branch: int = 0) -> None:
    """Until the run holds `run` tokens and, with `branch`, two branches that many each."""
    async def until():
        while len(streaming.run) < run or branch and (
                len(streaming.branches) < 2 or min(len(b.run) for b in streaming.branches) < branch):
            await asyncio.sleep(0.001)
    await asyncio.wait_for(until(), 5)


def _streaming(rows: BranchRows | None = None, prepare: bool = True):
    """A streaming draft side on a scripted speculation (its own two branch rows unless given;
    none without prepare), its first chunk awaited."""
    spec = _Scripted([1, 2, 3])
    streaming = Streaming(spec, eos_ids=[0], rows=(rows or BranchRows(2)) if prepare else None)
    chunks = streaming.chunks()
    return spec, streaming, chunks, asyncio.ensure_future(chunks.__anext__())


async def _judged(spec: _Scripted, streaming: Streaming, awaiting, token_ids: list[int], accepted: int):
    """Stops drafting (what follows is the verdict's) and has a verdict taken in; its chunk."""
    streaming.cancel()
    spec.verdicts.put_nowait(ipb.Verdict(token_ids=token_ids, checked=max(1, accepted), accepted=accepted))
    return await awaiting


@pytest.mark.unit
async def test_a_verdict_that_takes_the_drafts_second_choice_gets_its_prepared_continuation_at_once():
    spec, streaming, _, first = _streaming()
    await _drafted(streaming, 4, 4)
    # where the draft's reach times q(second choice) is most: 0.3 at index 3, 0.6 x 0.3 at index 4
    assert [(b.at, b.alt, b.run[:4]) for b in streaming.branches] == [(3, 53, [54, 55, 56, 57]),
                                                                        (4, 54, [55, 56, 57, 58])]
    assert [list(p.token_ids) for p in spec.written[:4]] == [[4], [5], [6], [7]]
    hits, unused, n = prepared("hit"), prepared("unused"), len(spec.written)
    line = streaming.branches[0].state
    assert list(await _judged(spec, streaming, first, [53], 0)) == [53]
    assert prepared("hit") == hits + 1 and prepared("unused") == unused + 1   # the other was after the fork
    piece = spec.written[n]                                         # written before the chunk went on
    assert (list(piece.token_ids[:4]), piece.start, piece.after) == ([54, 55, 56, 57], 4, 53)
    assert place([1, 2, 3, 53], [], piece.start, piece.after, list(piece.token_ids)) == list(piece.token_ids)
    assert streaming.run == list(piece.token_ids) and spec.state == line and "first" in streaming.spares
    assert streaming.branches == []


@pytest.mark.unit
async def test_a_verdict_that_takes_another_token_gets_no_prepared_continuation():
    spec, streaming, _, first = _streaming()
    await _drafted(streaming, 4, 2)
    misses, n = prepared("miss"), len(spec.written)
    await _judged(spec, streaming, first, [99], 0)
    assert prepared("miss") == misses + 1 and len(spec.written) == n and streaming.run == []
    assert spec.state == "first" and streaming.branches == [] and len(streaming.spares) == 2


@pytest.mark.unit
async def test_a_branch_stays_until_a_verdict_reaches_it_and_goes_when_one_passes_it():
    spec, streaming, chunks, first = _streaming()
    await _drafted(streaming, 4, 1)
    unused = prepared("unused")
    await _judged(spec, streaming, first, [4], 1)                   # the run's token at 3
    assert [b.at for b in streaming.branches] == [4] and prepared("unused") == unused + 1
    await _judged(spec, streaming, chunks.__anext__(), [5, 6, 7], 3)   # through 4
    assert streaming.branches == [] and prepared("unused") == unused + 2


@pytest.mark.unit
async def test_the_draft_runs_two_passes_ahead_of_the_verdicts_at_the_requests_k():
    for k, ahead in ((0, 8), (3, 6), (9, 8)):                     # the verify worker's most is 4
        spec = _Scripted([1, 2, 3])
        streaming = Streaming(spec, eos_ids=[0], k=k)
        first = asyncio.ensure_future(streaming.chunks().__anext__())
        await _drafted(streaming, ahead)
        await asyncio.sleep(0.02)                                   # and no further
        assert len(streaming.run) == ahead and spec.written[-1].token_ids == []     # then a pause
        streaming.cancel()
        first.cancel()


@pytest.mark.unit
async def test_branches_take_the_workers_rows_first_come_and_give_them_back():
    rows = BranchRows(2)
    spec, streaming, _, first = _streaming(rows)
    await _drafted(streaming, 4, 1)
    other, later, _, second = _streaming(rows)
    await _drafted(later, 4)
    assert len(streaming.branches) == 2 and later.branches == [] and rows.free == 0
    later.cancel()
    await _judged(spec, streaming, first, [99], 0)                  # both of the first's branches end
    assert rows.free == 2
    assert later.release() == [] and rows.free == 2
    second.cancel()
    none_spec, none, _, third = _streaming(prepare=False)           # --no-prepare
    await _drafted(none, 4)
    assert none.branches == [] and none_spec.started == 0
    none.cancel()
    third.cancel()


# ---- the service (in process, real gRPC) ----

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n"]
NEW = 32


@pytest.fixture
def streaming(stack):
    stack.draft.drafting.adaptive_k = False
    stack.draft.drafting.pipeline = True
    yield stack
    stack.draft.drafting.adaptive_k = True
    stack.draft.drafting.pipeline = False


def generate(oracle, prompt: str, n: int) -> str:
    model, tok = oracle
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def sent(outcome: str) -> float:
    return metrics.STREAMED.labels(outcome)._value.get()


@pytest.mark.service
@pytest.mark.parametrize("method,k", [("model", 1), ("model", 4), ("model", 16), ("ngram", 2), ("ngram", 8)])
async def test_streamed_greedy_equals_the_target_alone(streaming, oracle, method, k):
    before = sent("sent")
    stub = pb_grpc.GenerationServiceStub(streaming.channel)
    for prompt in PROMPTS:
        r = await stub.Generate(build_request(prompt, max_new_tokens=NEW, method=method, k=k), timeout=60)
        assert r.text == generate(oracle, prompt, NEW)
        assert r.usage.draft_method == method
        assert r.usage.draft_tokens <= k * r.usage.verify_rounds     # no pass takes more than the request's k
    assert sent("sent") > before, "nothing was streamed"
    assert await wait_until_idle(streaming) == (0, 0)


@pytest.mark.service
async def test_prepared_continuations_are_taken_and_the_output_stays_the_targets(streaming, oracle):
    """The tiny draft is the target with noise: where it forks from the target, the target's token
    is often its second choice, so some verdicts take a prepared continuation."""
    hits = prepared("hit")
    stub = pb_grpc.GenerationServiceStub(streaming.channel)
    for prompt in PROMPTS * 2:
        r = await stub.Generate(build_request(prompt, max_new_tokens=64, method="model", k=8), timeout=60)
        assert r.text == generate(oracle, prompt, 64)
    assert prepared("hit") > hits, "no verdict took a prepared continuation"
    assert await wait_until_idle(streaming) == (0, 0)
    assert streaming.draft.drafting.branch_rows.free == 2, "a finished request kept its branch rows"


@pytest.mark.service
async def test_streamed_steps_that_agree_with_a_prompt_lookup_keep_the_output_the_targets(streaming, oracle):
    """--draft-lookup 4: a step, streamed or of a chain, takes every token of the lookup the draft
    agrees with."""
    drafter = streaming.draft.drafters["model"]
    drafter.lookup_tokens = 4
    try:
        for pipeline in (True, False):
            streaming.draft.drafting.pipeline = pipeline
            agreed = metrics.LOOKUP.labels("agreed")._value.get()
            stub = pb_grpc.GenerationServiceStub(streaming.channel)
            for prompt in PROMPTS:
                r = await stub.Generate(build_request(prompt, max_new_tokens=NEW, method="model", k=8), timeout=60)
                assert r.text == generate(oracle, prompt, NEW), pipeline
            assert metrics.LOOKUP.labels("agreed")._value.get() > agreed, f"no step took a lookup's token ({pipeline})"
    finally:
        drafter.lookup_tokens = 0
        streaming.draft.drafting.pipeline = True
    assert await wait_until_idle(streaming) == (0, 0)


@pytest.mark.service
async def test_concurrent_streamed_sessions_share_passes_and_stay_exact(streaming, oracle):
    stub = pb_grpc.GenerationServiceStub(streaming.channel)
    cases = [(p, m) for p in PROMPTS for m in ("model", "ngram")]
    out = await asyncio.gather(*(stub.Generate(build_request(p, max_new_tokens=NEW, method=m, k=6), timeout=60)
                                 for p, m in cases))
    for (prompt, _), r in zip(cases, out):
        assert r.text == generate(oracle, prompt, NEW)


@pytest.mark.service
async def test_sampled_requests_keep_their_seed_whether_or_not_the_worker_streams(stack):
    stub = pb_grpc.GenerationServiceStub(stack.channel)
    req = build_request("def add(a, b):", max_new_tokens=24, temperature=1.3, top_p=0.95, seed=7, method="model", k=4)
    texts = []
    for pipeline in (False, True):
        stack.draft.drafting.pipeline = pipeline
        try:
            texts.append((await stub.Generate(req, timeout=60)).text)
        finally:
            stack.draft.drafting.pipeline = False
    assert texts[0] == texts[1]


@pytest.mark.service
async def test_a_sampled_session_cannot_stream(stack):
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        call = ipb_grpc.VerifyServiceStub(ch).Verify()
        await call.write(ipb.VerifyRequest(open=ipb.OpenSession(
            session_id="", prompt_ids=[1, 2, 3], stream=True,
            sampling=ipb.WorkerSampling(temperature=1.0, top_p=1.0, max_new_tokens=4))))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream needs a greedy session" in e.value.details()


@pytest.mark.service
async def test_a_streamed_session_ends_in_order_while_the_draft_side_still_writes(stack):
    """The draft worker may be writing a piece as the last verdict goes out. The verify worker ends
    the stream only once the draft side has closed its side, so such a write never fails the call
    (gRPC would fail it as INTERNAL, the last verdict unread): the last verdict arrives and the call
    ends OK, every time. (Ending it at once failed here within a few sessions.)"""
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        for i in range(30):
            call = ipb_grpc.VerifyServiceStub(ch).Verify()
            await call.write(ipb.VerifyRequest(open=ipb.OpenSession(
                session_id=f"ordered-{i}", prompt_ids=[1, 2, 3], stream=True,
                sampling=ipb.WorkerSampling(top_p=1.0, max_new_tokens=3))))

            done = asyncio.Event()

            async def pauses():          # a draft side with nothing to propose, saying so again and again
                while not done.is_set():
                    await call.write(ipb.VerifyRequest(proposal=ipb.Proposal(start=0)))
                    await asyncio.sleep(0)

            writer = asyncio.create_task(pauses())
            try:
                stop = 0
                while not stop:
                    msg = await call.read()
                    assert msg is not grpc.aio.EOF
                    stop = msg.verdict.stop_reason if msg.HasField("verdict") else 0
            finally:
                done.set()               # as the draft worker stops drafting: the write under way ends
                written = (await asyncio.gather(writer, return_exceptions=True))[0]
            assert written is None, (i, written)
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK, (i, await call.details())

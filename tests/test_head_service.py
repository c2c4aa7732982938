"""Draft method "head" through the whole service in this process: the verify worker drafts with an
untrained head beside a tiny target, and the output must be the target's own, on both faces."""

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from fmaas import generation_pb2 as fpb
from tandem.speculation.sampling import SamplingParams
from tandem.testing import build_random_head
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.local import reference
from tests.stack import start_stack, stop_stack, wait_until_idle

pytestmark = pytest.mark.service

PROMPTS = ["def add(a, b):", "The quick brown fox", "x"]
HEAD_MD = (("x-tandem-draft-method", "head"),)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def head_stack(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    head = build_random_head(tmp_path_factory.mktemp("head") / "head.safetensors", target)
    s = await start_stack(target, draft, head=head)
    yield s
    await stop_stack(s)


def request(prompt: str, method=pb.DRAFT_METHOD_HEAD, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParameters(**sampling),
                              speculation=pb.SpeculationOptions(method=method))


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_head_equals_the_target_alone(head_stack, tiny_pair, tiny_models, prompt):
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    expected = tok.decode(reference(tiny_models[0], tok(prompt).input_ids, SamplingParams(max_new_tokens=48)),
                          skip_special_tokens=True)
    r = await head_stack.tandem.Generate(request(prompt, max_new_tokens=48), timeout=60)
    assert r.text == expected
    assert r.usage.draft_method == "head"
    assert r.usage.draft_tokens > 0 and r.usage.verify_rounds > 0
    assert r.usage.accepted_tokens <= r.usage.draft_tokens
    assert await wait_until_idle(head_stack) == (0, 0)


@pytest.mark.asyncio(loop_scope="module")
async def test_num_speculative_tokens_caps_the_heads_rounds(head_stack):
    prompt = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\n"      # the head's prompt lookup proposes far
    free = await head_stack.tandem.Generate(request(prompt, max_new_tokens=48), timeout=60)
    capped = request(prompt, max_new_tokens=48)
    capped.speculation.num_speculative_tokens = 1
    one = await head_stack.tandem.Generate(capped, timeout=60)
    assert free.usage.draft_tokens > free.usage.verify_rounds        # some round proposed more than one
    assert 0 < one.usage.draft_tokens <= one.usage.verify_rounds     # none does under the cap
    assert one.text == free.text


@pytest.mark.asyncio(loop_scope="module")
async def test_head_rounds_are_counted_under_method_head(head_stack):
    from prometheus_client import REGISTRY

    def count(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"method": "head"}) or 0.0
    names = ("tandem_spec_decode_num_draft_tokens_total", "tandem_spec_decode_num_accepted_tokens_total")
    before = [count(n) for n in names]
    r = await head_stack.tandem.Generate(request("for i in range(10):", max_new_tokens=24), timeout=60)
    after = [count(n) for n in names]
    assert after[0] - before[0] == r.usage.draft_tokens > 0
    assert after[1] - before[1] == r.usage.accepted_tokens


@pytest.mark.asyncio(loop_scope="module")
async def test_tgis_face_serves_the_head(head_stack):
    text = "def add(a, b):"
    plain = await head_stack.tgis.Generate(fpb.BatchedGenerationRequest(
        requests=[fpb.GenerationRequest(text=text)], params=fpb.Parameters(stopping=fpb.StoppingCriteria(max_new_tokens=32))),
        metadata=(("x-tandem-draft-method", "none"),), timeout=60)
    head = await head_stack.tgis.Generate(fpb.BatchedGenerationRequest(
        requests=[fpb.GenerationRequest(text=text)], params=fpb.Parameters(stopping=fpb.StoppingCriteria(max_new_tokens=32))),
        metadata=HEAD_MD, timeout=60)
    assert head.responses[0].text == plain.responses[0].text
    assert head.responses[0].generated_token_count == plain.responses[0].generated_token_count == 32


@pytest.mark.asyncio(loop_scope="module")
async def test_head_reports_the_same_logprobs_and_keeps_penalties(head_stack):
    """Per-token reports come from the target, whatever drafted; penalties apply as with "none"."""
    opts = pb.LogprobOptions(logprobs=True, top_logprobs=3)
    outs = []
    for method in (pb.DRAFT_METHOD_HEAD, pb.DRAFT_METHOD_NONE):
        req = request("def add(a, b):", method, max_new_tokens=24, repetition_penalty=1.3, presence_penalty=0.5)
        req.logprobs.CopyFrom(opts)
        outs.append(await head_stack.tandem.Generate(req, timeout=60))
    head, plain = outs
    assert head.text == plain.text
    assert [t.token_id for t in head.tokens] == [t.token_id for t in plain.tokens]
    assert [t.rank for t in head.tokens] == [t.rank for t in plain.tokens]
    assert [round(t.logprob, 4) for t in head.tokens] == [round(t.logprob, 4) for t in plain.tokens]


@pytest.mark.asyncio(loop_scope="module")
async def test_sampled_head_is_reproducible_by_seed(head_stack):
    req = request("The quick brown fox", max_new_tokens=32, temperature=0.9, top_k=20, seed=11)
    a = await head_stack.tandem.Generate(req, timeout=60)
    b = await head_stack.tandem.Generate(req, timeout=60)
    assert a.text == b.text and a.usage.generated_tokens == b.usage.generated_tokens
    assert a.usage.draft_method == "head"


@pytest.mark.asyncio(loop_scope="module")
async def test_guided_head_output_matches_the_guide(head_stack):
    req = request("Answer:", max_new_tokens=40)
    req.guided.choice.choices.extend(["yes", "no", "maybe"])
    r = await head_stack.tandem.Generate(req, timeout=60)
    assert r.text in ("yes", "no", "maybe")
    assert r.finish_reason == pb.FINISH_REASON_GUIDE_COMPLETE


@pytest.mark.asyncio(loop_scope="module")
async def test_a_worker_without_a_head_refuses_it_and_a_bad_method_is_invalid(head_stack, tiny_pair):
    # The in-process stack's static router sends "head" to its verify worker; one without a head says so.
    plain = await start_stack(*tiny_pair)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.tandem.Generate(request("x", max_new_tokens=4), timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no trained head" in e.value.details()
    finally:
        await stop_stack(plain)
    async with grpc.aio.insecure_channel(head_stack.verify_address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in ipb_grpc.VerifyServiceStub(ch).Decode(
                    ipb.DecodeRequest(session_id="s", prompt_ids=[1, 2], method="eagle"), timeout=10):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'eagle'" in e.value.details()

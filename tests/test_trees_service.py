"""Trees of candidates over real gRPC: the in-process draft worker with --tree-branches 2 sends
trees (Proposal.parents) that the verify worker judges in one pass; the gateway's output is the
target alone's, and the draft worker counts rounds whose verdict went through a branch."""

import pytest
from prometheus_client import REGISTRY
from transformers import AutoTokenizer

from tandem.client import build_request
from tandem.speculation.sampling import SamplingParams
from tests.local import reference
from tests.stack import stack  # noqa: F401  (the fixture)

pytestmark = pytest.mark.service

PROMPTS = ["def add(a, b):", "for i in range(10):\n", "the cat sat. the cat ran. the dog sat. the dog"]


def tree_rounds(path: str) -> float:
    return REGISTRY.get_sample_value("tandem_draft_tree_rounds_total", {"path": path}) or 0.0


@pytest.mark.parametrize("method", ["model", "ngram"])
async def test_trees_through_the_service_equal_the_target_alone(stack, tiny_models, tiny_pair, monkeypatch, method):
    monkeypatch.setattr(stack.draft.drafting, "tree_branches", 2)
    monkeypatch.setattr(stack.draft.drafting, "adaptive_k", False)     # speculate every round
    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    before = tree_rounds("line") + tree_rounds("branch"), tree_rounds("branch")
    for prompt in PROMPTS:
        reply = await stack.tandem.Generate(build_request(prompt, max_new_tokens=40, method=method, k=8), timeout=60)
        expected = reference(tiny_models[0], tok(prompt).input_ids, SamplingParams(max_new_tokens=40))
        assert reply.text == tok.decode(expected, skip_special_tokens=True), prompt
    assert tree_rounds("line") + tree_rounds("branch") > before[0]
    if method == "model":
        assert tree_rounds("branch") > before[1]      # the noisy draft's second choices were taken


async def test_the_verify_worker_refuses_a_bad_tree_with_a_clear_error(stack):
    import grpc

    from tandem.v1 import internal_pb2 as ipb
    from tandem.v1 import internal_pb2_grpc as ipb_grpc
    async with grpc.aio.insecure_channel(stack.verify_address) as ch:
        call = ipb_grpc.VerifyServiceStub(ch).Verify()
        await call.write(ipb.VerifyRequest(open=ipb.OpenSession(session_id="bad-tree", prompt_ids=[5, 6, 7],
                                                                sampling=ipb.WorkerSampling(max_new_tokens=8))))
        assert (await call.read()).WhichOneof("kind") == "opened"
        await call.write(ipb.VerifyRequest(proposal=ipb.Proposal(token_ids=[9, 9], parents=[-1, -1])))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "siblings" in e.value.details()

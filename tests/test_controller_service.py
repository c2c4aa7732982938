"""The speculation controller inside the in-process draft worker, over real gRPC (the controller
alone: tests/test_controller.py)."""

import pytest
from transformers import AutoTokenizer

from tandem.client import build_request
from tandem.speculation.sampling import SamplingParams
from tests.local import reference
from tests.stack import stack  # noqa: F401  (the fixture)

pytestmark = pytest.mark.service


async def test_a_losing_draft_decodes_in_plain_runs_through_the_service(stack, tiny_models, tiny_pair):
    """Through real gRPC: when plain rounds measure faster (the worker claims a 1 µs plain pass), the
    draft worker backs off and asks for its plain rounds as runs; the output stays the target's."""
    model, draft = stack.verify.engine.model, stack.draft
    runs, send = [], draft._verify_round

    async def spy(call, context, proposal, run=1):
        runs.append(run)
        return await send(call, context, proposal, run)
    prompt = "def add(a, b):"
    model.forward_ms, draft._verify_round = [0.001], spy
    try:
        reply = await stack.tandem.Generate(build_request(prompt, max_new_tokens=40, method="model", k=4), timeout=60)
    finally:
        model.forward_ms, draft._verify_round = [], send
    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    expected = reference(tiny_models[0], tok(prompt).input_ids, SamplingParams(max_new_tokens=40))
    assert reply.text == tok.decode(expected, skip_special_tokens=True)
    assert max(runs) >= 4 and sum(runs) <= 40       # runs of plain rounds, each asked for once

"""The speculation controller inside the in-process draft worker, over real gRPC (the controller
alone: tests/test_controller.py)."""

import pytest
from transformers import AutoTokenizer

from draft_worker.speculation import Speculation
from tandem.client import build_request
from tandem.speculation.sampling import SamplingParams
from tests.local import reference
from tests.stack import stack  # noqa: F401  (the fixture)

pytestmark = pytest.mark.service


async def test_a_losing_draft_decodes_in_plain_runs_through_the_service(stack, tiny_models, tiny_pair, monkeypatch):
    """Through real gRPC: when plain rounds measure faster (the worker claims a 1 µs plain pass), the
    draft worker backs off and asks for its plain rounds as runs; the output stays the target's."""
    model = stack.verify.engine.model
    runs, send = [], Speculation._send

    async def spy(self, proposal, run=1):
        runs.append(run)
        return await send(self, proposal, run)
    prompt = "def add(a, b):"
    monkeypatch.setattr(Speculation, "_send", spy)
    monkeypatch.setattr(model, "forward_ms", [0.001])
    reply = await stack.tandem.Generate(build_request(prompt, max_new_tokens=40, method="model", k=4), timeout=60)
    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    expected = reference(tiny_models[0], tok(prompt).input_ids, SamplingParams(max_new_tokens=40))
    assert reply.text == tok.decode(expected, skip_special_tokens=True)
    assert max(runs) >= 4 and sum(runs) <= 40       # runs of plain rounds, each asked for once

"""One rule for the KV a session needs (tandem.engine.kvpool.kv_need), used alike by the gateway
that routes and reserves, the verify worker that admits, and the draft worker that sizes its cache."""

import pytest

from gateway.routing import RedisRouter
from tandem.cluster.registry import VERIFY, Registry, WorkerInfo
from tandem.engine.kvpool import kv_need, proposal_room
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2 as pb
from tests.stack import stack  # noqa: F401  (the fixture)

P, N, CONTEXT = 30, 50, 512


@pytest.mark.service
async def test_the_gateway_reserves_what_the_verify_worker_does(stack):
    """While a stream runs, the gateway's in-flight reservation on its verify worker equals what
    that worker reserved for the session (the gateway once left out the proposal room)."""
    req = pb.GenerateRequest(prompt="def add(a, b):", sampling=pb.SamplingParameters(max_new_tokens=40),
                             speculation=pb.SpeculationOptions(method=pb.DRAFT_METHOD_MODEL, num_speculative_tokens=3))
    call = stack.tandem.GenerateStream(req, timeout=60)
    async for _ in call:
        break
    worker = sum(stack.verify.keeper.live.values())
    gateway = stack.core.router.reserved[stack.verify_address]
    call.cancel()
    assert worker == stack.verify.engine.capacity(len(stack.core.encode_prompt(req.prompt)), SamplingParams(max_new_tokens=40))
    assert gateway == worker


@pytest.mark.system
async def test_routing_counts_the_room_of_each_reservation(redis_client):
    """A worker with room for one session, room included, takes one; the second goes elsewhere."""
    room = proposal_room(16)
    one = kv_need(P, N, room, CONTEXT)
    reg = Registry(redis_client)
    await reg.register(WorkerInfo("tight:1", VERIFY, "m", capacity=1000, kv_free=2 * (P + N) + room,
                                  kv_margin=room), ttl=5)
    await reg.register(WorkerInfo("roomy:1", VERIFY, "m", capacity=1000, kv_free=1000, load=5, kv_margin=room), ttl=5)
    router = RedisRouter(reg, "m", "redis://test")
    need = lambda r: kv_need(P, N, r, CONTEXT)   # noqa: E731
    first = await router.route("none", need=need)
    assert (first.verify, first.kv) == ("tight:1", one)          # least loaded with room
    router.hold(first)
    second = await router.route("none", need=need)
    assert second.verify == "roomy:1"                            # tight:1 has 2(P+N)+room-one < one left
    router.release(first)
    assert router.reserved["tight:1"] == 0 and router.inflight["tight:1"] == 0


@pytest.mark.unit
def test_the_draft_sizes_its_cache_by_the_same_rule(tiny_models):
    from draft_worker.model import ModelDrafter
    _, draft = tiny_models
    state = ModelDrafter(draft).start(SamplingParams(max_new_tokens=N), draft.eos_ids, P, proposal_room(5))
    try:
        assert state.cache.capacity == kv_need(P, N, proposal_room(5), draft.max_context)
    finally:
        state.close()

"""The whole Tandem stack inside the test process: verify worker, draft worker and gateway (both
public faces) as aio gRPC servers on free loopback ports, over tiny seeded models.

Faster to start than processes and lets a test look at the servicers' state. Use it with
`from tests.stack import stack` in a test module (the import makes the fixture visible), or call
start_stack / stop_stack directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest_asyncio

from draft_worker.drafters import NgramDrafter
from draft_worker.model import ModelDrafter
from draft_worker.service import DraftServicer
from fmaas import generation_pb2_grpc as fmaas_grpc
from gateway.core import GenerationCore
from gateway.request import Limits
from gateway.routing import StaticRouter
from gateway.faces import add_faces
from gateway.observe import export_load
from gateway.vllm import ModelFacts
from tandem.engine.batcher import Batcher
from tandem.engine.modeling import CausalLM, load_tokenizer
from tandem.engine.thread import InferenceThread
from tandem.service import logs, metrics, telemetry
from tandem.service.interceptors import MalformedRequestInterceptor
from tandem.service.server import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, SERVER_OPTIONS, message_options
from tandem.speculation.grammar import Grammars
from tandem.v1 import generation_pb2_grpc as tandem_grpc
from tandem.v1 import internal_pb2 as internal_pb
from tandem.v1 import internal_pb2_grpc as internal_grpc
from tandem.head.checkpoint import load_drafter
from verify_worker.engine import VerifyEngine
from verify_worker.headspec import HeadSpeculation
from verify_worker.kvstore import SessionKeeper
from verify_worker.service import VerifyServicer
from vllm_engine import vllm_engine_pb2_grpc as vllm_grpc


@dataclass
class InProcessStack:
    gateway_address: str
    verify_address: str
    draft_address: str
    core: GenerationCore
    limits: Limits
    verify: VerifyServicer
    draft: DraftServicer
    channel: grpc.aio.Channel                    # to the gateway
    _servers: list[grpc.aio.Server] = field(default_factory=list)
    _threads: list[InferenceThread] = field(default_factory=list)

    @property
    def tandem(self) -> tandem_grpc.GenerationServiceStub:
        return tandem_grpc.GenerationServiceStub(self.channel)

    @property
    def tgis(self) -> fmaas_grpc.GenerationServiceStub:
        return fmaas_grpc.GenerationServiceStub(self.channel)

    @property
    def vllm(self) -> vllm_grpc.VllmEngineStub:
        return vllm_grpc.VllmEngineStub(self.channel)


async def live_sessions(stack: InProcessStack) -> tuple[int, int]:
    """(verify, draft) sessions the workers hold, through their Status RPC."""
    out = []
    for stub_cls, address in ((internal_grpc.VerifyServiceStub, stack.verify_address),
                              (internal_grpc.DraftServiceStub, stack.draft_address)):
        async with grpc.aio.insecure_channel(address) as ch:
            out.append((await stub_cls(ch).Status(internal_pb.StatusRequest(), timeout=10)).live_sessions)
    return out[0], out[1]


async def wait_until_idle(stack: InProcessStack, timeout: float = 5.0) -> tuple[int, int]:
    """Waits for both workers to hold no session; returns the last counts seen."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        counts = await live_sessions(stack)
        if counts == (0, 0) or loop.time() > end:
            return counts
        await asyncio.sleep(0.05)


async def _serve(add, entry: bool = False, guard=None, max_message_bytes: int = MAX_MESSAGE_BYTES
                 ) -> tuple[grpc.aio.Server, str]:
    # The services' own interceptors, in their order (tandem.service.server.Service): the gateway's guard,
    # malformed requests, tracing (when a test turned it on) and request ids.
    interceptors = [*([guard] if guard else []), MalformedRequestInterceptor(),
                    *telemetry.server_interceptors(), logs.RequestIdInterceptor(generate=entry)]
    server = grpc.aio.server(options=message_options(max_message_bytes) + SERVER_OPTIONS, interceptors=interceptors)
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")     # 0: the OS picks a free port
    await server.start()
    return server, f"127.0.0.1:{port}"


def grammars_for(folder: Path | str, model: CausalLM) -> Grammars:
    """What the worker's __main__ builds: guides compiled for the model's tokenizer and width."""
    return Grammars(load_tokenizer(str(folder)), model.vocab_size, model.eos_ids)


async def start_stack(target: Path | str, draft: Path | str, limits: Limits | None = None, guard=None,
                      max_message_bytes: int = MAX_MESSAGE_BYTES, head: Path | str | None = None) -> InProcessStack:
    """guard, max_message_bytes: the gateway's (gateway.guard.ClientGuard, --max-message-bytes).
    head: a head file the verify worker drafts with for draft method "head" (its --head)."""
    limits = limits or Limits()
    metrics.register(*metrics.SERVICES)       # all three services share this process's registry
    target_model, draft_model = CausalLM(str(target)), CausalLM(str(draft))
    v_thread, d_thread = InferenceThread("v"), InferenceThread("d")
    engine = VerifyEngine(target_model)
    spec = HeadSpeculation(load_drafter(str(head), target_model, str(target)), engine) if head else None
    verify = VerifyServicer(engine, Batcher(target_model, v_thread, taps=spec.taps if spec else ()),
                            SessionKeeper(target_model.pool.slots), grammars=grammars_for(target, target_model),
                            drafting=[spec] if spec else ())
    v_server, v_addr = await _serve(lambda s: internal_grpc.add_VerifyServiceServicer_to_server(verify, s))
    draft_servicer = DraftServicer({"ngram": NgramDrafter(), "model": ModelDrafter(draft_model)},
                                   draft_model.eos_ids, draft_model.vocab_size, d_thread,
                                   batcher=Batcher(draft_model, d_thread), grammars=grammars_for(draft, draft_model))
    d_server, d_addr = await _serve(lambda s: internal_grpc.add_DraftServiceServicer_to_server(draft_servicer, s))
    from transformers import AutoConfig, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    core = GenerationCore(tokenizer, str(target), target_model.max_context, StaticRouter([v_addr], [d_addr]))
    facts = ModelFacts.read(str(target), Path(target), AutoConfig.from_pretrained(str(target)), tokenizer)
    export_load(core.router.kv_snapshot)

    def add_gateway(server: grpc.aio.Server) -> None:
        add_faces(server, core, limits, facts)

    g_server, g_addr = await _serve(add_gateway, entry=True, guard=guard, max_message_bytes=max_message_bytes)
    return InProcessStack(g_addr, v_addr, d_addr, core, limits, verify, draft_servicer,
                          grpc.aio.insecure_channel(g_addr, options=CHANNEL_OPTIONS),
                          [g_server, d_server, v_server], [v_thread, d_thread])


async def stop_stack(stack: InProcessStack) -> None:
    await stack.channel.close()
    for server in stack._servers:               # gateway first, so nothing new reaches the workers
        await server.stop(None)
    await stack.core.router.close()
    for thread in stack._threads:
        thread.shutdown()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def stack(tiny_pair):
    target, draft = tiny_pair
    s = await start_stack(target, draft)
    yield s
    await stop_stack(s)

"""DraftService: runs the speculation loop of each request (draft_worker.speculation) against its
verify worker, and relays that worker's errors marked as its own."""

from __future__ import annotations

import asyncio
import logging

import grpc

from draft_worker.drafters import Drafter
from draft_worker.links import Links
from draft_worker.speculation import JUMP_FORWARD, Drafting, Speculation, VerifyClosed
from draft_worker.streamed import BranchRows
from tandem.engine.batcher import Batcher
from tandem.engine.thread import InferenceThread
from tandem.service import logs, metrics, wire
from tandem.speculation.grammar import Grammars
from tandem.speculation.sampling import SamplingError
from tandem.speculation.survival import Survival
from tandem.v1 import internal_pb2 as pb
from tandem.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, drafters: dict[str, Drafter], eos_ids: list[int], vocab_size: int | None,
                 inference: InferenceThread, adaptive_k: bool = True, batcher: Batcher | None = None,
                 pipeline: bool = False, grammars: Grammars | None = None, compile_timeout: float = 10.0,
                 jump_forward: bool = True, prepare: bool = True, routes: dict[str, str] | None = None,
                 link_timeout: float = 1.0, tree_branches: int = 0) -> None:
        """routes: the address to dial for a verify worker's registered one, where they differ.
        link_timeout: how long a request waits for a connection to its verify worker."""
        self.drafters = drafters
        self.drafting = Drafting(inference, batcher, pipeline, adaptive_k, eos_ids, vocab_size, grammars,
                                 compile_timeout, jump_forward, BranchRows() if prepare else None, tree_branches)
        self.links = Links(routes, link_timeout)
        # by (method, verify worker), then kind of proposal: acceptance by position over recent
        # sessions, a new session's prior
        self._acceptance: dict[tuple[str, str], dict[object, Survival]] = {}
        self.sessions: dict[int, Speculation] = {}     # by stream, while the stream lives
        metrics.gauge_from(metrics.DRAFT_RUNNING, lambda: len(self.sessions))
        metrics.declare_methods([*drafters, JUMP_FORWARD])

    async def close(self) -> None:
        await self.links.close()

    async def Generate(self, request: pb.DraftGenerateRequest, context: grpc.aio.ServicerContext):
        drafter = self.drafters.get(request.method)
        if drafter is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"draft method {request.method!r} is not served by this worker "
                                f"(serves: {', '.join(sorted(self.drafters))})")
        if not request.verify_address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "verify_address is required")
        logs.session_id.set(request.session_id)
        try:
            params = wire.check_params(wire.params_from_proto(request.sampling))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stub = await self.links.stub(request.verify_address)
        if stub is None:
            metrics.LINK_EVENTS.labels("unreachable").inc()
            log.warning("no connection to verify worker %s within %.1fs", request.verify_address, self.links.timeout)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"verify worker: no connection within {self.links.timeout:g}s",
                                trailing_metadata=wire.FAILED_VERIFY)
        call = stub.Verify(timeout=context.time_remaining(), metadata=logs.outgoing_metadata())
        spec = self.sessions[id(context)] = Speculation(self.drafting, drafter, request, params, call)
        try:
            try:
                await spec.open(self._acceptance.setdefault((drafter.name, request.verify_address), {}))
            except ValueError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            async for chunk in spec.chunks():
                yield chunk
            log.info("speculation finished", extra={"fields": {
                "method": drafter.name, "rounds": spec.rounds, "draft_tokens": spec.drafted,
                "accepted_tokens": spec.accepted, "generated_tokens": len(spec.tokens) - len(spec.prompt),
                "verify_worker": request.verify_address}})
            await spec.finish()
        except grpc.aio.AioRpcError as e:
            # Marked, so the gateway moves the session off that verify worker (or, when the worker
            # itself still answers it, decodes on there without speculation), not off this one.
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                metrics.LINK_EVENTS.labels("lost").inc()
                self.links.down(request.verify_address)
            await self._relay(context, request.verify_address, e.code(), e.details())
        except VerifyClosed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e), trailing_metadata=wire.FAILED_VERIFY)
        except SamplingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except asyncio.InvalidStateError:
            # The verify stream ended (its worker died or stopped) while a proposal was being written.
            code = await call.code()
            await self._relay(context, request.verify_address,
                              grpc.StatusCode.UNAVAILABLE if code == grpc.StatusCode.OK else code, await call.details())
        finally:
            self.sessions.pop(id(context), None)
            await spec.close()

    @staticmethod
    async def _relay(context, address: str, code: grpc.StatusCode, details: str) -> None:
        """Ends the request with the verify worker's error, marked as the verify worker's. Its
        address goes to the log, not into the message, which may reach a client. A deliberate
        answer (a bad request, no room) passes on word for word, as it reads without speculation;
        a failure says where it happened."""
        if code in wire.ANSWERS:
            await context.abort(code, details, trailing_metadata=wire.FAILED_VERIFY)
        log.warning("verify worker %s: %s: %s", address, code.name, details)
        await context.abort(code, f"verify worker: {details}", trailing_metadata=wire.FAILED_VERIFY)

    async def Status(self, request, context) -> pb.WorkerStatus:
        kv = sum(s.state.kv_bytes() for s in list(self.sessions.values()) if s.state is not None)
        return pb.WorkerStatus(model=",".join(sorted(self.drafters)), live_sessions=len(self.sessions),
                               kv_bytes=kv)


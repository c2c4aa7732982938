"""VerifyService: a thin adapter from gRPC streams to the VerifyEngine."""

from __future__ import annotations

import logging

import grpc

from tandem import wire
from tandem.server import InferenceThread
from tandem.v1 import internal_pb2 as pb
from tandem.v1 import internal_pb2_grpc as pb_grpc
from verify_worker.engine import STOP_NONE, ProtocolError, TargetSession, VerifyEngine

log = logging.getLogger(__name__)


class VerifyServicer(pb_grpc.VerifyServiceServicer):
    def __init__(self, engine: VerifyEngine, inference: InferenceThread) -> None:
        self.engine = engine
        self.inference = inference
        self.sessions: dict[int, TargetSession] = {}    # by stream, while the stream lives

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        session = None
        try:
            async for req in request_iterator:
                kind = req.WhichOneof("kind")
                if kind == "open":
                    if session is not None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            "session already open on this stream")
                    session = await self._call(context, self.engine.open, req.open.session_id,
                                               list(req.open.prompt_ids), wire.params_from_proto(req.open.sampling))
                    self.sessions[id(context)] = session
                    yield pb.VerifyResponse(opened=pb.Opened(
                        cached_tokens=session.cache.length, vocab_size=self.engine.model.vocab_size,
                        max_proposal=self.engine.max_proposal, max_context=self.engine.model.max_context))
                elif kind == "proposal":
                    if session is None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                            "proposal before the session was opened")
                    tokens = list(req.proposal.token_ids)
                    try:
                        q = wire.dense_draft_probs(req.proposal.distributions, len(tokens),
                                                   self.engine.model.vocab_size)
                    except ValueError as e:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                    if session.params.greedy:
                        q = None     # greedy verification needs no draft distributions
                    verdict = await self._call(context, self.engine.verify, session, tokens, q)
                    yield pb.VerifyResponse(verdict=pb.Verdict(
                        accepted=verdict.accepted, token_ids=verdict.token_ids, stop_reason=verdict.stop_reason))
                    if verdict.stop_reason != STOP_NONE:
                        return
                else:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty VerifyRequest")
        finally:
            self.sessions.pop(id(context), None)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        try:
            session = await self._call(context, self.engine.open, request.session_id,
                                       list(request.prompt_ids), wire.params_from_proto(request.sampling))
            self.sessions[id(context)] = session
            while True:
                verdict = await self._call(context, self.engine.decode, session)
                yield pb.TokenChunk(token_ids=verdict.token_ids, stop_reason=verdict.stop_reason)
                if verdict.stop_reason != STOP_NONE:
                    return
        finally:
            self.sessions.pop(id(context), None)

    async def Status(self, request, context) -> pb.WorkerStatus:
        return pb.WorkerStatus(model=self.engine.model.name, live_sessions=len(self.sessions),
                               kv_bytes=sum(s.cache.nbytes() for s in self.sessions.values()))

    async def _call(self, context, fn, *args):
        try:
            return await self.inference.run(fn, *args)
        except ProtocolError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

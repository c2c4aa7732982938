"""fmaas.GenerationService (the TGIS API): protobuf in, GenRequest to the core, protobuf out.

Unmodified TGIS clients talk to Tandem through this face. The TGIS wire format has no place for
Tandem's speculation knobs, so those arrive as request metadata (x-tandem-*). TGIS features
Tandem does not implement (prefix_id, adapter_id) are refused with
INVALID_ARGUMENT naming the field, never silently ignored: a client asking for them would
otherwise get output it did not ask for.

Longer than 300 lines because the face is one conversion: validating TGIS's Parameters, running
a batch or a stream, and building its responses share the one _Job they all read.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, replace
from typing import AsyncIterator

import grpc

from fmaas import generation_pb2 as pb
from fmaas import generation_pb2_grpc as pb_grpc
from gateway.core import GenerationCore
from gateway.events import Delta, Final, GatewayError, TokenReport, Usage, answers
from gateway.observe import OP_TEXT
from gateway.request import (GenRequest, InvalidRequest, Limits, check_guide, check_guided, check_processing, check_reports,
                             check_sampling, speculation_metadata, truncate)
from tandem.speculation.finish import Finish

log = logging.getLogger(__name__)


_STOP_REASON = {Finish.LENGTH: pb.MAX_TOKENS, Finish.EOS: pb.EOS_TOKEN, Finish.STOP_SEQUENCE: pb.STOP_SEQUENCE,
                Finish.CONTEXT_LENGTH: pb.TOKEN_LIMIT, Finish.TIME_LIMIT: pb.TIME_LIMIT,
                # TGIS has no reason of its own for it: the model could only have ended there
                Finish.GUIDE: pb.EOS_TOKEN, Finish.STOP_TOKEN: pb.STOP_SEQUENCE}
def _tgis_path(name: str) -> str:
    """Where check_processing's fields live in TGIS's Parameters."""
    return ("params.sampling." if name == "typical_p" else "params.decoding.") + name


def _unsupported(field: str) -> InvalidRequest:
    return InvalidRequest(f"{field} is not supported by Tandem")


@dataclass(frozen=True)
class _Job:
    """One prompt of a TGIS request, validated, plus the TGIS-only options the core never sees."""
    req: GenRequest
    text: str                  # the input text, echoed when response.input_text is set
    echo_input: bool
    seed: int                  # reported back; 0 under greedy (TGIS reports seeds only for sampling)
    time_limit_s: float | None
    response: pb.ResponseOptions

    def token_infos(self, reports: list[TokenReport]) -> list[pb.TokenInfo]:
        """TokenInfos carrying what ResponseOptions asked for. The first prompt token has nothing
        before it: its logprob is NaN, its rank 0, as in TGIS."""
        r = self.response
        out = []
        for t in reports:
            info = pb.TokenInfo(text=t.text)
            if r.token_logprobs:
                info.logprob = math.nan if t.logprob is None else t.logprob
            if r.token_ranks:
                info.rank = t.rank
            for _, text, lp in t.top:
                info.top_tokens.add(text=text, logprob=lp)
            out.append(info)
        return out


class TgisServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, core: GenerationCore, limits: Limits) -> None:
        self.core = core
        self.limits = limits

    # ---- conversion at the edge ----

    def _check_model(self, model_id: str) -> None:
        # TGIS clients always send a model_id; empty is accepted for convenience.
        if model_id and model_id != self.core.model_name:
            raise InvalidRequest(f"model_id {model_id!r} is not served here; this server serves "
                                 f"{self.core.model_name!r}")

    @staticmethod
    def _check_unsupported(m: pb.SingleGenerationRequest | pb.BatchedGenerationRequest) -> None:
        if m.prefix_id:
            raise _unsupported("prefix_id")
        if m.adapter_id:
            raise _unsupported("adapter_id")

    def _guided(self, params, d: pb.DecodingParameters):
        """DecodingParameters.guided into params: format TEXT is unconstrained, JSON any JSON value."""
        kind = d.WhichOneof("guided")
        where = "params.decoding.{}".format
        if kind == "format":
            if d.format not in (pb.DecodingParameters.TEXT, pb.DecodingParameters.JSON):
                raise InvalidRequest(f"params.decoding.format {d.format} is not a known ResponseFormat")
            return check_guide(self.limits, params, "json" if d.format == pb.DecodingParameters.JSON else None)
        return check_guided(self.limits, params, d, kind, where)

    def _job(self, text: str, p: pb.Parameters, method: str, k: int, session_id: str) -> _Job:
        if len(text) > self.limits.max_prompt_chars:
            raise InvalidRequest(f"text is {len(text)} characters; the limit is {self.limits.max_prompt_chars}")
        ids = self.core.encode_prompt(text)
        try:
            ids = truncate(ids, p.truncate_input_tokens, self.core.max_context)
        except InvalidRequest as e:
            raise InvalidRequest(f"params.{e}") from None
        self.core.check_length(ids, self.limits.max_prompt_tokens)
        stopping = p.stopping
        stops = list(stopping.stop_sequences)
        typical_p = 0.0
        if p.method == pb.SAMPLE:
            s = p.sampling
            # TGIS reads temperature 0 under SAMPLE as "unset", i.e. 1.0, never as greedy.
            temperature, top_k, top_p, typical_p = (s.temperature or 1.0), s.top_k, s.top_p, s.typical_p
            seed = s.seed if s.HasField("seed") else None
        elif p.method == pb.GREEDY:
            # Under GREEDY TGIS ignores the sampling message entirely.
            temperature, top_k, top_p, seed = 0.0, 0, 0.0, 0
        else:
            raise InvalidRequest(f"unknown params.method value {p.method}")
        params = check_sampling(self.limits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_new_tokens=stopping.max_new_tokens,
                                min_new_tokens=stopping.min_new_tokens, stop_sequences=stops,
                                default_max_new_tokens=self.limits.tgis_default_max_new_tokens)
        d = p.decoding
        length = d.length_penalty
        params = check_processing(self.limits, params, typical_p=typical_p, repetition_penalty=d.repetition_penalty,
                                  length_penalty=((length.start_index, length.decay_factor)
                                                  if d.HasField("length_penalty") else None),
                                  where=_tgis_path)
        params = self._guided(params, d)
        r = p.response
        # TGIS reports details only of the tokens it returns: generated_tokens and input_tokens say
        # which; token_logprobs, token_ranks and top_n_tokens what each TokenInfo carries.
        scored = r.token_logprobs or r.token_ranks or r.top_n_tokens > 0
        params = check_reports(params, logprobs=r.generated_tokens and scored, top_logprobs=r.top_n_tokens,
                               prompt_logprobs=r.input_tokens and scored, field="params.response.top_n_tokens")
        if not (r.generated_tokens or r.input_tokens):
            params = replace(params, top_logprobs=0)          # no TokenInfo to carry them
        req = GenRequest(prompt_ids=ids, params=params, stop_sequences=stops,
                         include_stop_sequence=stopping.include_stop_sequence,   # unset = False
                         method=method, k=k, session_id=session_id,
                         token_details=r.generated_tokens, prompt_details=r.input_tokens)
        return _Job(req, text, r.input_text, params.seed if p.method == pb.SAMPLE else 0,
                    stopping.time_limit_millis / 1000 if stopping.time_limit_millis else None, r)

    # ---- generation ----

    async def _events(self, job: _Job, context: grpc.aio.ServicerContext) -> AsyncIterator[Delta | Final]:
        """The core's events; when the time limit runs out, a Final with what was produced so far.

        Only the wait for the next event is under the limit, so the limit never fires while the
        caller is busy with an event. Cancelling that wait closes the core's stream, which cancels
        the worker call and frees the worker."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + job.time_limit_s if job.time_limit_s is not None else None
        events = aiter(self.core.stream(job.req, context.time_remaining()))
        generated = 0
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    yield Final(Finish.TIME_LIMIT, Usage(prompt_tokens=len(job.req.prompt_ids),
                                                         generated_tokens=generated,
                                                         draft_method=job.req.method),
                                job.req.session_id)
                    return
                if isinstance(event, Delta):
                    generated += event.token_count
                yield event
                if isinstance(event, Final):
                    return
        finally:
            await events.aclose()     # a no-op when the core's stream has already ended

    async def _generate_one(self, job: _Job, context: grpc.aio.ServicerContext) -> pb.GenerationResponse:
        parts = [job.text] if job.echo_input else []
        count, final = 0, None
        tokens: list[pb.TokenInfo] = []
        input_tokens: list[pb.TokenInfo] = []
        with self.core.observer("tgis") as obs:
            obs.begin(job.req, OP_TEXT, [("user", job.text)])
            async for event in self._events(job, context):     # run to the end: the stream closes itself
                obs.saw(event)
                if isinstance(event, Delta):
                    parts.append(event.text)
                    count += event.token_count
                    tokens += job.token_infos(event.tokens)
                    if event.prompt_tokens is not None:
                        input_tokens = job.token_infos(event.prompt_tokens)
                else:
                    final = event
        if final is None:
            raise GatewayError(grpc.StatusCode.INTERNAL, "generation ended without a final event")
        return pb.GenerationResponse(text="".join(parts), generated_token_count=count,
                                     input_token_count=len(job.req.prompt_ids),
                                     stop_reason=_STOP_REASON[final.finish_reason],
                                     stop_sequence=final.stop_sequence, seed=job.seed,
                                     tokens=tokens, input_tokens=input_tokens)

    @answers
    async def Generate(self, request: pb.BatchedGenerationRequest,
                       context: grpc.aio.ServicerContext) -> pb.BatchedGenerationResponse:
        with self.core.observer("tgis"):      # counts the batch once if it is refused; jobs count themselves
            self._check_model(request.model_id)
            self._check_unsupported(request)
            if not request.requests:
                raise InvalidRequest("requests must not be empty")
            method, k, session_id = speculation_metadata(self.limits, context.invocation_metadata(), len(request.requests))
            # Validate every prompt before starting any: a bad one fails the batch at no cost.
            jobs = []
            for i, r in enumerate(request.requests):
                try:
                    jobs.append(self._job(r.text, request.params, method, k, session_id))
                except InvalidRequest as e:
                    raise InvalidRequest(f"requests[{i}]: {e}") from None
        tasks = [asyncio.ensure_future(self._generate_one(j, context)) for j in jobs]
        try:
            responses = await asyncio.gather(*tasks)
        finally:
            for t in tasks:       # one failure fails the batch; stop the others' generation
                t.cancel()
        return pb.BatchedGenerationResponse(responses=responses)

    @answers
    async def GenerateStream(self, request: pb.SingleGenerationRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerationResponse]:
        with self.core.observer("tgis") as obs:
            self._check_model(request.model_id)
            self._check_unsupported(request)
            method, k, session_id = speculation_metadata(self.limits, context.invocation_metadata())
            job = self._job(request.request.text, request.params, method, k, session_id)
            obs.begin(job.req, OP_TEXT, [("user", job.text)])
            # TGIS sends the input details first, before any generated text; input token details
            # come with the verify worker's first answer, so that message waits for it.
            first = pb.GenerationResponse(input_token_count=len(job.req.prompt_ids),
                                          text=job.text if job.echo_input else "", seed=job.seed)
            if not job.req.prompt_details:
                yield first
                first = None
            count = 0
            async for event in self._events(job, context):
                obs.saw(event)
                if first is not None:
                    if isinstance(event, Delta) and event.prompt_tokens is not None:
                        first.input_tokens.extend(job.token_infos(event.prompt_tokens))
                    yield first
                    first = None
                if isinstance(event, Delta):
                    if event.text or event.token_count:
                        count += event.token_count
                        yield pb.GenerationResponse(text=event.text, generated_token_count=count,
                                                    tokens=job.token_infos(event.tokens))
                else:
                    # A message of its own: holding each delta back until the next one shows whether
                    # it is the last would delay every chunk by one verify round.
                    yield pb.GenerationResponse(generated_token_count=count,
                                                stop_reason=_STOP_REASON[event.finish_reason],
                                                stop_sequence=event.stop_sequence, seed=job.seed)

    # ---- tokenizer and model facts ----

    @answers
    async def Tokenize(self, request: pb.BatchedTokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.BatchedTokenizeResponse:
        self._check_model(request.model_id)
        tok = self.core.tokenizer
        if request.return_offsets and not getattr(tok, "is_fast", False):
            raise InvalidRequest("return_offsets needs a fast tokenizer; this model's is not")
        out = pb.BatchedTokenizeResponse()
        for r in request.requests:
            # The same encoding as encode_prompt, so token_count equals input_token_count.
            enc = tok(r.text, return_offsets_mapping=request.return_offsets)
            ids = list(enc.input_ids)
            offsets = list(enc.offset_mapping) if request.return_offsets else []
            n = request.truncate_input_tokens
            if 0 < n < len(ids):       # TGIS keeps the last n tokens
                ids, offsets = ids[-n:], offsets[-n:]
            resp = out.responses.add(token_count=len(ids))
            if request.return_tokens:
                resp.tokens.extend(tok.convert_ids_to_tokens(ids))
            for start, end in offsets:
                resp.offsets.add(start=start, end=end)
        return out

    @answers
    async def ModelInfo(self, request: pb.ModelInfoRequest,
                        context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        self._check_model(request.model_id)
        return pb.ModelInfoResponse(model_kind=pb.ModelInfoResponse.DECODER_ONLY,
                                    max_sequence_length=self.core.max_context,
                                    max_new_tokens=self.limits.max_new_tokens)


def add_tgis_service(server: grpc.aio.Server, core: GenerationCore, limits: Limits) -> None:
    pb_grpc.add_GenerationServiceServicer_to_server(TgisServicer(core, limits), server)

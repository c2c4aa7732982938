"""vllm.grpc.engine.VllmEngine (the protocol `vllm serve --grpc` speaks): protobuf in, GenRequest to
the core, protobuf out.

Routers that reach engines over this protocol (the Shepherd Model Gateway, llm-d's endpoint
picker) tokenize, render chat templates and detokenize themselves: a request arrives as token ids
and its answer goes back as token ids, with the counts and reports the router turns into an
OpenAI response. Tandem's speculation knobs arrive as request metadata, as on the TGIS face.

What Tandem does not do is refused with INVALID_ARGUMENT naming the field (n > 1, min_p,
logit_bias, ignore_eos, structural tags, media, KV transfer), never silently ignored; the
engine-management RPCs it has no part of (embeddings, cache flush, profiling, KV events) answer
UNIMPLEMENTED.

Longer than 300 lines because the face is one conversion: the request's fields, the two answer
shapes (streamed and whole), and the facts a router asks of an engine all read the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import grpc
from transformers import GenerationConfig

from gateway.core import GenerationCore
from gateway.events import Delta, Final, TokenReport, answers
from gateway.observe import LOAD, OP_TEXT
from gateway.routing import RoutingError
from gateway.request import (GenRequest, InvalidRequest, Limits, check_guide, check_guided, check_processing,
                             check_reports, check_sampling, speculation_metadata, truncate)
from tandem.engine.modeling import eos_ids
from tandem.speculation.finish import Finish
from vllm_engine import common_pb2
from vllm_engine import vllm_engine_pb2 as pb
from vllm_engine import vllm_engine_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name

# vLLM's finish reasons: "stop" (end of sequence, a stop string or stop token, a completed guide),
# "length" (max_tokens or the context window), "abort".
_FINISH = {Finish.LENGTH: "length", Finish.CONTEXT_LENGTH: "length", Finish.TIME_LIMIT: "length",
           Finish.EOS: "stop", Finish.GUIDE: "stop", Finish.STOP_SEQUENCE: "stop", Finish.STOP_TOKEN: "stop"}

# What a router fetches to build the tokenizer itself (GetTokenizer), when found in the model's folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.json",
                   "chat_template.jinja")
TOKENIZER_CHUNK = 64 * 1024


@dataclass(frozen=True)
class ModelFacts:
    """What GetModelInfo and GetTokenizer tell a router about the target."""
    name: str                       # the model as the gateway was started with it (--model)
    folder: Path                    # its Hugging Face folder (tokenizer files)
    vocab_size: int
    model_type: str
    architectures: tuple[str, ...]
    eos_ids: tuple[int, ...]
    bos_id: int
    pad_id: int

    @classmethod
    def read(cls, name: str, folder: Path, config, tokenizer) -> ModelFacts:
        generation = (GenerationConfig.from_pretrained(folder) if (folder / "generation_config.json").is_file()
                      else None)
        return cls(name, folder, int(config.vocab_size), str(config.model_type),
                   tuple(getattr(config, "architectures", None) or ()), tuple(eos_ids(generation, config)),
                   _id(tokenizer.bos_token_id), _id(tokenizer.pad_token_id))


def _id(token_id) -> int:
    return -1 if token_id is None else int(token_id)


def tokenizer_zip(folder: Path) -> tuple[bytes, str]:
    """The tokenizer files of `folder` as a ZIP archive, and its SHA-256 hex digest."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                zf.write(folder / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _top(r: TokenReport, top: int) -> pb.TopLogProbs:
    """The token's `top` best alternatives (the request's count; the reports may hold more)."""
    return pb.TopLogProbs(token_ids=[t for t, _, _ in r.top[:top]], values=[lp for _, _, lp in r.top[:top]])


def _reports(reports: list[TokenReport], top: int) -> pb.OutputLogProbs:
    out = pb.OutputLogProbs(token_ids=[r.token_id for r in reports],
                            token_logprobs=[r.logprob if r.logprob is not None else 0.0 for r in reports])
    if top:
        out.top_logprobs.extend(_top(r, top) for r in reports)
    return out


def _prompt_reports(reports: list[TokenReport], top: int) -> pb.InputLogProbs:
    out = pb.InputLogProbs(token_ids=[r.token_id for r in reports])
    for r in reports:
        value = out.token_logprobs.add()
        if r.logprob is not None:           # the first prompt token has nothing before it
            value.value = r.logprob
    if top:
        out.top_logprobs.extend(_top(r, top) for r in reports)
    return out


@dataclass
class _Answer:
    """One request's answer as it builds up: what the complete message reports."""
    stream: bool
    top: int                       # top logprobs per output token (0: the token's own only)
    prompt_top: int
    output_ids: list[int] = field(default_factory=list)
    reports: list[TokenReport] = field(default_factory=list)
    prompt: list[TokenReport] | None = None

    def chunk(self, delta: Delta, prompt_tokens: int, logprobs: bool) -> pb.GenerateResponse:
        ids = [t.token_id for t in delta.tokens]
        m = pb.GenerateStreamChunk(token_ids=ids, prompt_tokens=prompt_tokens, completion_tokens=len(ids))
        if logprobs:
            m.output_logprobs.CopyFrom(_reports(delta.tokens, self.top))
        if delta.prompt_tokens is not None and self.prompt is not None:
            m.input_logprobs.CopyFrom(_prompt_reports(delta.prompt_tokens, self.prompt_top))
        return pb.GenerateResponse(chunk=m)


def _unimplemented(rpc: str, why: str, streaming: bool = False):
    """A servicer method answering UNIMPLEMENTED with `rpc: why`."""
    async def unary(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: {why}")

    async def stream(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: {why}")
        yield  # pragma: no cover - abort raises; the yield makes it a server stream

    return stream if streaming else unary


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, core: GenerationCore, limits: Limits, facts: ModelFacts) -> None:
        self.core, self.limits, self.facts = core, limits, facts
        self.started = time.time()
        self.last_request = 0.0
        self.aborts: dict[str, asyncio.Event] = {}      # by request id, while its Generate runs
        self._tokenizer: tuple[bytes, str] | None = None

    # ---- the request ----

    def to_request(self, m: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenRequest:
        for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
            if m.HasField(name):
                raise InvalidRequest(f"{name} is not supported by Tandem (text models, no disaggregated prefill)")
        if m.extra_mm_inputs:
            raise InvalidRequest("extra_mm_inputs is not supported by Tandem (text models only)")
        if m.HasField("kv_transfer_params_json"):
            raise InvalidRequest("kv_transfer_params_json is not supported by Tandem (no disaggregated prefill)")
        which = m.WhichOneof("input")
        if which == "tokenized":
            ids = list(m.tokenized.input_ids)
            if not ids:
                raise InvalidRequest("tokenized.input_ids must not be empty")
            for i, t in enumerate(ids):
                if t >= self.facts.vocab_size:
                    raise InvalidRequest(f"tokenized.input_ids[{i}] is {t}, outside the vocabulary of "
                                         f"{self.facts.vocab_size} tokens")
        elif which == "text":
            if len(m.text) > self.limits.max_prompt_chars:
                raise InvalidRequest(f"text is {len(m.text)} characters; the limit is {self.limits.max_prompt_chars}")
            ids = self.core.encode_prompt(m.text)
        else:
            raise InvalidRequest("input must be set: tokenized or text")
        s = m.sampling_params
        if s.HasField("truncate_prompt_tokens"):
            keep = s.truncate_prompt_tokens
            if keep < -1:
                raise InvalidRequest(f"sampling_params.truncate_prompt_tokens must be -1 (the model's context) "
                                     f"or >= 0, got {keep}")
            ids = truncate(ids, self.core.max_context - 1 if keep == -1 else keep, self.core.max_context)
        self.core.check_length(ids, self.limits.max_prompt_tokens)
        self._refuse_unsupported(s)
        temperature = s.temperature if s.HasField("temperature") else 1.0     # vLLM's default
        if s.HasField("max_tokens"):
            if s.max_tokens == 0:
                raise InvalidRequest("sampling_params.max_tokens must be at least 1, got 0")
            max_tokens = s.max_tokens
        else:                                   # vLLM's rule: up to the context window
            max_tokens = min(self.limits.max_new_tokens, self.core.max_context - len(ids))
        where = "sampling_params.{}".format
        params = check_sampling(self.limits, temperature=temperature, top_k=s.top_k, top_p=s.top_p,
                                seed=s.seed if s.HasField("seed") else None, max_new_tokens=max_tokens,
                                min_new_tokens=s.min_tokens, stop_sequences=list(s.stop))
        params = check_processing(self.limits, params, repetition_penalty=s.repetition_penalty,
                                  presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                  where=where)
        # One count of alternatives serves both reports: the larger, each answer cut to its own.
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(s, name) < 0:
                raise InvalidRequest(f"{where(name)} must be between 0 and 10 (-1, every token, is not "
                                     f"supported), got {getattr(s, name)}")
            check_reports(params, logprobs=False, top_logprobs=getattr(s, name), prompt_logprobs=False,
                          field=where(name))
        params = check_reports(params, logprobs=s.HasField("logprobs"),
                               top_logprobs=max(0, s.logprobs, s.prompt_logprobs),
                               prompt_logprobs=s.HasField("prompt_logprobs"))
        kind = s.WhichOneof("constraint")
        if kind == "json_object":
            params = check_guide(self.limits, params, "json" if s.json_object else None, where=lambda _: where(kind))
        elif kind is not None:
            params = check_guided(self.limits, params, s, kind, where=where)
        method, k, session_id = speculation_metadata(self.limits, context.invocation_metadata())
        return GenRequest(prompt_ids=ids, params=params, stop_sequences=list(s.stop),
                          include_stop_sequence=s.include_stop_str_in_output,
                          stop_token_ids=frozenset(s.stop_token_ids), method=method, k=k, session_id=session_id,
                          token_details=True, prompt_details=params.prompt_logprobs)

    @staticmethod
    def _refuse_unsupported(s: pb.SamplingParams) -> None:
        if s.n > 1:
            raise InvalidRequest(f"sampling_params.n must be 1: Tandem returns one output per request, got {s.n}")
        if s.min_p:
            raise InvalidRequest("sampling_params.min_p is not supported by Tandem; use top_p or top_k")
        if s.logit_bias:
            raise InvalidRequest("sampling_params.logit_bias is not supported by Tandem")
        if s.ignore_eos:
            raise InvalidRequest("sampling_params.ignore_eos is not supported by Tandem; min_tokens holds the "
                                 "end of sequence back")
        if s.WhichOneof("constraint") == "structural_tag":
            raise InvalidRequest("sampling_params.structural_tag is not supported by Tandem; use json_schema, "
                                 "regex, grammar or choice")

    # ---- generation ----

    @answers
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        self.last_request = time.time()
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.aborts:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        with self.core.observer("vllm") as obs:
            req = self.to_request(request, context)
            obs.begin(req, OP_TEXT)
            s = request.sampling_params
            answer = _Answer(request.stream, top=max(0, s.logprobs), prompt_top=max(0, s.prompt_logprobs))
            aborted = self.aborts[request_id] = asyncio.Event()
            try:
                async for event in _until(self.core.stream(req, context.time_remaining()), aborted):
                    if event is None:
                        log.info("request %s aborted", request_id)
                        yield self._complete(answer, req, None)
                        return
                    obs.saw(event)
                    if isinstance(event, Delta):
                        if event.prompt_tokens is not None:
                            answer.prompt = event.prompt_tokens
                        chunk = answer.chunk(event, len(req.prompt_ids), req.params.logprobs)
                        answer.output_ids += chunk.chunk.token_ids
                        answer.reports += event.tokens
                        if answer.stream and (chunk.chunk.token_ids or chunk.chunk.HasField("input_logprobs")):
                            yield chunk
                    else:
                        yield self._complete(answer, req, event)
            finally:
                self.aborts.pop(request_id, None)

    def _complete(self, answer: _Answer, req: GenRequest, final: Final | None) -> pb.GenerateResponse:
        """The last message. Streamed, the chunks carried the tokens, and it carries none; whole, it
        carries them all. final None: the request was aborted."""
        m = pb.GenerateComplete(prompt_tokens=len(req.prompt_ids), finish_reason="abort")
        if not answer.stream:
            m.output_ids.extend(answer.output_ids)
            m.completion_tokens = len(answer.output_ids)
            if req.params.logprobs:
                m.output_logprobs.CopyFrom(_reports(answer.reports, answer.top))
            if answer.prompt is not None and req.params.prompt_logprobs:
                m.input_logprobs.CopyFrom(_prompt_reports(answer.prompt, answer.prompt_top))
        if final is not None:
            u = final.usage
            m.finish_reason = _FINISH[final.finish_reason]
            m.cached_tokens = u.cached_prompt_tokens
            m.spec_draft_tokens, m.spec_accepted_tokens = u.draft_tokens, u.accepted_tokens
            if final.stop_token is not None:
                m.matched_token_id = final.stop_token
            elif final.stop_sequence:
                m.matched_stop_str = final.stop_sequence
        return pb.GenerateResponse(complete=m)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Ends the named requests' streams (each with finish reason "abort"), which frees their verify
        sessions; ids not running here are ignored, as a router aborts ids that may have finished."""
        for request_id in request.request_ids:
            event = self.aborts.get(request_id)
            if event is not None:
                event.set()
        return pb.AbortResponse()

    # ---- what a router asks of an engine ----

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        """Healthy while the gateway can place a request: some verify worker is routable."""
        try:
            workers = await self.core.router.verify_pool()
        except RoutingError as e:
            return pb.HealthCheckResponse(healthy=False, message=f"cannot read the worker registry: {e}")
        if not workers:
            return pb.HealthCheckResponse(healthy=False, message=f"no verify worker serves {self.facts.name}")
        return pb.HealthCheckResponse(healthy=True, message=f"{len(workers)} verify worker(s)")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        f = self.facts
        return pb.GetModelInfoResponse(
            model_path=f.name, served_model_name=f.name, tokenizer_path=str(f.folder), is_generation=True,
            max_context_length=self.core.max_context, vocab_size=f.vocab_size, supports_vision=False,
            model_type=f.model_type, architectures=f.architectures, eos_token_ids=f.eos_ids,
            pad_token_id=f.pad_id, bos_token_id=f.bos_id,
            max_req_input_len=self.limits.max_prompt_tokens or self.core.max_context - 1)

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            active_requests=LOAD.running, is_paused=False, last_receive_timestamp=self.last_request,
            uptime_seconds=time.time() - self.started, server_type="vllm-grpc", data_parallel_size=1,
            model_dtype="", constrained_decoding_start="first_token")

    @answers
    async def GetLoads(self, request, context) -> pb.GetLoadsResponse:
        """One rank: this gateway's requests (waiting: arrived, no token yet) and its verify pool's KV."""
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise InvalidRequest(f"dp_rank {request.dp_rank} does not exist: Tandem reports one rank, 0")
        try:
            await self.core.router.verify_pool()
        except RoutingError:
            pass                             # the budget as last read
        used, total = self.core.router.kv_snapshot()
        load = pb.SchedulerLoad(dp_rank=0, num_running_reqs=LOAD.streaming, num_waiting_reqs=LOAD.waiting,
                                num_total_reqs=LOAD.running, num_used_tokens=used, max_total_num_tokens=total,
                                token_usage=used / total if total else 0.0)
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version="tandem",
                                   dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context) -> AsyncIterator:
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(tokenizer_zip, self.facts.folder)
        data, digest = self._tokenizer
        for start in range(0, len(data), TOKENIZER_CHUNK):
            last = start + TOKENIZER_CHUNK >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:start + TOKENIZER_CHUNK], sha256=digest if last else "")

    # ---- what Tandem has no part of: UNIMPLEMENTED, saying why ----

    Embed = _unimplemented("Embed", "Tandem serves generation, not embeddings")
    FlushCache = _unimplemented("FlushCache", "the verify workers own their KV; restart a worker to drop it")
    StartProfile = _unimplemented("StartProfile", "Tandem has no engine profiler; use its OpenTelemetry traces")
    StopProfile = _unimplemented("StopProfile", "Tandem has no engine profiler; use its OpenTelemetry traces")
    SubscribeKvEvents = _unimplemented("SubscribeKvEvents", "Tandem publishes no KV cache events; GetLoads "
                                       "reports its load", streaming=True)


async def _until(events: AsyncIterator, aborted: asyncio.Event) -> AsyncIterator:
    """The events, or None once `aborted` is set (the events' stream is then closed, which ends the
    worker call and frees its session)."""
    events = aiter(events)
    stop = asyncio.ensure_future(aborted.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                yield None
                return
            try:
                event = step.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        # Also reached when the caller is cancelled (its client went away) during the wait: the
        # generator must be at rest before it is closed, or closing it fails and its call lives on.
        stop.cancel()
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await step
        await events.aclose()


def add_vllm_service(server: grpc.aio.Server, core: GenerationCore, limits: Limits, facts: ModelFacts) -> None:
    pb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(core, limits, facts), server)

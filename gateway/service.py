"""tandem.v1.GenerationService: protobuf in, GenRequest to the core, protobuf out."""

from __future__ import annotations

import logging

from gateway.core import GenerationCore
from gateway.events import Delta, Final, TokenReport, answers
from gateway.observe import OP_CHAT, OP_TEXT
from gateway.request import (GenRequest, InvalidRequest, Limits, check_guide, check_guided, check_processing, check_reports,
                             check_sampling, check_session_id, check_speculation, truncate)
from tandem.speculation.finish import Finish
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_METHODS = {pb.DRAFT_METHOD_UNSPECIFIED: "", pb.DRAFT_METHOD_MODEL: "model",
            pb.DRAFT_METHOD_NGRAM: "ngram", pb.DRAFT_METHOD_NONE: "none",
            pb.DRAFT_METHOD_HEAD: "head"}
_FINISH = {Finish.LENGTH: pb.FINISH_REASON_LENGTH, Finish.EOS: pb.FINISH_REASON_EOS,
           Finish.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE, Finish.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
           Finish.GUIDE: pb.FINISH_REASON_GUIDE_COMPLETE, Finish.STOP_TOKEN: pb.FINISH_REASON_STOP_SEQUENCE}


def guided(limits: Limits, params, m: pb.Guided):
    """The native face's structured output (tandem.v1.Guided) into params."""
    kind = m.WhichOneof("kind")
    if kind == "json_object":
        return check_guide(limits, params, "json" if m.json_object else None, where=lambda _: "guided.json_object")
    return check_guided(limits, params, m, kind, where="guided.{}".format)


def usage_proto(final: Final) -> pb.Usage:
    u = final.usage
    return pb.Usage(prompt_tokens=u.prompt_tokens, generated_tokens=u.generated_tokens,
                    draft_tokens=u.draft_tokens, accepted_tokens=u.accepted_tokens,
                    verify_rounds=u.verify_rounds, acceptance_rate=u.acceptance_rate,
                    mean_accepted_length=u.mean_accepted_length, draft_method=u.draft_method,
                    cached_prompt_tokens=u.cached_prompt_tokens, migrations=u.migrations,
                    forced_tokens=u.forced_tokens, forced_accepted_tokens=u.forced_accepted_tokens)


def logprobs_proto(reports: list[TokenReport] | None) -> list[pb.TokenLogprob]:
    out = []
    for t in reports or ():
        m = pb.TokenLogprob(token_id=t.token_id, text=t.text, rank=t.rank)
        if t.logprob is not None:
            m.logprob = t.logprob
        for token_id, text, lp in t.top:
            m.top_logprobs.add(token_id=token_id, text=text, logprob=lp)
        out.append(m)
    return out


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, core: GenerationCore, limits: Limits) -> None:
        self.core = core
        self.limits = limits

    def to_request(self, m: pb.GenerateRequest) -> GenRequest:
        which = m.WhichOneof("input")
        if which == "chat":
            chars = sum(len(x.content) for x in m.chat.messages)
            if chars > self.limits.max_prompt_chars:
                raise InvalidRequest(f"chat.messages hold {chars} characters; the limit is "
                                     f"{self.limits.max_prompt_chars}")
            ids, later = self.core.encode_chat([(x.role, x.content) for x in m.chat.messages])
        else:
            if len(m.prompt) > self.limits.max_prompt_chars:
                raise InvalidRequest(f"prompt is {len(m.prompt)} characters; the limit is "
                                     f"{self.limits.max_prompt_chars}")
            ids = self.core.encode_prompt(m.prompt)
            later = self.core.encode_continuation(m.prompt)
        ids = truncate(ids, m.truncate_input_tokens, self.core.max_context)
        later = truncate(later, m.truncate_input_tokens, self.core.max_context)
        self.core.check_length(ids, self.limits.max_prompt_tokens)
        s = m.sampling
        params = check_sampling(self.limits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                seed=s.seed if s.HasField("seed") else None,
                                max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens,
                                stop_sequences=list(s.stop_sequences))
        params = check_processing(self.limits, params, typical_p=s.typical_p, repetition_penalty=s.repetition_penalty,
                                  presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                  length_penalty=((s.length_penalty.start_index, s.length_penalty.decay_factor)
                                                  if s.HasField("length_penalty") else None))
        lp = m.logprobs
        params = check_reports(params, logprobs=lp.logprobs or lp.top_logprobs > 0, top_logprobs=lp.top_logprobs,
                               prompt_logprobs=lp.prompt_logprobs, field="logprobs.top_logprobs")
        params = guided(self.limits, params, m.guided)
        if m.speculation.method not in _METHODS:
            raise InvalidRequest(f"unknown speculation.method value {m.speculation.method}")
        method, k = check_speculation(self.limits, _METHODS[m.speculation.method],
                                      m.speculation.num_speculative_tokens)
        return GenRequest(prompt_ids=ids, params=params, stop_sequences=list(s.stop_sequences),
                          method=method, k=k, session_id=check_session_id(m.session_id),
                          continuation_ids=later, token_details=params.logprobs,
                          prompt_details=params.prompt_logprobs)

    @answers
    async def _events(self, request, context):
        with self.core.observer("tandem") as obs:
            req = self.to_request(request)
            if request.WhichOneof("input") == "chat":
                obs.begin(req, OP_CHAT, [(x.role, x.content) for x in request.chat.messages])
            else:
                obs.begin(req, OP_TEXT, [("user", request.prompt)])
            async for event in self.core.stream(req, context.time_remaining()):
                obs.saw(event)
                yield event

    async def Generate(self, request, context):
        parts: list[str] = []
        tokens: list[TokenReport] = []
        prompt: list[TokenReport] | None = None
        async for event in self._events(request, context):
            if isinstance(event, Delta):
                parts.append(event.text)
                tokens += event.tokens
                prompt = event.prompt_tokens if event.prompt_tokens is not None else prompt
            else:
                return pb.GenerateResponse(text="".join(parts), finish_reason=_FINISH[event.finish_reason],
                                           usage=usage_proto(event), session_id=event.session_id,
                                           stop_sequence=event.stop_sequence, tokens=logprobs_proto(tokens),
                                           prompt_tokens=logprobs_proto(prompt))

    async def GenerateStream(self, request, context):
        async for event in self._events(request, context):
            if isinstance(event, Delta):
                if event.text or event.token_count or event.prompt_tokens is not None:
                    yield pb.GenerateStreamResponse(text=event.text, token_count=event.token_count,
                                                    tokens=logprobs_proto(event.tokens),
                                                    prompt_tokens=logprobs_proto(event.prompt_tokens))
            else:
                yield pb.GenerateStreamResponse(finish_reason=_FINISH[event.finish_reason],
                                                usage=usage_proto(event), session_id=event.session_id,
                                                stop_sequence=event.stop_sequence)

"""The gateway's core, shared by the tandem.v1 and TGIS faces: tokenize, route, stream text."""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from gateway.request import GenRequest, InvalidRequest
from gateway.text import IncrementalDetokenizer, StopMatcher
from tandem import wire
from tandem.server import CHANNEL_OPTIONS
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc

log = logging.getLogger(__name__)

FINISH_LENGTH, FINISH_EOS, FINISH_STOP, FINISH_CONTEXT = "length", "eos", "stop_sequence", "context_length"
_STOP_TO_FINISH = {1: FINISH_LENGTH, 2: FINISH_EOS, 3: FINISH_CONTEXT}


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_rounds: int = 0
    draft_method: str = "none"

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify round, the bonus token included (1.0 = plain decoding)."""
        return self.generated_tokens / self.verify_rounds if self.verify_rounds else 0.0


@dataclass
class Delta:
    text: str
    token_count: int


@dataclass
class Final:
    finish_reason: str
    usage: Usage
    session_id: str
    stop_sequence: str = ""


class WorkerPool:
    """Static worker addresses, taken in turn. (Discovery through Redis replaces this.)"""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = [a for a in addresses if a]
        self._next = itertools.cycle(self.addresses) if self.addresses else None
        self._channels: dict[str, grpc.aio.Channel] = {}

    def pick(self) -> str | None:
        return next(self._next) if self._next else None

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


class GenerationCore:
    def __init__(self, tokenizer, model_name: str, max_context: int,
                 draft_pool: WorkerPool, verify_pool: WorkerPool) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.drafts = draft_pool
        self.verifiers = verify_pool

    # ---- input ----

    def encode_prompt(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequest("prompt must not be empty")
        return list(self.tokenizer(text).input_ids)

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        if not messages:
            raise InvalidRequest("chat.messages must not be empty")
        for i, (role, _) in enumerate(messages):
            if role not in ("system", "user", "assistant"):
                raise InvalidRequest(f"chat.messages[{i}].role must be system, user or assistant, got {role!r}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(f"model {self.model_name} has no chat template; send a plain prompt")
        text = self.tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                                  tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def check_length(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequest("prompt must not be empty")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the model's context is "
                                 f"{self.max_context} tokens and at least one must be left to generate")

    # ---- generation ----

    async def stream(self, req: GenRequest, timeout: float | None) -> AsyncIterator[Delta | Final]:
        """Yields text deltas, then one Final."""
        self.check_length(req.prompt_ids)
        session_id = req.session_id or uuid.uuid4().hex
        verify = self.verifiers.pick()
        if verify is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no verify worker is configured")
        method = req.method
        draft = self.drafts.pick() if method != "none" else None
        if method != "none" and draft is None:
            log.warning("no draft worker configured; decoding with the target alone")
            method = "none"
        sampling = wire.params_to_proto(req.params)
        if method == "none":
            address = verify
            call = ipb_grpc.VerifyServiceStub(self.verifiers.channel(verify)).Decode(
                ipb.DecodeRequest(session_id=session_id, prompt_ids=req.prompt_ids, sampling=sampling),
                timeout=timeout)
        else:
            address = draft
            call = ipb_grpc.DraftServiceStub(self.drafts.channel(draft)).Generate(
                ipb.DraftGenerateRequest(session_id=session_id, prompt_ids=req.prompt_ids, sampling=sampling,
                                         method=method, num_speculative_tokens=req.k, verify_address=verify),
                timeout=timeout)
        usage = Usage(prompt_tokens=len(req.prompt_ids), draft_method=method)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids)
        stops = StopMatcher(req.stop_sequences)
        finish = ""
        try:
            async for chunk in call:
                usage.generated_tokens += len(chunk.token_ids)
                usage.draft_tokens += chunk.draft_tokens
                usage.accepted_tokens += chunk.accepted_tokens
                usage.verify_rounds += 1
                text = detok.add(list(chunk.token_ids))
                if chunk.stop_reason:
                    if chunk.stop_reason not in _STOP_TO_FINISH:
                        raise GatewayError(grpc.StatusCode.INTERNAL,
                                           f"worker {address} sent unknown stop reason {chunk.stop_reason}")
                    text += detok.flush()
                text = stops.feed(text)
                if stops.matched is not None:
                    finish = FINISH_STOP
                    text += stops.matched if req.include_stop_sequence else ""
                elif chunk.stop_reason:
                    finish = _STOP_TO_FINISH[chunk.stop_reason]
                    text += stops.flush()
                if text or chunk.token_ids:
                    yield Delta(text, len(chunk.token_ids))
                if finish:
                    break
        except grpc.aio.AioRpcError as e:
            raise _downstream_error(e, address) from None
        finally:
            call.cancel()
        if not finish:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"worker {address} ended the stream early")
        yield Final(finish, usage, session_id, stops.matched or "")


def _downstream_error(e: grpc.aio.AioRpcError, address: str) -> GatewayError:
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return GatewayError(code, f"worker {address} is unavailable: {e.details()}")
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION):
        return GatewayError(code, e.details() or code.name)
    return GatewayError(grpc.StatusCode.INTERNAL, f"worker {address} failed: {code.name}: {e.details()}")

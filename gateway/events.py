"""What the gateway's core hands its two public faces: text deltas with their token reports, a
final event with usage, and the errors that end a request with a status."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import grpc

from gateway.request import InvalidRequest
from tandem.speculation.finish import Finish


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def answers(method):
    """Wraps a servicer method (unary or server-streaming): a request that can never work ends
    with INVALID_ARGUMENT and its message, a GatewayError with its own status."""
    async def abort(context, e: Exception) -> None:
        if isinstance(e, InvalidRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await context.abort(e.code, e.message)

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                async for message in method(self, request, context):
                    yield message
            except (InvalidRequest, GatewayError) as e:
                await abort(context, e)
        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except (InvalidRequest, GatewayError) as e:
            await abort(context, e)
    return unary


@dataclass
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_rounds: int = 0
    draft_method: str = "none"
    cached_prompt_tokens: int = 0      # prompt tokens whose KV a verify worker kept from an earlier turn
    migrations: int = 0                # times the request moved after a worker failed
    forced_tokens: int = 0             # proposed by a guide's jump-forward, not drafted
    forced_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verify round, the bonus token included (1.0 = plain decoding)."""
        return self.generated_tokens / self.verify_rounds if self.verify_rounds else 0.0


@dataclass(frozen=True)
class TokenReport:
    """One token as a client sees it: id, text as the tokenizer decodes it alone, and what the
    target's raw distribution said of it when the request asked (tandem/speculation/logprobs.py)."""
    token_id: int
    text: str
    logprob: float | None = None        # None: not asked, or the first prompt token (nothing before it)
    rank: int = 0
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass
class Delta:
    text: str
    token_count: int
    tokens: list[TokenReport] = field(default_factory=list)   # when the request asked for token details
    prompt_tokens: list[TokenReport] | None = None            # first delta only, when asked


@dataclass
class Final:
    finish_reason: Finish
    usage: Usage
    session_id: str
    stop_sequence: str = ""
    stop_token: int | None = None      # the stop token id that ended it (Finish.STOP_TOKEN)

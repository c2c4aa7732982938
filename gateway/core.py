"""The gateway's core, shared by its faces (gateway/faces.py): tokenize, route, stream text."""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict
from typing import AsyncIterator

import grpc

from gateway.conversation import Conversations, SessionBusy, SessionUnavailable
from gateway.events import Delta, Final, GatewayError
from gateway.observe import RequestObserver
from gateway.request import GenRequest, InvalidRequest
from gateway.routing import Router
from gateway.run import RequestRun, Serving
from gateway.text import TokenTexts
from tandem.service import logs

log = logging.getLogger(__name__)

_ANSWER_MARK = "\x00tandem-answer\x00"


class GenerationCore:
    def __init__(self, tokenizer, model_name: str, max_context: int, router: Router,
                 conversations: Conversations | None = None, max_migrations: int = 3,
                 trace_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.router = router
        self.conversations = conversations or Conversations(None)
        self.trace_content = trace_content      # prompt and completion text on request spans
        self.serving = Serving(TokenTexts(tokenizer), router, self.conversations, max_context, max_migrations)

    def observer(self, api: str):
        """A RequestObserver for one generation through the public API `api`."""
        return RequestObserver(api, self.model_name, self.trace_content)

    # ---- input ----

    def encode_prompt(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequest("prompt must not be empty")
        return list(self.tokenizer(text).input_ids)

    def encode_chat(self, messages: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
        """(ids as a conversation's first turn, ids as a later turn of a session)."""
        if not messages:
            raise InvalidRequest("chat.messages must not be empty")
        for i, (role, _) in enumerate(messages):
            if role not in ("system", "user", "assistant"):
                raise InvalidRequest(f"chat.messages[{i}].role must be system, user or assistant, got {role!r}")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest(f"model {self.model_name} has no chat template; send a plain prompt")
        msgs = [{"role": r, "content": c} for r, c in messages]
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        # A later turn follows the model's last answer: render the messages after a stand-in answer
        # and keep what comes after it. That closes the answer the way the template does (also one
        # cut by max_new_tokens) and does not repeat a default system prompt mid-conversation.
        probe = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _ANSWER_MARK}]
        full = self.tokenizer.apply_chat_template(probe + msgs, tokenize=False, add_generation_prompt=True)
        later = full[full.index(_ANSWER_MARK) + len(_ANSWER_MARK):] if _ANSWER_MARK in full else text
        encode = lambda t: list(self.tokenizer(t, add_special_tokens=False).input_ids)  # noqa: E731
        return encode(text), encode(later)

    def encode_continuation(self, text: str) -> list[int]:
        """A plain prompt as a later turn of a session: no BOS or other special tokens in between."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def check_length(self, prompt_ids: list[int], max_prompt_tokens: int = 0) -> None:
        """max_prompt_tokens: the operator's limit (--max-prompt-tokens), 0 = the context window."""
        if not prompt_ids:
            raise InvalidRequest("prompt must not be empty")
        if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
            raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the limit is {max_prompt_tokens}")
        if len(prompt_ids) >= self.max_context:
            raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the model's context is "
                                 f"{self.max_context} tokens and at least one must be left to generate")

    # ---- generation ----

    async def stream(self, req: GenRequest, timeout: float | None) -> AsyncIterator[Delta | Final]:
        """Yields text deltas, then one Final. A worker lost mid-stream is replaced: the request is
        re-issued elsewhere with the tokens already delivered appended to its prompt, so the client
        sees every token once (and, under greedy decoding, exactly the uninterrupted output)."""
        self.check_length(req.prompt_ids)
        session_id = req.session_id or uuid.uuid4().hex
        logs.session_id.set(session_id)
        try:
            turn = await self.conversations.begin(session_id, req.prompt_ids,
                                                  req.continuation_ids or req.prompt_ids, fresh=not req.session_id)
        except SessionBusy as e:
            raise GatewayError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except SessionUnavailable as e:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        finished = False
        try:
            if len(turn.prompt_ids) >= self.max_context:
                raise InvalidRequest(f"session {session_id} would be {len(turn.prompt_ids)} tokens with this turn; "
                                     f"the model's context is {self.max_context} tokens")
            run = RequestRun(self.serving, req, turn, timeout)
            async for event in run.events():
                yield event
            await self.conversations.finish(turn, run.history(), run.route.verify, run.route.draft,
                                            asdict(req.params))
            finished = True
            yield run.final()
        finally:
            if not finished:
                await self.conversations.release(turn)

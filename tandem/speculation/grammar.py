"""Structured output: a grammar the output must match, applied as a mask in the one processing
pipeline (`process`'s `allowed`), on the target and on the drafter alike.

A request's `Guide` (JSON, a JSON Schema, a regex, a choice of strings, or a grammar in xgrammar's
EBNF) compiles once per vocabulary (`Grammars`, cached by kind and text) into a grammar that a
`Matcher` walks. A matcher holds the grammar state after the committed tokens. The verify
worker's matcher decides what is accepted: row i of a proposal's logits is masked by the state
after the proposed tokens before it, and the matcher then advances along what was committed.
The draft worker's matcher follows the same tokens to draft under the same mask, and to propose
the run the grammar forces (jump-forward) without a draft model. Either side rebuilds its matcher
by replaying the delivered tokens when a request moves.

A grammar ends a request when nothing but end-of-sequence may follow (`Matcher.done`); the
min_new_tokens block on end-of-sequence does not apply at such a position (see `process`).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xgrammar as xgr

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A constraint that cannot be used (does not compile, too large): the request's fault."""


@dataclass(frozen=True)
class Guide:
    """What the output must match. kind: one of KINDS; text: the schema, regex or grammar (empty
    for json); choices: the strings of a choice."""
    kind: str
    text: str = ""
    choices: tuple[str, ...] = ()

    def size(self) -> int:
        """Characters of the constraint, for the size limit."""
        return len(self.text) + sum(len(c) for c in self.choices)


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """Compiles guides for one vocabulary, each once: a compiled grammar (or the error it raised)
    is kept, least recently used out past `cache_size`, keyed by kind and text.

    tokenizer: the model's (Hugging Face); vocab_size: the model's logits width, which may exceed
    the tokenizer's length; stop_ids: the model's end-of-sequence tokens, the only ones a complete
    output allows."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], max_chars: int = 65536,
                 cache_size: int = 256) -> None:
        self.vocab_size, self.max_chars, self.cache_size = vocab_size, max_chars, cache_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.stop_ids = list(self.info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: OrderedDict[Guide, xgr.CompiledGrammar | GrammarError] = OrderedDict()
        self._busy: set[Guide] = set()          # guides being compiled
        self._lock = threading.Lock()

    def compile(self, guide: Guide) -> xgr.CompiledGrammar:
        """Raises GrammarError naming the field and the library's message."""
        if guide.size() > self.max_chars:
            raise GrammarError(f"{guide.kind} is {guide.size()} characters; this worker's limit is {self.max_chars}")
        with self._lock:
            found = self._cache.get(guide)
            if found is not None:
                self._cache.move_to_end(guide)
        if found is None:
            found = self._compile(guide)
            with self._lock:
                self._cache[guide] = found
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(found, GrammarError):
            raise found
        return found

    def _compile(self, guide: Guide) -> xgr.CompiledGrammar | GrammarError:
        c = self._compiler
        try:
            if guide.kind == "json":
                return c.compile_builtin_json_grammar()
            if guide.kind == "json_schema":
                return c.compile_json_schema(guide.text, any_whitespace=False)
            if guide.kind == "regex":
                return c.compile_regex(guide.text)
            if guide.kind == "choice":
                return c.compile_grammar(choice_grammar(guide.choices))
            if guide.kind == "grammar":
                return c.compile_grammar(guide.text)
        except (RuntimeError, ValueError, TypeError) as e:
            return GrammarError(f"{guide.kind} does not compile: {_message(e)}")
        return GrammarError(f"unknown constraint kind {guide.kind!r} (one of {', '.join(KINDS)})")

    def matcher(self, guide: Guide) -> Matcher:
        return Matcher(self.compile(guide), self.vocab_size, self.stop_ids)

    async def matcher_within(self, guide: Guide, seconds: float) -> Matcher:
        """A matcher, compiled on a thread of its own so that the event loop goes on; GrammarError
        when compiling takes longer than `seconds` (the compile runs on and is cached when done; a
        request for the same guide meanwhile is refused at once instead of compiling it again)."""
        with self._lock:
            if guide in self._busy:
                raise GrammarError(f"{guide.kind} took longer than {seconds:g} s to compile")
            self._busy.add(guide)
        job = asyncio.get_running_loop().run_in_executor(None, self._compile_freeing, guide)
        try:
            compiled = await asyncio.wait_for(asyncio.shield(job), seconds)
        except asyncio.TimeoutError:
            raise GrammarError(f"{guide.kind} took longer than {seconds:g} s to compile") from None
        return Matcher(compiled, self.vocab_size, self.stop_ids)

    def _compile_freeing(self, guide: Guide) -> xgr.CompiledGrammar:
        try:
            return self.compile(guide)
        finally:
            with self._lock:
                self._busy.discard(guide)


def _message(e: Exception) -> str:
    """The library's message without its source location ("[time] path.cc:123: ")."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and (".cc:" in head or ".h:" in head) else text


class Matcher:
    """The grammar state after the committed tokens. Not thread-safe: one stream uses it at a time."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_ids: list[int]) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._words = (vocab_size + 31) // 32

    def advance(self, tokens: list[int]) -> int:
        """Accepts tokens in order up to the first the grammar refuses; returns how many it took."""
        for n, t in enumerate(tokens):
            if self._m.is_terminated() or not self._m.accept_token(int(t)):
                return n
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def allowed(self, proposed: list[int] = ()) -> torch.Tensor:
        """[k+1, V] bool: row i, the tokens allowed after proposed[:i]. Rows after a proposed token
        the grammar refuses (or after end-of-sequence) allow every token: no verdict reads them,
        since that token is rejected first. The state is left as it was."""
        k = len(proposed)
        mask = torch.full((k + 1, self._words), -1, dtype=torch.int32)
        taken = 0
        for i in range(k + 1):
            if self._m.is_terminated():
                break
            self._m.fill_next_token_bitmask(mask, i)
            if i == k or not self._m.accept_token(int(proposed[i])):
                break
            taken += 1
        self.rollback(taken)
        return unpack(mask, self.vocab_size)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens of the text the grammar forces next (jump-forward); the state is
        left as it was. Empty when the grammar allows a choice or has ended."""
        if limit <= 0:
            return []
        return [int(t) for t in self._m.find_jump_forward_tokens()[:limit]]

    def done(self) -> bool:
        """Nothing but end-of-sequence may follow: the constrained output is complete."""
        if self._m.is_terminated():
            return True
        if not self._m.is_completed():
            return False
        row = self.allowed()[0]
        row[self.stop_ids] = False
        return not bool(row.any())


def unpack(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 bitmask [n, ceil(V/32)] (bit j of word w: token 32w + j) -> bool [n, V]."""
    bits = (mask.unsqueeze(-1) >> _BITS) & 1                        # [n, W, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()

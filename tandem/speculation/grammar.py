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
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xgrammar as xgr

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
_BITS = torch.arange(32, dtype=torch.int32)
FORCED_BYTES = 16      # jump-forward looks this many bytes of forced text ahead per token it may propose
FORCED_SCAN = 4096     # more allowed tokens than this: jump-forward does not look for a common start


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
        # Special tokens (end-of-sequence among them) spell no text: a guide whose text may read
        # "<|endoftext|>" must not be ended by the token of that name, which prints nothing.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        special = {*tokenizer.all_special_ids, *info.special_token_ids, *stop_ids,
                   *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)}
        self.vocab = [b"" if i in special else text for i, text in enumerate(info.decoded_vocab)]
        self.info = xgr.TokenizerInfo(self.vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.stop_ids = list(self.info.stop_token_ids)
        self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        # xgrammar's own cache would keep every guide ever compiled: this class keeps `cache_size`
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[Guide, xgr.CompiledGrammar | GrammarError] = OrderedDict()
        self._busy: dict[Guide, asyncio.Future] = {}      # guides being compiled, on this loop
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
                return self._some_value(c.compile_json_schema(guide.text, any_whitespace=False))
            if guide.kind == "regex":
                return c.compile_regex(guide.text)
            if guide.kind == "choice":
                return c.compile_grammar(choice_grammar(guide.choices))
            if guide.kind == "grammar":
                return c.compile_grammar(guide.text)
        except (RuntimeError, ValueError, TypeError) as e:
            return GrammarError(f"{guide.kind} does not compile: {_message(e)}")
        return GrammarError(f"unknown constraint kind {guide.kind!r} (one of {', '.join(KINDS)})")

    def _some_value(self, compiled: xgr.CompiledGrammar) -> xgr.CompiledGrammar | GrammarError:
        """A JSON Schema no value satisfies (an empty anyOf or enum, contradicting keywords) compiles
        to a grammar that allows only the end at once: the empty output, which is no JSON."""
        first = self._matcher(compiled).allowed()[0].clone()
        first[self.stop_ids] = False
        if not bool(first.any()):
            return GrammarError("json_schema admits no JSON value (an empty anyOf, oneOf or enum, or "
                                "contradicting keywords)")
        return compiled

    def matcher(self, guide: Guide) -> Matcher:
        return self._matcher(self.compile(guide))

    def _matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        return Matcher(compiled, self.vocab_size, self.stop_ids, self.vocab, self._encode)

    async def matcher_within(self, guide: Guide, seconds: float, replay: list[int] = ()) -> Matcher:
        """A matcher after `replay` (the output a moved request delivered before the move), compiled
        on a thread of its own so that the event loop goes on; GrammarError when compiling takes
        longer than `seconds`, or when the guide refuses `replay`. Requests for a guide being
        compiled wait for that compile rather than start another; one that timed out runs on and is
        cached when done."""
        loop = asyncio.get_running_loop()
        with self._lock:
            job = self._busy.get(guide)
            if job is None:
                job = self._busy[guide] = loop.run_in_executor(None, self.compile, guide)
                job.add_done_callback(lambda _: self._busy.pop(guide, None))
        try:
            compiled = await asyncio.wait_for(asyncio.shield(job), seconds)
        except asyncio.TimeoutError:
            raise GrammarError(f"{guide.kind} took longer than {seconds:g} s to compile") from None
        matcher = self._matcher(compiled)
        if matcher.advance(replay) != len(replay):
            raise GrammarError("the output delivered before the move (resumed) does not match the guide")
        return matcher


def _message(e: Exception) -> str:
    """The library's message without its source location ("[time] path.cc:123: ")."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and (".cc:" in head or ".h:" in head) else text


class Matcher:
    """The grammar state after the committed tokens. Not thread-safe: one stream uses it at a time."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_ids: list[int],
                 vocab: list[bytes], encode: Callable[[str], list[int]]) -> None:
        self._m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.vocab, self.encode = vocab, encode       # each token's text (b"" for special ones); text -> ids
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
        """Up to `limit` tokens of the text the guide forces next (jump-forward), as the tokenizer
        spells it (where the target would spell it otherwise, it rejects them: a proposal like any
        other); the state is left as it was. Empty when the guide allows a choice or may end.

        The text is found a piece at a time, bounded (a guide may force text without end, which
        xgrammar's own jump-forward would build whole): the longest start that every allowed
        token shares is forced, unless more than FORCED_SCAN tokens are allowed (then there is
        almost never one)."""
        if limit <= 0:
            return []
        walk, text = self._m.fork(), b""
        mask = torch.zeros((1, self._words), dtype=torch.int32)
        while len(text) < FORCED_BYTES * (limit + 1) and not walk.is_terminated():
            walk.fill_next_token_bitmask(mask, 0)
            allowed = unpack(mask, self.vocab_size)[0]
            if bool(allowed[self.stop_ids].any()) or int(allowed.sum()) > FORCED_SCAN:
                break
            words = [self.vocab[i] for i in allowed.nonzero().flatten().tolist() if i < len(self.vocab)]
            start = os.path.commonprefix([w for w in words if w]) if words else b""
            if not start or not walk.accept_string(start):
                break
            text += start
        spelled = text.decode("utf-8", errors="ignore")
        tokens = self.encode(spelled)[:limit] if spelled else []
        taken = self.advance(tokens)
        self.rollback(taken)
        return tokens[:taken]

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

"""A draft model's output layer over part of its vocabulary: its most frequent tokens and the special ones.

The output layer is a large share of a small draft model's step: the 0.5B Qwen draft has 136M of
its 494M weights there, one row per token of a 152k vocabulary. A draft that scores only the tokens
it is likely to propose drafts faster, and loses only the positions where the target's token is
one it left out (frequency-ranked drafting, FR-Spec, arXiv 2502.14856). A byte-level BPE
vocabulary numbers its tokens in the order their merges were learnt, the order of their frequency
in the tokenizer's training text, so the first `size` ids stand for the frequent ones; the
tokenizer's special and added tokens (end of turn, chat markers) and the end-of-sequence ids are
always kept.

A rank in a tokenizer's training text is not a rank in one conversation: code names its own
identifiers (` fibonacci`, ` palindrome`) with tokens far down the list, and repeats them. So the
layer also scores every token its drafts have been fed (`see`: the prompts and the verified
tokens, all sessions together, up to `max_seen`), from the full layer's rows in float32, which a
tied layer shares with the embedding at no cost in memory.

The trimmed layer still gives logits over the whole vocabulary, -inf for the tokens left out, so
everything after it (logits processors, the guide's mask, the draft's q) is unchanged: a greedy
draft proposes its best scored token, and a sampled one draws from q over the scored tokens, which
is the q it sends, so verification stays lossless. Only the draft's speed and acceptance change,
and only a draft's layer may be trimmed: a target's logits are the output.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch


class TrimmedHead(torch.nn.Module):
    """An output layer computing the rows of `keep` and of the tokens seen, -inf in the others."""

    def __init__(self, head: torch.nn.Linear, keep: torch.Tensor, max_seen: int = 16384) -> None:
        super().__init__()
        self.vocab_size, self.max_seen = head.out_features, max_seen
        self.inner = torch.nn.Linear(head.in_features, len(keep), bias=head.bias is not None,
                                     dtype=head.weight.dtype, device=head.weight.device)
        with torch.no_grad():
            self.inner.weight.copy_(head.weight[keep])
            if head.bias is not None:
                self.inner.bias.copy_(head.bias[keep])
        self.register_buffer("keep", keep.to(head.weight.device), persistent=False)
        self._full = (head.weight, head.bias)     # not registered: a tied layer's are the embedding's
        self._known = set(keep.tolist())          # ids scored: kept and seen
        self._pending: set[int] = set()           # seen, not yet in the rows below
        self._lock = threading.Lock()             # see() runs on any thread, forward on the inference one
        device = head.weight.device
        self._seen_ids = torch.zeros(0, dtype=torch.long, device=device)
        self._seen_rows = torch.zeros(0, head.in_features, device=device)
        self._seen_bias = torch.zeros(0, device=device)

    def see(self, ids) -> None:
        """Scores these ids from the next forward pass on (until max_seen are)."""
        with self._lock:
            room = self.max_seen - len(self._known) + len(self.keep)
            for i in ids:
                if room > 0 and i not in self._known and 0 <= i < self.vocab_size:
                    self._known.add(i)
                    self._pending.add(i)
                    room -= 1

    @torch.no_grad()
    def _fold(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, set()
        ids = torch.tensor(sorted(pending), dtype=torch.long, device=self._seen_ids.device)
        weight, bias = self._full
        self._seen_ids = torch.cat([self._seen_ids, ids])
        self._seen_rows = torch.cat([self._seen_rows, weight[ids].float()])
        if bias is not None:
            self._seen_bias = torch.cat([self._seen_bias, bias[ids].float()])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._pending:
            self._fold()
        kept = self.inner(hidden)
        out = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf")).index_copy_(-1, self.keep, kept)
        if len(self._seen_ids):
            seen = hidden.float() @ self._seen_rows.T
            if self._full[1] is not None:
                seen += self._seen_bias
            out.index_copy_(-1, self._seen_ids, seen.to(out.dtype))
        return out


def kept_ids(size: int, vocab_size: int, always: Iterable[int]) -> torch.Tensor:
    """The ids a layer trimmed to `size` keeps, ascending: the first `size`, and `always`."""
    return torch.tensor(sorted(set(range(min(size, vocab_size))) | {i for i in always if 0 <= i < vocab_size}))


def trim_output(model: torch.nn.Module, size: int, always: Iterable[int]) -> int:
    """Replaces `model`'s output layer with a TrimmedHead keeping `kept_ids(size, ...)`, before its
    Linear layers are quantized or packed (the kept rows are then an ordinary Linear layer's). The
    copy of a tied layer's rows no longer follows the embedding. Returns how many ids the layer
    computes: all of them, unchanged, when `size` is 0 or covers the vocabulary."""
    head = model.get_output_embeddings()
    if size <= 0 or size >= head.out_features:
        return head.out_features
    if type(head) is not torch.nn.Linear:
        raise ValueError(f"cannot trim an output layer of type {type(head).__name__}")
    keep = kept_ids(size, head.out_features, always)
    model.set_output_embeddings(TrimmedHead(head, keep))
    model.config.tie_word_embeddings = False
    return len(keep)


def see(model: torch.nn.Module, ids) -> None:
    """Tells a trimmed output layer of `model` these token ids occur (nothing for a whole one)."""
    head = model.get_output_embeddings()
    if isinstance(head, TrimmedHead):
        head.see(ids)

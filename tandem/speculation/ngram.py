"""Prompt lookup (n-gram drafting): the rule both the draft pool's n-gram drafter and the verify
worker's head use. The context's last n tokens (n = max_ngram down to min_ngram) are looked up at
their latest earlier occurrence, and what followed it is proposed."""

from __future__ import annotations


def lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier occurrence of the longest matching suffix,
    the suffix's length n); ([], 0) when nothing matches."""
    if k <= 0:
        return [], 0
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = context[n_ctx - n:]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start:start + n] == tail:
                follow = context[start + n:start + n + k]
                if follow:
                    return follow, n
    return [], 0

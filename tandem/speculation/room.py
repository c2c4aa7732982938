"""How many tokens a proposal may still hold: the one rule for the draft worker's rounds, its
streamed runs and their branches."""

from __future__ import annotations


def left(known: int, prompt_len: int, max_new_tokens: int, max_context: int) -> int:
    """Tokens a line of `known` tokens (the prompt's included) may still propose: each verdict also
    adds one token of the target's own, within max_new_tokens and the context window."""
    return min(max_new_tokens - (known - prompt_len) - 1, max_context - known - 1)


def plan_k(requested: int, context_len: int, generated: int, max_new_tokens: int,
           max_context: int, max_proposal: int) -> int:
    """How many tokens to propose this round: the requested k within what can still be used and
    the verify worker's most."""
    return max(0, min(requested, left(context_len, context_len - generated, max_new_tokens, max_context),
                      max_proposal))

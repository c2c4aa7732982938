"""Streamed proposals: the rules both workers keep for the tokens proposed beyond a session's
committed ones (the run), so that they agree without waiting on each other.

A draft worker on hardware of its own drafts on while the target verifies. It sends each proposed
token (or a few) as a piece the moment it has it, placed by the index its first token takes and the
token before it. The verify worker verifies whatever part of the run has arrived each time it is
free. A verdict commits the accepted tokens and the target's own next token; whatever the run holds
beyond them stands only if the run begins with exactly those tokens, on both sides alike.
"""

from __future__ import annotations


def after_verdict(run: list[int], committed: list[int]) -> list[int]:
    """What stays proposed after a verdict committed `committed` (accepted tokens + the target's
    own): the rest of the run when the run began with them, else nothing (the target went
    another way, and whatever was drafted after the fork is void)."""
    n = len(committed)
    return run[n:] if run[:n] == committed else []


def place(tokens: list[int], run: list[int], start: int, after: int, piece: list[int]) -> list[int] | None:
    """The run with a streamed piece added: `piece` takes indices start.. of tokens + run, and the
    drafter had `after` at index start - 1. The piece may overlap the end of what is known (a verdict
    committed part of it first); the overlap must agree. None when the piece does not continue the
    known sequence: drafted on a path a verdict has left, or after a piece that was dropped."""
    known = len(tokens) + len(run)
    if not 1 <= start <= known:
        return None

    def at(i: int) -> int:
        return tokens[i] if i < len(tokens) else run[i - len(tokens)]

    if at(start - 1) != after:
        return None
    overlap = min(len(piece), known - start)
    if any(at(start + j) != piece[j] for j in range(overlap)):
        return None
    return run + piece[overlap:]

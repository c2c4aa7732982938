"""Decides each round whether to speculate (propose the requested k) or decode plainly (k = 0).

The goal is goodput: tokens per second of wall time, not acceptance. Each round is timed where it
is paid for, on the draft worker: drafting plus the verify round trip. The controller keeps a
decaying rate for speculative rounds and one for plain rounds (seeded from the verify worker's
measured one-position forward pass) and speculates while that pays. When it stops paying (a weak
n-gram match, a draft that keeps missing) it decodes plainly for a while, then tries one
speculative round again, waiting twice as long after each try that still loses.

How long a proposal runs is left to the drafter: the model drafter stops after a token it is
unsure of (`--confidence`), which follows the text far better than a k chosen in advance. An
earlier controller chose k from a per-token acceptance rate and the verify cost curve; on code,
where acceptance comes in long runs, it proposed too little and lost 15% against a fixed k.
"""

from __future__ import annotations


class _Rate:
    """Tokens per second over recent rounds, older rounds weighing less."""

    def __init__(self, decay: float) -> None:
        self.decay, self.tokens, self.seconds = decay, 0.0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds

    @property
    def value(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class SpeculationController:
    def __init__(self, plain_ms: float, decay: float = 0.8, backoff: int = 4, max_backoff: int = 64) -> None:
        """plain_ms: one plain decode round as the verify worker measured it (the prior for plain)."""
        self.speculative, self.plain = _Rate(decay), _Rate(decay)
        self.plain.add(1, plain_ms / 1000)
        self.min_backoff, self.max_backoff = backoff, max_backoff
        self.backoff = backoff
        self.plain_rounds_left = 0

    def choose(self, k: int) -> int:
        """k, or 0 while plain decoding is the faster of the two."""
        if k <= 0 or self.plain_rounds_left > 0:
            self.plain_rounds_left = max(0, self.plain_rounds_left - 1)
            return 0
        return k

    def observe(self, proposed: int, tokens: int, seconds: float) -> None:
        """One finished round: tokens it produced (accepted + the target's own), seconds it took."""
        if proposed == 0:
            self.plain.add(tokens, seconds)
            return
        self.speculative.add(tokens, seconds)
        if self.speculative.value < self.plain.value:
            self.plain_rounds_left = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
        else:
            self.backoff = self.min_backoff


def controller_for(verify_ms: list[float]) -> SpeculationController | None:
    """None (always propose the requested k) when the verify worker did not measure its costs."""
    if not verify_ms:
        return None
    return SpeculationController(verify_ms[0])

"""Chooses how many tokens to propose each round, k = 0 (plain decoding) included.

A round that proposes k tokens gains, in expectation, (1 - a^(k+1)) / (1 - a) tokens when each
proposed token is accepted with probability a (Leviathan et al. 2023), and costs k draft steps plus
one verify pass over k+1 positions. The controller picks the k that maximizes tokens per
millisecond from the verify worker's measured cost curve, the draft's step time, and this
session's acceptance so far. Speculation that does not pay (a weak n-gram match, a draft that keeps
missing) falls back to k = 0 instead of making the request slower than plain decoding.

The acceptance estimate is a decaying count of accepted and rejected proposed tokens plus a prior,
so after a run of k = 0 rounds it drifts back toward the prior and speculation is tried again.
"""

from __future__ import annotations


class SpeculationController:
    def __init__(self, verify_ms: list[float], draft_ms: float, prior: float = 0.7,
                 prior_weight: float = 2.0, decay: float = 0.9) -> None:
        """verify_ms[i]: one verify pass over i+1 positions; draft_ms: one draft step."""
        self.verify_ms = verify_ms
        self.draft_ms = draft_ms
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.accepted = 0.0          # decayed count of proposed tokens accepted
        self.rejected = 0.0          # decayed count of rejections (at most one per round)

    @property
    def acceptance(self) -> float:
        return ((self.accepted + self.prior * self.prior_weight)
                / (self.accepted + self.rejected + self.prior_weight))

    def expected_tokens(self, k: int) -> float:
        """Tokens a round of k proposed tokens gains on average, the bonus token included."""
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def cost_ms(self, k: int) -> float:
        return k * self.draft_ms + self.verify_ms[k]

    def choose(self, k_max: int) -> int:
        """The best k in 0..k_max (as far as the cost curve reaches)."""
        k_max = min(k_max, len(self.verify_ms) - 1)
        if k_max <= 0:
            return max(0, k_max)
        return max(range(k_max + 1), key=lambda k: self.expected_tokens(k) / self.cost_ms(k))

    def observe(self, proposed: int, accepted: int) -> None:
        self.accepted *= self.decay
        self.rejected *= self.decay
        if proposed:
            self.accepted += accepted
            self.rejected += accepted < proposed


def controller_for(verify_ms: list[float], draft_ms: float | None) -> SpeculationController | None:
    """None (always propose the requested k) when either worker did not measure its costs."""
    if not verify_ms or draft_ms is None:
        return None
    return SpeculationController(list(verify_ms), draft_ms)

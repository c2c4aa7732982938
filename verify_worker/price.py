"""What one more position in a batched pass costs everyone: the `token_cost` sent with each verdict.

Adding a position to a pass lengthens it by the marginal seconds per position (beta), and during
that time the worker would have produced beta * R tokens, R being the tokens per second it produces
now. So a proposed position pays off only if it is accepted with probability above beta * R (the
draft worker's controller applies this). beta comes from a least-squares fit of pass time against
the pass's round tokens and its prefill tokens (prefill runs cheaper per token, and would drag a
one-variable slope down), over recent passes so that it describes the sizes the worker runs now; R
is a decaying count of the tokens verdicts gave out.
"""

from __future__ import annotations

import math
import time

import numpy as np


class TokenPrice:
    def __init__(self, decay: float = 0.95, horizon_s: float = 2.0) -> None:
        self.decay, self.horizon = decay, horizon_s
        self._xx = np.zeros((3, 3))                               # decayed normal equations of
        self._xy = np.zeros(3)                                    # seconds ~ 1, rounds, prefill
        self._count, self._at = 0.0, time.monotonic()            # decayed tokens given out

    def observe_pass(self, round_tokens: int, prefill_tokens: int, seconds: float) -> None:
        x = np.array([1.0, round_tokens, prefill_tokens])
        self._xx = self._xx * self.decay + np.outer(x, x)
        self._xy = self._xy * self.decay + x * seconds

    def observe_output(self, tokens: int) -> None:
        now = time.monotonic()
        self._count = self._count * math.exp((self._at - now) / self.horizon) + tokens
        self._at = now

    @property
    def beta(self) -> float:
        """Marginal seconds per round position (0 until passes of different sizes were seen)."""
        if self._xx[0, 0] < 2 or self._xx[1, 1] * self._xx[0, 0] - self._xx[0, 1] ** 2 < 1e-9:
            return 0.0
        ridge = 1e-6 * np.eye(3) * max(1.0, float(np.trace(self._xx)))   # prefill never seen: stays solvable
        return max(0.0, float(np.linalg.solve(self._xx + ridge, self._xy)[1]))

    @property
    def rate(self) -> float:
        """Tokens per second given out lately."""
        return self._count * math.exp((self._at - time.monotonic()) / self.horizon) / self.horizon

    @property
    def value(self) -> float:
        return min(1.0, self.beta * self.rate)

"""What one more position in a batched pass costs everyone: the `token_cost` sent with each verdict.

Adding a position to a pass lengthens it by the marginal seconds per position (beta), and during
that time the worker would have produced beta * R tokens, R being the tokens per second it produces
now. So a proposed position pays off only if it is accepted with probability above beta * R (the
draft worker's controller applies this). beta is the slope of pass time against pass tokens, fitted
over recent passes so that it describes the sizes the worker runs now; R is a decaying count of the
tokens verdicts gave out.
"""

from __future__ import annotations

import math
import time


class TokenPrice:
    def __init__(self, decay: float = 0.95, horizon_s: float = 2.0) -> None:
        self.decay, self.horizon = decay, horizon_s
        self._n = self._t = self._y = self._tt = self._ty = 0.0   # decayed regression sums
        self._count, self._at = 0.0, time.monotonic()            # decayed tokens given out

    def observe_pass(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n, self._t, self._y = self._n * d + 1, self._t * d + tokens, self._y * d + seconds
        self._tt, self._ty = self._tt * d + tokens * tokens, self._ty * d + tokens * seconds

    def observe_output(self, tokens: int) -> None:
        now = time.monotonic()
        self._count = self._count * math.exp((self._at - now) / self.horizon) + tokens
        self._at = now

    @property
    def beta(self) -> float:
        """Marginal seconds per position (0 until passes of different sizes were seen)."""
        var = self._tt * self._n - self._t * self._t
        if self._n < 2 or var <= 1e-9 * max(1.0, self._tt * self._n):
            return 0.0
        return max(0.0, (self._ty * self._n - self._t * self._y) / var)

    @property
    def rate(self) -> float:
        """Tokens per second given out lately."""
        return self._count * math.exp((self._at - time.monotonic()) / self.horizon) / self.horizon

    @property
    def value(self) -> float:
        return min(1.0, self.beta * self.rate)

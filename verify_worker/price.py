"""What one more position in a batched pass costs everyone: the `token_cost` sent with each verdict.

Adding a position to a pass lengthens it by the marginal seconds per position (beta), and during
that time the worker would have produced beta * R tokens, R being the tokens it produces per second
of forward passes. So a proposed position pays off only if it is accepted with probability above
beta * R (the draft worker's controller applies this). beta comes from a least-squares fit of pass
time against the pass's round tokens and its prefill tokens (prefill runs cheaper per token, and
would drag a one-variable slope down), over recent passes so that it describes the sizes the worker
runs now. R counts pass time, not wall time: a worker slowed by waste (half-empty passes, rejected
positions) would otherwise show a low R and so a low price, inviting more of the speculation that
slowed it down.
"""

from __future__ import annotations


class TokenPrice:
    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        # decayed normal equations of seconds ~ 1, round tokens, prefill tokens; plain Python: a
        # BLAS call here would start a BLAS thread pool on the event loop's thread, next to torch's
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._out = self._busy = 0.0        # decayed tokens given out and seconds of passes
        self._pending = 0                   # tokens given out since the last pass was observed

    def observe_pass(self, round_tokens: int, prefill_tokens: int, seconds: float) -> None:
        x = (1.0, float(round_tokens), float(prefill_tokens))
        for i in range(3):
            self._xy[i] = self._xy[i] * self.decay + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * self.decay + x[i] * x[j]
        self._out = self._out * self.decay + self._pending
        self._busy = self._busy * self.decay + seconds
        self._pending = 0

    def observe_output(self, tokens: int) -> None:
        self._pending += tokens

    @property
    def beta(self) -> float:
        """Marginal seconds per round position (0 until passes of different sizes were seen)."""
        xx = self._xx
        if xx[0][0] < 2 or xx[1][1] * xx[0][0] - xx[0][1] ** 2 < 1e-9:
            return 0.0
        ridge = 1e-6 * max(1.0, xx[0][0] + xx[1][1] + xx[2][2])   # prefill never seen: stays solvable
        a = [[xx[i][j] + (ridge if i == j else 0.0) for j in range(3)] for i in range(3)]
        with_y = [[self._xy[i] if j == 1 else a[i][j] for j in range(3)] for i in range(3)]
        return max(0.0, _det3(with_y) / _det3(a))             # Cramer's rule for the slope

    @property
    def rate(self) -> float:
        """Tokens given out per second of forward passes, lately."""
        return self._out / self._busy if self._busy > 0 else 0.0

    @property
    def value(self) -> float:
        return min(1.0, self.beta * self.rate)


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

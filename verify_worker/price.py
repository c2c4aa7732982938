"""What one more position in a batched pass costs everyone: the `token_cost` sent with each verdict.

Adding a position to a pass lengthens it by the marginal seconds per position (beta), and during
that time the worker would have produced beta * R tokens, R being what a second of forward passes
is worth in tokens. So a proposed position pays off only if it is accepted with probability above
beta * R (the draft worker's controller applies this). beta comes from a least-squares fit of pass
time against the pass's round tokens and its prefill tokens (prefill runs cheaper per token, and
would drag a one-variable slope down), over recent passes so that it describes the sizes the worker
runs now.

R is the larger of two rates. The tokens the worker gave out per second of forward passes (pass
time, not wall time: idle time is worth nothing). And what plain decoding of the same sessions
would give: S tokens per pass of S positions, S / (alpha + beta * S) from the same fit. The second
is the floor because the first describes the current passes: when proposals fill them with
rejected positions the measured rate drops, and a price from it would invite the very speculation
that slowed the worker down. Under load plain decoding is the opportunity cost of a pass-second.

The price a verdict carries (`for_batch`) takes the plain rate for the size of the pass it came
from. And the fit describes the passes the worker ran lately: when many sessions arrive at once
after a quiet spell, the passes it knows held a few positions each, which on a CPU cost about the
same however many there are (reading the weights takes the time), so beta is near 0. A pass of at
least as many sessions as the start-up calibration fed positions (`floor_from`) is priced at no
less than the slope the calibration measured at its longest inputs (`floor_beta`).
"""

from __future__ import annotations


class TokenPrice:
    def __init__(self, decay: float = 0.95, floor_beta: float = 0.0, floor_from: int = 0) -> None:
        self.decay = decay
        self.floor_beta, self.floor_from = floor_beta, floor_from
        # decayed normal equations of seconds ~ 1, round tokens, prefill tokens; plain Python: a
        # BLAS call here would start a BLAS thread pool on the event loop's thread, next to torch's
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._out = self._busy = 0.0        # decayed tokens given out and seconds of passes
        self._sessions = self._passes = 0.0  # decayed sessions in passes (rounds) and passes
        self._pending = 0                   # tokens given out since the last pass was observed

    def observe_pass(self, round_tokens: int, prefill_tokens: int, seconds: float, sessions: int = 0) -> None:
        """One pass: its round (not prefill) tokens, prefill tokens, seconds, and the sessions that
        had a round in it."""
        x = (1.0, float(round_tokens), float(prefill_tokens))
        for i in range(3):
            self._xy[i] = self._xy[i] * self.decay + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * self.decay + x[i] * x[j]
        self._out = self._out * self.decay + self._pending
        self._busy = self._busy * self.decay + seconds
        self._sessions = self._sessions * self.decay + sessions
        self._passes = self._passes * self.decay + 1
        self._pending = 0

    def observe_output(self, tokens: int) -> None:
        self._pending += tokens

    def _fit(self) -> tuple[float, float] | None:
        """(alpha, beta): seconds of a pass with no round tokens, and per round token; None until
        passes of different sizes were seen."""
        xx = self._xx
        if xx[0][0] < 2 or xx[1][1] * xx[0][0] - xx[0][1] ** 2 < 1e-9:
            return None
        a = [row[:] for row in xx]
        a[2][2] += 1e-6 * max(1.0, xx[0][0] + xx[1][1] + xx[2][2])   # prefill never seen: stays solvable
        det = _det3(a)
        solved = []
        for col in range(2):                                  # Cramer's rule, intercept and slope
            m = [[self._xy[i] if j == col else a[i][j] for j in range(3)] for i in range(3)]
            solved.append(_det3(m) / det)
        return max(0.0, solved[0]), max(0.0, solved[1])

    @property
    def beta(self) -> float:
        """Marginal seconds per round position (0 until passes of different sizes were seen)."""
        fit = self._fit()
        return fit[1] if fit else 0.0

    @property
    def rate(self) -> float:
        """Tokens given out per second of forward passes, lately."""
        return self._out / self._busy if self._busy > 0 else 0.0

    @property
    def plain_rate(self) -> float:
        """Tokens per second of passes if every session of the recent passes decoded plainly."""
        return self._plain_rate(self._fit())

    def _plain_rate(self, fit: tuple[float, float] | None) -> float:
        if fit is None or not self._passes:
            return 0.0
        return _plain(*fit, self._sessions / self._passes)

    @classmethod
    def calibrated(cls, forward_ms: list[float]) -> TokenPrice:
        """A price floored by the slope of the start-up calibration's upper half (forward_ms[i]:
        a pass of i + 1 new tokens); no floor without one."""
        n = len(forward_ms)
        if n < 4:
            return cls()
        half = n // 2
        return cls(floor_beta=max(0.0, (forward_ms[-1] - forward_ms[half - 1]) / (n - half) / 1000), floor_from=n)

    @property
    def value(self) -> float:
        fit = self._fit()                       # solved once: value is read for every verdict
        return min(1.0, (fit[1] if fit else 0.0) * max(self.rate, self._plain_rate(fit)))

    def for_batch(self, sessions: int) -> float:
        """The price a session pays in a pass of `sessions`: others' share of it (0 alone). The
        plain rate is that of a pass of this many sessions, not of the recent passes' mean: when
        64 sessions arrived after passes of a few, the mean priced their first rounds at 0.2 and
        every one proposed 8 positions."""
        fit = self._fit()
        alpha, beta = fit if fit else (0.0, 0.0)
        if self.floor_from and sessions >= self.floor_from:
            beta = max(beta, self.floor_beta)
        rate = max(self.rate, _plain(alpha, beta, sessions))
        return min(1.0, beta * rate) * (1 - 1 / max(1, sessions))


def _plain(alpha: float, beta: float, sessions: float) -> float:
    """Tokens per second of passes in which `sessions` sessions decode plainly, by the fit."""
    seconds = alpha + beta * sessions
    return sessions / seconds if seconds > 0 else 0.0


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

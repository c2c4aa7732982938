"""What one more position in a batched pass costs everyone: the `token_cost` sent with each verdict.

Adding a position to a pass lengthens it by the marginal seconds per position (beta), and during
that time the worker would have produced beta * R tokens, R being what a second of forward passes
is worth in tokens. So a proposed position pays off only if it is accepted with probability above
beta * R (the draft worker's controller applies this). beta comes from the pass-time curve the
worker measured at start-up (below), or without one from a least-squares fit of pass time against
the pass's round tokens and its prefill tokens (prefill runs cheaper per token, and would drag a
one-variable slope down) over recent passes.

R is the larger of two rates. The tokens the worker gave out per second of forward passes (pass
time, not wall time: idle time is worth nothing). And what plain decoding of the same sessions
would give: S tokens per pass of S positions. The second
is the floor because the first describes the current passes: when proposals fill them with
rejected positions the measured rate drops, and a price from it would invite the very speculation
that slowed the worker down. Under load plain decoding is the opportunity cost of a pass-second.

The price a verdict carries (`for_batch`) is for the pass it came from: S sessions, P positions.
With the start-up calibration's curve of pass time by size (`CausalLM.calibrate_passes`), beta is
what a few more positions per session add to a pass of P, per position, (T(P + 4S) - T(P)) / 4S,
and the plain rate S / T(S); the curve is scaled by how much slower or faster the passes run now
than at start-up. On
a CPU the curve bends (flat up to a few dozen positions, then rising with each one), and a line
fitted through the passes of the last minutes cannot follow the bend: it overrates a position's
cost in a large pass, and the controller then decodes plainly where short proposals would pay
(measured in docs/benchmarks.md, "Measurements behind the code's rules"). Without a curve
(--no-calibrate) the fitted line serves.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.service import metrics

# A position's cost is the mean over this many more positions per session: proposals run to a few
# positions, and the curve's local slope swings with its knee and its noise, so that the slope over
# a single position would make the price swing from pass to pass (see docs/benchmarks.md,
# "Measurements behind the code's rules").
SPAN = 4


class TokenPrice:
    def __init__(self, decay: float = 0.95, curve: list[tuple[int, float]] | None = None,
                 alone: Callable[[int], float] | None = None) -> None:
        """curve: (positions, milliseconds) of passes measured at start-up (`CausalLM.pass_ms`: S
        sessions of one position each), at least 3 sizes; without one the fitted line serves.
        alone: seconds of one session's pass of n new tokens as calibrated (`CausalLM.pass_seconds`)."""
        self.decay = decay
        self.curve = [(p, ms / 1000) for p, ms in curve] if curve and len(curve) >= 3 else None
        self.alone = alone
        self._seen = self._expected = 0.0   # decayed seconds of passes, and the curve's for them
        # decayed normal equations of seconds ~ 1, round tokens, prefill tokens; plain Python: a
        # BLAS call here would start a BLAS thread pool on the event loop's thread, next to torch's
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._out = self._busy = 0.0        # decayed tokens given out and seconds of passes
        self._pending = 0                   # tokens given out since the last pass was observed
        self._last = (1, 1)                 # sessions and positions of the last pass

    def observe_pass(self, round_tokens: int, prefill_tokens: int, seconds: float, sessions: int = 0) -> None:
        """One pass: its round (not prefill) tokens, prefill tokens, seconds, and the sessions that
        had a round in it."""
        x = (1.0, float(round_tokens), float(prefill_tokens))
        for i in range(3):
            self._xy[i] = self._xy[i] * self.decay + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * self.decay + x[i] * x[j]
        if self.curve:
            self._seen = self._seen * self.decay + seconds
            self._expected = self._expected * self.decay + self.calibrated_seconds(round_tokens + prefill_tokens)
        self._out = self._out * self.decay + self._pending
        self._busy = self._busy * self.decay + seconds
        self._pending = 0
        self._last = (max(1, sessions), max(1, round_tokens + prefill_tokens))

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

    def calibrated_seconds(self, positions: int, sessions: int = 0) -> float | None:
        """A pass of `positions` new tokens at the speed measured at start-up: one session's
        (sessions 1), that length's time; else the curve's by positions (None without one)."""
        if sessions == 1 and self.alone is not None and positions > 0:
            return self.alone(positions)
        return _interpolate(self.curve, positions) if self.curve else None

    @property
    def rate(self) -> float:
        """Tokens given out per second of forward passes, lately."""
        return self._out / self._busy if self._busy > 0 else 0.0

    def _costs(self, sessions: int, positions: int) -> tuple[float, float]:
        """(seconds per position that a few more positions per session add to a pass of `sessions`
        and `positions`; tokens per second of passes if those sessions decoded plainly)."""
        if self.curve:
            scale = self._seen / self._expected if self._expected > 0 else 1.0
            t = lambda p: scale * _interpolate(self.curve, p)        # noqa: E731
            added = SPAN * sessions
            return (t(positions + added) - t(positions)) / added, sessions / t(sessions)
        fit = self._fit()
        if fit is None:
            return 0.0, 0.0
        alpha, beta = fit
        return beta, sessions / (alpha + beta * sessions) if alpha + beta * sessions > 0 else 0.0

    def position_seconds(self, sessions: int, positions: int) -> float:
        """What a position adds to a pass of this size (0 until it is known)."""
        return self._costs(max(1, sessions), max(1, positions))[0]

    def for_batch(self, sessions: int, positions: int = 0) -> float:
        """The price a session pays in a pass of `sessions` and `positions` (at least one each):
        others' share of what a position costs (0 alone). The verify worker passes the sessions it
        serves when more than the pass held: while many streams start, the first verdicts come from
        passes of a few sessions each; priced for those, every session's first proposal would run
        long, and the passes that then hold all the sessions together would be long and slow (see
        docs/benchmarks.md, "Measurements behind the code's rules")."""
        sessions = max(1, sessions)
        beta, plain = self._costs(sessions, max(sessions, positions))
        return min(1.0, beta * max(self.rate, plain)) * (1 - 1 / sessions)

    @property
    def value(self) -> float:
        """The price in a pass like the last one."""
        return self.for_batch(*self._last)


def report_pass_speed(price: TokenPrice, sessions: int, tokens: int, prefill: int, seconds: float) -> None:
    """A batcher observer: one pass's seconds beside what the start-up calibration gives for a pass
    of its shape (tandem_verify_pass_seconds_total, measured and calibrated)."""
    calibrated = price.calibrated_seconds(tokens + prefill, 0 if prefill else sessions)
    if calibrated is not None:
        metrics.PASS_SECONDS.labels("measured").inc(seconds)
        metrics.PASS_SECONDS.labels("calibrated").inc(calibrated)


def _interpolate(curve: list[tuple[int, float]], x: float) -> float:
    """The curve's seconds at x positions: straight between measured sizes, and on from the last
    two beyond them (at least as long as the longest measured)."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = curve[-2], curve[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (x - x1)


def _det3(m: list[list[float]]) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))

"""Decides each round whether to speculate (propose the requested k) or decode plainly (k = 0).

The goal is goodput: tokens per second of wall time, not acceptance. Each round is timed where it
is paid for, on the draft worker: drafting plus the verify round trip. The controller keeps a
decaying rate for speculative rounds and one for plain rounds (seeded from the verify worker's
measured one-position forward pass, then fed by plain rounds and, for each speculative round, by
what a plain round in the same pass would have taken: `plain_instead`) and speculates while that
pays. When it stops paying (a weak
n-gram match, a draft that keeps missing) it decodes plainly for a while, then tries one
speculative round again, waiting twice as long after each try that still loses.

How long a proposal runs is left to the drafter: the model drafter stops after a token it is
unsure of (`--confidence`), which follows the text far better than a k chosen in advance. A k
chosen from a per-token acceptance rate and the verify cost curve assumes tokens are accepted
independently; on code acceptance comes in long runs, and such a k proposes too little (an earlier
controller did so and lost against a fixed k: see docs/benchmarks.md, "Measurements behind the
code's rules").

Acceptance is kept per kind of proposal when the drafter says what kind it drafted: the n-gram
drafter's proposals that follow a long match are accepted far more often than those after a short
one (see docs/benchmarks.md, "Measurements behind the code's rules"), and one rate for both would
cut the good ones and let the poor ones through. Such a drafter proposes the most it may, and
`fit` cuts the proposal to what its kind is worth.

Under load a proposal also costs the other sessions: each position it adds to a batched pass
delays every session in it. The verify worker sends that price with each verdict (`token_cost`:
its marginal seconds per position in a pass times the tokens it produces per second of passes). Position j
of a proposal is worth its place only if the chance that the target accepts the proposal through
j exceeds that price, so k is cut to the positions whose measured acceptance does. At low load the
price is near 0 and nothing is cut; when the verify worker is saturated it nears 1 and proposals
stop, which is why speculation no longer slows a busy worker down.

A session alone in its passes pays for its own positions: each one adds the pass's marginal time
per position, which costs as many tokens as a plain step makes in that time. So a position must
also be accepted more often than that share of a plain step (`own_price`, from the verify worker's
calibrated pass lengths). Where a pass's cost is flat (a GPU) it is near 0; where the target's own
step is cheap against its extra positions (int8 on a CPU) it cuts proposals that are rarely
accepted, and the trial rounds of a drafter that keeps missing.
"""

from __future__ import annotations

from tandem.speculation.survival import Survival, position_ms


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
    def __init__(self, plain_ms: float, decay: float = 0.8, backoff: int = 4, max_backoff: int = 64,
                 prior: dict | None = None, price: float = 0.0, position_ms: float = 0.0) -> None:
        """plain_ms: one plain decode round as the verify worker measured it (the prior for plain);
        position_ms: what each proposed position adds to that pass.
        prior: the acceptance of this drafter's recent proposals across sessions by kind, which a
        session starts from (weighing 4 proposals) and adds its own to; price: the verify worker's
        token_cost when the session opened."""
        self.prior = prior
        self.survivals: dict = {}        # by kind of proposal (None: the drafter names no kinds)
        self.kind = None                 # of the last proposal fitted
        self.probe = False               # this round tries one position even if none pays
        self.price = price               # the verify worker's last token_cost
        self.own_price = max(0.0, position_ms) / plain_ms if plain_ms > 0 else 0.0
        self.speculative, self.plain = _Rate(decay), _Rate(decay)
        self.plain.add(1, plain_ms / 1000)
        self.min_backoff, self.max_backoff = backoff, max_backoff
        self.backoff = backoff
        self.plain_rounds_left = 0
        self.trial = False
        self.opening = True              # the first round is plain: see choose

    @property
    def position_price(self) -> float:
        """What a proposed position must be accepted more often than: the verify worker's price
        (its cost to the other sessions of the pass), or this session's own when higher."""
        return max(self.price, self.own_price)

    @property
    def survival(self) -> Survival:
        """Acceptance of proposals of no named kind."""
        return self._survival(None)

    def _survival(self, kind) -> Survival:
        s = self.survivals.get(kind)
        if s is None:
            shared = self.prior.setdefault(kind, Survival()) if self.prior is not None else None
            s = self.survivals[kind] = shared.copy(4) if shared is not None else Survival()
        return s

    def _kinds(self) -> list[Survival]:
        """Every kind of proposal seen so far, by this session or the prior."""
        kinds = {kind for kind in (*self.survivals, *(self.prior or ())) if kind is not None}
        return [self._survival(kind) for kind in kinds or {None}]

    def choose(self, k: int) -> int:
        """k cut to the positions worth their price, or 0 while plain decoding is the faster. The
        first round after a stretch of plain ones tries the full k, so that a draft (or a worker)
        that got better is noticed."""
        if k <= 0:
            return 0
        if self.opening:
            # The first token comes from the prompt's prefill pass alone, as without speculation:
            # a first proposal (drafted first, then verified with the prefill) only delays it,
            # by seconds under load. Its round is not timed as a plain one (it holds the prefill).
            return 0
        if self.plain_rounds_left > 0:
            self.plain_rounds_left -= 1
            self.trial = self.plain_rounds_left == 0
            return 0
        kinds = self._kinds()
        worth = max(s.worth(k, self.position_price) for s in kinds)   # of the best kind
        if self.trial:               # full k, but still only the positions that pay their price
            self.trial = False
            if worth or any(s.hopeful(self.position_price) for s in kinds):
                self.probe = not worth
                return max(1, worth)
            # Not even one position could pay (a busy worker): no probe, a longer plain run. Under
            # load such probes would be a large share of all proposed positions, each accepted less
            # often than its price (see docs/benchmarks.md, "Measurements behind the code's rules").
        if worth == 0:
            # The price says so, and a new price comes with every verdict: a short plain run, not
            # one twice as long as the last. Doubling here ends speculation for the rest of a
            # request after a few expensive passes (see docs/benchmarks.md, "Measurements behind
            # the code's rules").
            self.plain_rounds_left = self.min_backoff
        return worth

    def fit(self, proposed: int, kind=None) -> int:
        """How many of a drafted proposal's `proposed` positions to send: those its kind's
        acceptance says are worth their price (at least one on a probe round)."""
        self.kind = kind
        worth = self._survival(kind).worth(proposed, self.position_price)
        if self.probe and proposed:
            self.probe, worth = False, max(1, worth)
        return worth

    def plain_run(self) -> int:
        """After choose() returned 0: how many plain rounds to ask the verify worker for at once,
        this one and the ones planned after it. The next choose() is the trial round."""
        run = 1 + self.plain_rounds_left
        if self.plain_rounds_left:
            self.plain_rounds_left, self.trial = 0, True
        return run

    def _back_off(self) -> None:
        """Plain rounds after a speculative round that lost to plain decoding, ever more of them while
        speculation keeps losing."""
        self.plain_rounds_left = self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)

    def observe(self, proposed: int, tokens: int, seconds: float, accepted: int | None = None,
                price: float = 0.0, plain_seconds: float | None = None) -> None:
        """One finished round: tokens it produced (accepted + the target's own), seconds it took,
        how many proposed tokens were accepted (default: all but the target's own), the verify
        worker's token_cost sent with its verdict, and for a speculative round what a plain round
        would have taken in its place (see plain_instead), when known."""
        self.price = price
        if self.opening:
            self.opening = False
            if proposed == 0:
                return
        if proposed == 0:
            self.plain.add(tokens, seconds)
            return
        self.speculative.add(tokens, seconds)
        if plain_seconds is not None:
            self.plain.add(1, plain_seconds)
        accepted = tokens - 1 if accepted is None else accepted
        self._survival(self.kind).add(proposed, accepted)
        if self.prior is not None:
            self.prior[self.kind].add(proposed, accepted)
        if self.speculative.value < self.plain.value:
            self._back_off()
        else:
            self.backoff = self.min_backoff


def plain_instead(round_trip: float, proposed: int, position_seconds: float) -> float | None:
    """What a plain round would have taken in place of a speculative one: its round trip less what
    its proposed positions added to the pass (the verify worker's marginal seconds per position),
    and at least an even share of the pass per position. None when the worker sent no slope.

    In a batched pass a plain round waits as long as everyone else's proposals take, so the
    uncontended one-position time (the plain prior) overrates plain decoding under load; without
    this a session whose proposals were short took plain rounds that were no faster than its
    speculative ones, and fell out of step with the sessions it shared passes with."""
    if position_seconds <= 0:
        return None
    return max(round_trip - position_seconds * proposed, round_trip / (proposed + 1))


def controller_for(verify_ms: list[float], prior: dict | None = None,
                   price: float = 0.0) -> SpeculationController | None:
    """None (always propose the requested k) when the verify worker did not measure its costs."""
    if not verify_ms:
        return None
    return SpeculationController(verify_ms[0], prior=prior, price=price, position_ms=position_ms(verify_ms))

"""How often proposals are accepted through each position: what a position must beat to be worth
its place in a verify pass. The draft worker's controller keeps one per kind of proposal; the
verify worker keeps one per streamed session, where it chooses how much of the run a pass takes."""

from __future__ import annotations


class Survival:
    """How often a proposal is accepted through position j (1-based), over recent proposals that
    reached j, older ones weighing less. Each position also counts one proposal accepted at a
    prior rate: half the time for the first, and for position j the rate through j - 1 times the
    first's, as if each token were accepted alike, which follows measured acceptance closely.
    Counting unseen positions as always accepted, as this once did, sends every new session's
    proposals whole into a saturated worker (both measured in docs/benchmarks.md, "Measurements
    behind the code's rules")."""

    def __init__(self, positions: int = 64, decay: float = 0.95) -> None:
        self.decay = decay
        self.reached = [0.0] * (positions + 1)
        self.accepted = [0.0] * (positions + 1)

    def add(self, proposed: int, accepted: int) -> None:
        for j in range(1, min(proposed, len(self.reached) - 1) + 1):
            self.reached[j] = self.reached[j] * self.decay + 1
            self.accepted[j] = self.accepted[j] * self.decay + (accepted >= j)

    def copy(self, weight: float) -> Survival:
        """A copy whose counts weigh at most `weight` proposals, so that a session's own rounds soon
        outweigh it."""
        scale = min(1.0, weight / self.reached[1]) if self.reached[1] else 1.0
        c = Survival(len(self.reached) - 1, self.decay)
        c.reached = [x * scale for x in self.reached]
        c.accepted = [x * scale for x in self.accepted]
        return c

    def reach(self, k: int) -> list[float]:
        """How often a proposal is accepted through each of positions 1..k (as far as counted)."""
        out = []
        rate = first = (self.accepted[1] + 0.5) / (self.reached[1] + 1)
        for j in range(1, min(k, len(self.reached) - 1) + 1):
            if j > 1:
                rate = (self.accepted[j] + rate * first) / (self.reached[j] + 1)
            out.append(rate)
        return out

    def worth(self, k: int, price: float) -> int:
        """The longest prefix of k positions each of which is accepted more often than `price`
        (all k when there is no price: the worker has time to spare)."""
        reach = self.reach(k)
        n = worth(reach, price)
        return k if n == len(reach) else n

    def hopeful(self, price: float) -> bool:
        """Whether the first position may be accepted more often than `price`: its rate counting
        one more proposal accepted, which weighs less the more proposals were measured."""
        return price <= 0 or (self.accepted[1] + 1) / (self.reached[1] + 1) > price


def worth(reach: list[float], price: float) -> int:
    """The longest prefix of positions whose chance of being reached (all positions up to it
    accepted) beats `price`, the tokens one more position in a pass costs its other sessions (all
    of them when there is no price: the worker has time to spare)."""
    if price <= 0:
        return len(reach)
    return next((j for j, r in enumerate(reach) if r <= price), len(reach))


def position_ms(forward_ms) -> float:
    """What each proposed position adds to a verify pass, in ms: the slope of the verify worker's
    calibrated pass time by length (forward_ms[i]: i + 1 positions); 0 without a curve."""
    if len(forward_ms) < 2:
        return 0.0
    return max(0.0, (forward_ms[-1] - forward_ms[0]) / (len(forward_ms) - 1))

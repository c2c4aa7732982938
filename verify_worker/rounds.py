"""How a verify worker decodes a session by itself (DecodeRequest): each draft method it serves
itself is one `OwnDrafting`, which turns a session into its rounds' steps. The servicer runs every
method with the same loop; what differs is here and in the method's own module."""

from __future__ import annotations

from typing import Protocol

from tandem.engine.batcher import Step
from verify_worker.engine import TargetSession, VerifyEngine

# The draft methods a verify worker can serve itself (tandem.cluster.registry.VERIFY_METHODS), and
# what one that does not serve a method lacks.
OWN_METHODS = {"none": "", "head": "it has no trained head loaded (--head)"}


class OwnDrafting(Protocol):
    method: str
    span: str                  # the name of a round's trace span
    # Needs the target's hidden states of every position: no KV reused from an earlier turn (a
    # shared prefix comes with the donor's drafting state), and every pass taps them.
    reads_states: bool

    def open(self, s: TargetSession) -> object:
        """The session's drafting state (kept as s.drafting)."""

    def prefill_then(self, s: TargetSession, state, report):
        """A prefill chunk's follow-up around `report` (which turns its logits into prompt reports)."""

    def share_prefix(self, s: TargetSession, state, donors: list[TargetSession]) -> None:
        """Before the prefill, between passes: copies into s the longest prompt prefix a donor
        session (live or idle) holds that this drafting can take (VerifyEngine.share_prefix)."""

    def start(self, s: TargetSession, state) -> None:
        """After the prefill, on the inference thread: what the first round needs."""

    def step(self, s: TargetSession, state, price: float = 0.0, cap: int = 0) -> tuple[Step, list[int]]:
        """The next round's step and the tokens it proposes; `price`: what one more position costs
        the other sessions of the pass (verify_worker/price.py); `cap`: the request's most tokens
        a round proposes (num_speculative_tokens; 0: none)."""

    def propose_seconds(self) -> float | None:
        """What drafting a round takes, for the round's span (None: nothing is drafted)."""


class Plain:
    """Draft method none: the target alone, a token a round."""
    method = "none"
    span = "decode round"
    reads_states = False

    def __init__(self, engine: VerifyEngine) -> None:
        self.engine = engine

    def open(self, s: TargetSession) -> None:
        return None

    def prefill_then(self, s: TargetSession, state, report):
        return report

    def share_prefix(self, s: TargetSession, state, donors: list[TargetSession]) -> None:
        self.engine.share_prefix(s, donors)

    def start(self, s: TargetSession, state) -> None:
        pass

    def step(self, s: TargetSession, state, price: float = 0.0, cap: int = 0) -> tuple[Step, list[int]]:
        return self.engine.round_step(s, [], lambda: None, returns=True), []

    def propose_seconds(self) -> float | None:
        return None

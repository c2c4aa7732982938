"""A streamed session on the verify worker (OpenSession.stream): the draft worker's pieces gather in
a run while passes go on, and each pass verifies whatever part of the run has arrived, so that the
target never waits for a proposal to be complete. It waits when nothing has arrived and the
draft has not said it has nothing (then it decodes plainly).

A pass takes at most a proposal's worth, and under load only the positions worth their price: those
this session's runs were accepted through more often than the price one position makes the other
sessions of the pass pay (tandem/speculation/survival.py, verify_worker/price.py), and at least one.

Taking whatever has arrived beat awaiting a new chain whole, until the draft paused or a proposal's
worth had come (docs/benchmarks.md, "Choosing the streaming rules"). When the worker is alone with
the session (no price), the pass takes the length that gives the most expected tokens per second:
this session's acceptance by position against the pass's calibrated cost by length, counting for
tokens not yet arrived the time the draft takes to send them (measured between its pieces). So a
short run (right after a verdict voided the one before) is waited on briefly, since a pass costs
nearly the same for a few more positions (on some CPUs a short one is padded to a longer length
anyway), never past twice the expected time and not at all once the draft has paused; and a long
one is cut where its last positions would cost more than they are likely to give."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.speculation.stream import after_verdict, place
from tandem.speculation.survival import Survival
from tandem.v1 import internal_pb2 as pb
from verify_worker.engine import TargetSession


PRIOR_WEIGHT = 4   # proposals' worth the worker's recent streamed sessions weigh in a new one's acceptance
HALF_CLOSE_S = 2.0  # how long a finished streamed session waits for the draft side to close its side


class StreamedRun:
    def __init__(self, session: TargetSession, max_proposal: int, price: Callable[[], float] = lambda: 0.0,
                 pass_seconds: Callable[[int], float] | None = None, prior: Survival | None = None) -> None:
        """pass_seconds(n): a pass of n new tokens alone, as calibrated (None: not known, never wait).
        prior: the acceptance by position of the worker's streamed sessions, which this one starts
        from (weighing PRIOR_WEIGHT passes, so that its own soon outweigh it) and adds its passes to."""
        self.max_proposal, self.price, self.pass_seconds = max_proposal, price, pass_seconds
        self.prior = prior
        # this session's acceptance by position
        self.survival = prior.copy(PRIOR_WEIGHT) if prior is not None else Survival()
        # The session's tokens as of the last verdict, kept here: a pass commits to the session's
        # own list on the inference thread before its verdict is taken in here.
        self.tokens = list(session.tokens)
        self.run: list[int] = []        # proposed tokens beyond self.tokens, in order
        self.plain = False              # the draft has nothing: decode plainly until a piece comes
        self.ended = False              # the draft worker's side of the stream is over
        self.error: str | None = None   # what was wrong with a message it sent
        self.paused = False             # the draft sends nothing more until the next verdict
        self.gap = 0.0                  # seconds per token between the draft's pieces, a moving average
        self._last_piece: float | None = None
        self._changed = asyncio.Event()

    def add(self, proposal: pb.Proposal) -> None:
        """Takes one message: a piece (dropped when it does not continue the known tokens), or a
        pause (no tokens: the draft has nothing until the next verdict; with no run, plain steps)."""
        now = asyncio.get_running_loop().time()
        if not proposal.token_ids:
            self.plain, self.paused, self._last_piece = not self.run, True, None
        else:
            run = place(self.tokens, self.run, proposal.start, proposal.after, list(proposal.token_ids))
            if run is not None:
                self.run, self.plain, self.paused = run, False, False
            if self._last_piece is not None:
                gap = (now - self._last_piece) / len(proposal.token_ids)
                self.gap = gap if not self.gap else 0.8 * self.gap + 0.2 * gap
            self._last_piece = now
        self._changed.set()

    def end(self, error: str | None = None) -> None:
        self.ended, self.error = True, error
        self._changed.set()

    async def next(self) -> list[int] | None:
        """The tokens the next pass verifies: the start of the run, at most max_proposal and as many
        as are worth their cost (the module's rules), or none for a plain step; waits while there
        is neither. None once the stream is over."""
        while not (self.run or self.plain or self.ended):
            self._changed.clear()
            await self._changed.wait()
        if self.error is not None or (self.ended and not (self.run or self.plain)):
            return None
        n = min(len(self.run), self.max_proposal)
        if n and self.pass_seconds is not None and self.price() <= 0:
            want = self.best_length(n)
            if want > n:
                await self._fill(want)
            n = min(len(self.run), want)
        return self.run[:max(1, self.survival.worth(n, self.price())) if n else 0]

    async def _fill(self, want: int) -> None:
        """Waits, at most twice the draft's time for them, until the run holds `want` tokens."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * self.gap * (want - len(self.run))
        while len(self.run) < want and not (self.paused or self.ended) and (left := deadline - loop.time()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return

    def best_length(self, n: int) -> int:
        """The pass length (of the n tokens arrived, or more while the draft is sending) that gives
        the most expected tokens per second: each position as often as this session's runs were
        accepted through it, plus the target's own token, over the wait for any missing ones and
        the pass (fed with the last verdict's token too)."""
        reach = self.survival.reach(self.max_proposal)
        top = self.max_proposal if self.gap and not self.paused else n

        def rate(m: int) -> float:
            return (1 + sum(reach[:m])) / (max(0, m - n) * self.gap + self.pass_seconds(m + 1))
        return max(range(1, top + 1), key=rate)

    def judged(self, committed: list[int], checked: int, accepted: int) -> None:
        """After a pass that judged `checked` tokens of the run and accepted `accepted`. When all were
        accepted, the target's own next token also says whether the run's next token would have
        been: acceptance is learnt one position past the pass, so a run cut short under load can
        earn its length back."""
        if checked:
            proposed = checked
            if accepted == checked and len(committed) == accepted + 1 and len(self.run) > checked:
                proposed += 1
                accepted += self.run[checked] == committed[-1]
            self.survival.add(proposed, accepted)
            if self.prior is not None:
                self.prior.add(proposed, accepted)
        self.tokens += committed
        self.run = after_verdict(self.run, committed)


async def read_pieces(requests, run: StreamedRun) -> None:
    """Feeds the rest of a streamed session's requests into its run until the stream ends."""
    error = None
    try:
        async for req in requests:
            if req.WhichOneof("kind") != "proposal":
                error = "a streamed session takes only Proposal messages after OpenSession"
                break
            if req.proposal.parents:
                error = "a streamed session's pieces are chains: parents must be empty"
                break
            run.add(req.proposal)
    finally:
        run.end(error)

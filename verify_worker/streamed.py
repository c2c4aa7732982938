"""A streamed session on the verify worker (OpenSession.stream): the draft worker's pieces gather in
a run while passes go on. While a chain of proposals continues (a verdict left part of the run
standing) each pass verifies whatever has arrived, so that neither worker waits for the other. A new
chain (after a verdict emptied the run) is awaited whole, until the draft pauses or a proposal's
worth has come: a pass over one token costs about what one over several does, and would leave the
rest of the chain to the pass after."""

from __future__ import annotations

import asyncio

from tandem.speculation.stream import after_verdict, place
from tandem.v1 import internal_pb2 as pb
from verify_worker.engine import TargetSession


class StreamedRun:
    def __init__(self, session: TargetSession, max_proposal: int) -> None:
        self.max_proposal = max_proposal
        # The session's tokens as of the last verdict, kept here: a pass commits to the session's
        # own list on the inference thread before its verdict is taken in here.
        self.tokens = list(session.tokens)
        self.run: list[int] = []        # proposed tokens beyond self.tokens, in order
        self.more = True                # the draft said more follows (or a new chain is due)
        self.new_chain = True           # the run starts after a verdict that left nothing standing
        self.plain = False              # the draft has nothing: decode plainly until a piece comes
        self.ended = False              # the draft worker's side of the stream is over
        self.error: str | None = None   # what was wrong with a message it sent
        self._changed = asyncio.Event()

    def add(self, proposal: pb.Proposal) -> None:
        """Takes one message: a piece (dropped when it does not continue the known tokens), or a
        pause (no tokens: nothing more until the next verdict; with no run, plain steps)."""
        if not proposal.token_ids:
            self.more, self.plain = False, not self.run
        else:
            run = place(self.tokens, self.run, proposal.start, proposal.after, list(proposal.token_ids))
            if run is not None:
                self.run, self.more, self.plain = run, proposal.more, False
        self._changed.set()

    def end(self, error: str | None = None) -> None:
        self.ended, self.error = True, error
        self._changed.set()

    async def next(self) -> list[int] | None:
        """The tokens the next pass verifies: the run so far (at most max_proposal), or none for a
        plain step; waits while neither is due. None once the stream is over."""
        while not (self._ready() or self.plain or self.ended):
            self._changed.clear()
            await self._changed.wait()
        if self.error is not None or (self.ended and not (self.run or self.plain)):
            return None
        return self.run[:self.max_proposal]

    def _ready(self) -> bool:
        return bool(self.run) and not (self.new_chain and self.more and len(self.run) < self.max_proposal)

    def judged(self, committed: list[int]) -> None:
        """After a verdict: the run keeps what it leaves standing; an emptied run awaits the
        draft's next chain (or its pause), unless the draft had nothing to propose."""
        self.tokens += committed
        self.run = after_verdict(self.run, committed)
        self.new_chain = not self.run
        if self.new_chain and not self.plain:
            self.more = True


async def read_pieces(requests, run: StreamedRun) -> None:
    """Feeds the rest of a streamed session's requests into its run until the stream ends."""
    error = None
    try:
        async for req in requests:
            if req.WhichOneof("kind") != "proposal":
                error = "a streamed session takes only Proposal messages after OpenSession"
                break
            run.add(req.proposal)
    finally:
        run.end(error)

"""Streamed proposals on the draft worker (--pipeline; OpenSession.stream): drafting goes on while
the target verifies, each drafted token sent the moment it exists, so that a draft pool on hardware
of its own works while the verify pool does, and a link's round trip is not paid per round.

Two tasks per request. The drafting task extends the run (the tokens sent and not yet judged) one
model step at a time, or by a whole n-gram continuation, and sends each as a piece. It drafts on
past tokens it is unsure of (whatever it drafts while the target verifies costs the target nothing
until it arrives, and is void if a verdict goes another way), and pauses when the run holds two
proposals' worth or when it has nothing to propose; then it says so (a message without tokens), and
a verify worker with nothing to verify decodes plainly until a piece comes. The reading
task takes each verdict: the committed tokens go to the gateway, and the run keeps what a verdict
leaves standing (tandem/speculation/stream.py), the same rule the verify worker keeps. Greedy
requests only: a sampled draft must take its random numbers in an order that no timing changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from draft_worker.drafters import Drafter
from tandem.service import metrics, telemetry
from tandem.speculation.sampling import SamplingParams
from tandem.speculation.stream import after_verdict
from tandem.v1 import internal_pb2 as pb


class Speculation(Protocol):
    """What a request's speculation (draft_worker.speculation) lends its streaming."""
    tokens: list[int]             # committed: the prompt and every token the verify worker decided
    prompt: list[int]
    params: SamplingParams
    opened: pb.Opened
    drafter: Drafter
    call: object                  # the verify stream

    async def read(self) -> pb.VerifyResponse: ...
    def propose(self, tokens: list[int], k: int) -> asyncio.Future: ...
    def chunk(self, verdict: pb.Verdict, drafted: int, accepted: int) -> pb.TokenChunk: ...


AHEAD = 2      # proposals' worth of tokens the run may hold


class Streaming:
    def __init__(self, spec: Speculation) -> None:
        self.spec = spec
        self.run: list[int] = []          # sent, not yet judged
        self.fork = 0                     # verdicts that voided the run: a step drafted before one is stale
        self.paused_at = -1               # nothing more to send until a verdict after this many
        self.marked = -1                  # the verdict count when the last pause was sent
        self.failed: BaseException | None = None
        self.verdicts = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def chunks(self) -> AsyncIterator[pb.TokenChunk]:
        spec = self.spec
        self._task = asyncio.create_task(self._drafting())
        while True:
            try:
                verdict = (await spec.read()).verdict
            except BaseException:
                if self.failed is not None:
                    raise self.failed from None
                raise
            committed = list(verdict.token_ids)
            kept = after_verdict(self.run, committed)
            forked = self.run[:len(committed)] != committed
            if forked:
                self.fork += 1
                metrics.STREAMED.labels("void").inc(max(0, len(self.run) - verdict.checked))
            with telemetry.span("speculation round") as span:     # the pass's verdict, as it arrived
                if span is not None:
                    span.set_attributes(telemetry.round_attributes(
                        verdict.checked, verdict.accepted, committed, verdict.batch_size, verdict.verify_seconds))
                    span.set_attributes({"tandem.spec.streamed_run": len(self.run),
                                         "tandem.spec.run_kept": len(kept), "tandem.spec.forked": forked})
            self.run = kept
            self.verdicts += 1
            spec.tokens.extend(committed)
            self._wake.set()
            yield spec.chunk(verdict, verdict.checked, verdict.accepted)
            if verdict.stop_reason:
                return

    def _room(self) -> int:
        """Tokens the run may still take: two proposals' worth (the verify worker takes one a pass,
        so the next one is on its way while it verifies), and never past what the request may
        still produce (each verdict adds one token of the target's own) or the context window."""
        spec = self.spec
        known = len(spec.tokens) + len(self.run)
        left = min(spec.params.max_new_tokens - (known - len(spec.prompt)) - 1,
                   spec.opened.max_context - known - 1)
        return max(0, min(AHEAD * spec.opened.max_proposal - len(self.run), left))

    async def _drafting(self) -> None:
        spec = self.spec
        try:
            while True:
                seen, room = self.verdicts, self._room()
                if self.paused_at == seen or room <= 0:
                    if self.marked != seen:      # the verify worker stops waiting for more
                        self.marked = seen
                        await self._send([], 0, 0)
                    await self._next_verdict(seen)
                    continue
                fork, context = self.fork, spec.tokens + self.run
                draft, _ = await spec.propose(context, 1 if spec.drafter.uses_model else room)
                if fork != self.fork:
                    continue                     # a verdict went another way while this was drafted
                if draft.tokens:
                    self.run += draft.tokens     # before the send: its verdict may come back at once
                    await self._send(draft.tokens, len(context), context[-1])
                else:
                    self.paused_at = seen        # unless a verdict came meanwhile: then draft on
        except asyncio.CancelledError:
            raise
        except BaseException as e:               # the reading task raises it
            self.failed = e
            spec.call.cancel()

    async def _next_verdict(self, seen: int) -> None:
        """Returns once a verdict after the first `seen` has been taken in."""
        while self.verdicts == seen:
            self._wake.clear()
            await self._wake.wait()

    async def _send(self, tokens: list[int], start: int, after: int) -> None:
        metrics.STREAMED.labels("sent").inc(len(tokens))
        await self.spec.call.write(pb.VerifyRequest(proposal=pb.Proposal(token_ids=tokens, start=start,
                                                                         after=after)))

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def stop(self) -> None:
        """Ends drafting before the stream is closed for writing: no piece may follow that."""
        self.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

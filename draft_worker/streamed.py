"""Streamed proposals on the draft worker (--pipeline; OpenSession.stream): drafting goes on while
the target verifies, each drafted token sent the moment it exists, so that a draft pool on hardware
of its own works while the verify pool does, and a link's round trip is not paid per round.

Two tasks per request. The drafting task extends the run (the tokens sent and not yet judged) one
drafter step at a time (a model's step: a token, or more where it agrees with a prompt lookup's;
an n-gram step: a whole continuation), and sends each as a piece. It drafts on
past tokens it is unsure of (whatever it drafts while the target verifies costs the target nothing
until it arrives, and is void if a verdict goes another way), and pauses when the run holds two
passes' worth (a pass: the request's k, or the verify worker's most) or when it has nothing to
propose; then it says so (a message without tokens), and a verify worker with nothing to verify
decodes plainly until a piece comes. The reading
task takes each verdict: the committed tokens go to the gateway, and the run keeps what a verdict
leaves standing (tandem/speculation/stream.py), the same rule the verify worker keeps. Greedy
requests only: a sampled draft must take its random numbers in an order that no timing changes.

Prepared continuations (the SSD idea: prepare for the verdicts most likely to void the run). A
verdict that goes another way than the run leaves the target with nothing to verify until the
draft has drafted again. So a model drafter also drafts, in the same batched steps as the run (a
row each, nearly free beside the run's own), up to BRANCHES branches (all the worker's sessions
together: under load every row slows every session's step): each after the draft's
second choice at one of the run's positions where that choice is likeliest to be the target's
(the draft's probability of reaching the position times its probability of the second choice),
up to a pass's worth (the request's k, or the verify worker's most). When a verdict takes a
branch's second choice, that branch becomes the run and goes out at once; its drafting state (a
cache of its own) becomes the run's, and the old run's is spare, lending the next branch its prefix.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from draft_worker.drafters import Draft, Drafter, DraftState
from tandem.engine.kvpool import KVPoolFull
from tandem.service import metrics, telemetry
from tandem.speculation.drafting import Drawn, second_choices
from tandem.speculation.room import left
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
    state: DraftState             # the run's drafting state
    call: object                  # the verify stream

    async def read(self) -> pb.VerifyResponse: ...
    def propose(self, tokens: list[int], k: int, state: DraftState | None = None, steps: int = 0) -> asyncio.Future: ...
    def start_state(self) -> DraftState: ...
    def chunk(self, verdict: pb.Verdict, drafted: int, accepted: int) -> pb.TokenChunk: ...


AHEAD = 2      # passes' worth of tokens the run may hold
BRANCHES = 2   # continuations prepared at once, per draft worker: each adds a row to its steps
BRANCH_AT_LEAST = 0.05   # a continuation is prepared only where the draft thinks it this likely to be used


class BranchRows:
    """The branch rows a draft worker's steps may carry, all its streamed sessions together: a row
    is nearly free beside a lone session's own, but under load every row slows every session's
    step. The sessions that ask first get them."""

    def __init__(self, rows: int = BRANCHES) -> None:
        self.free = rows

    def take(self) -> bool:
        if self.free <= 0:
            return False
        self.free -= 1
        return True

    def give(self) -> None:
        self.free += 1


@dataclass
class Branch:
    """A continuation prepared for the verdict that gives the token at index `at` of the sequence
    as `alt` (the draft's second choice there) instead of the run's, drafted by its own state."""
    at: int
    alt: int
    state: DraftState
    run: list[int] = field(default_factory=list)      # drafted after alt
    drawn: list[Drawn] = field(default_factory=list)
    done: bool = False                                # the drafter has nothing more for it


class Streaming:
    def __init__(self, spec: Speculation, eos_ids: list[int], rows: BranchRows | None = None, k: int = 0) -> None:
        """rows: the worker's branch rows to prepare continuations with (None: none); k: the
        request's most tokens a pass verifies (0: the verify worker's own, max_proposal)."""
        self.spec, self.eos_ids, self.rows = spec, eos_ids, rows
        self.most = min(k or spec.opened.max_proposal, spec.opened.max_proposal)   # a pass's worth
        self.run: list[int] = []          # sent, not yet judged
        self.drawn: list[Drawn | None] = []   # per run token, how the draft chose it (None: not by a model)
        self.branches: list[Branch] = []
        self.spares: list[DraftState] = []    # drafting states no line uses now
        self.paused_at = -1               # nothing more to send until a verdict after this many
        self.marked = -1                  # the verdict count when the last pause was sent
        self.failed: BaseException | None = None
        self.verdicts = 0
        self._wake = asyncio.Event()
        self._writing = asyncio.Lock()    # pieces go out from both tasks, one write at a time
        self._task: asyncio.Task | None = None

    def release(self) -> list[DraftState]:
        """Ends the branches, their rows given back: the drafting states besides the request's own,
        to close with it."""
        states = self.spares + [b.state for b in self.branches]
        for _ in self.branches:
            self.rows.give()
        self.spares, self.branches = [], []
        return states

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
            prepared = self._judge_branches(len(spec.tokens), committed, forked)
            if forked:
                metrics.STREAMED.labels("void").inc(max(0, len(self.run) - verdict.checked))
            with telemetry.span("speculation round") as span:     # the pass's verdict, as it arrived
                if span is not None:
                    span.set_attributes(telemetry.round_attributes(
                        verdict.checked, verdict.accepted, committed, verdict.batch_size, verdict.verify_seconds))
                    span.set_attributes({"tandem.spec.streamed_run": len(self.run),
                                         "tandem.spec.run_kept": len(kept), "tandem.spec.forked": forked,
                                         "tandem.spec.prepared": prepared is not None})
            self.run, self.drawn = kept, self.drawn[len(committed):] if not forked else []
            self.verdicts += 1
            spec.tokens.extend(committed)
            if prepared is not None and not verdict.stop_reason:
                self.run, self.drawn = prepared.run, prepared.drawn
                self.spares.append(spec.state)
                spec.state = prepared.state
                if prepared.run:
                    await self._send(prepared.run, len(spec.tokens), committed[-1])
            elif prepared is not None:
                self.spares.append(prepared.state)
            self._wake.set()
            yield spec.chunk(verdict, verdict.checked, verdict.accepted)
            if verdict.stop_reason:
                return

    def _judge_branches(self, base: int, committed: list[int], forked: bool) -> Branch | None:
        """What a verdict committing `committed` after the first `base` tokens makes of the branches:
        returns the one whose second choice the verdict took (it ends there: a fork is always the
        target's own last token), taken out. A branch stays while the verdict did not reach it and
        left the run standing; any other is gone, its state spare."""
        hit, n = None, len(committed)
        for b in self.branches:
            if not forked and b.at >= base + n:
                continue
            if forked and b.at == base + n - 1:
                outcome = "hit" if committed[-1] == b.alt else "miss"
            else:
                outcome = "unused"
            metrics.PREPARED.labels(outcome).inc()
            self.rows.give()
            if outcome == "hit":
                hit = b
            else:
                self.spares.append(b.state)
        self.branches = [b for b in self.branches if not forked and b.at >= base + n]
        return hit

    def _room(self, known: int) -> int:
        """Tokens the run, `known` tokens with the committed ones, may still take: two passes' worth
        (the verify worker takes one a pass, so the next one is on its way while it verifies), and
        never past what the request may still produce."""
        return max(0, min(AHEAD * self.most - len(self.run), self._left(known)))

    def _left(self, known: int) -> int:
        """Tokens a line of `known` tokens may still propose (tandem.speculation.room.left)."""
        spec = self.spec
        return left(known, len(spec.prompt), spec.params.max_new_tokens, spec.opened.max_context)

    async def _drafting(self) -> None:
        spec = self.spec
        try:
            while True:
                seen = self.verdicts
                context = spec.tokens + self.run
                room = self._room(len(context)) if self.paused_at != seen else 0
                growing = [b for b in self.branches if self._grows(b)]
                if room <= 0 and self.marked != seen:     # the verify worker stops waiting for more
                    self.marked = seen
                    await self._send([], 0, 0)
                if room <= 0 and not growing:
                    await self._next_verdict(seen)
                    continue
                jobs = [spec.propose(context, room, steps=1)] if room > 0 else []
                forks = [context[:b.at] + [b.alt] + b.run for b in growing]
                jobs += [spec.propose(fork, 1, b.state) for fork, b in zip(forks, growing)]
                drafts = [d for d, _ in await asyncio.gather(*jobs)]
                if room > 0 and not await self._extend(context, drafts[0]) and not drafts[0].tokens:
                    self.paused_at = seen        # unless a verdict came meanwhile: then draft on
                for b, fork, draft in zip(growing, forks, drafts[-len(growing):] if growing else []):
                    if b not in self.branches:   # judged meanwhile: adopted as the run, or gone
                        await self._extend(fork, draft)
                    elif draft.tokens:
                        b.run += draft.tokens
                        b.drawn += draft.drawn
                    else:
                        b.done = True
                self._prepare()
        except asyncio.CancelledError:
            raise
        except BaseException as e:               # the reading task raises it
            self.failed = e
            spec.call.cancel()

    async def _extend(self, context: list[int], draft: Draft) -> bool:
        """Adds a draft made after `context` to the run and sends it, when the run still ends
        there (a verdict may have changed it meanwhile, or adopted the line it was drafted on)."""
        spec = self.spec
        if not draft.tokens or spec.tokens + self.run != context:
            return False
        self.run += draft.tokens                 # before the send: its verdict may come back at once
        self.drawn += draft.drawn if draft.drawn is not None else [None] * len(draft.tokens)
        await self._send(draft.tokens, len(context), context[-1])
        return True

    def _grows(self, b: Branch) -> bool:
        """Whether a branch takes another step: up to a pass's worth, not past an end of sequence."""
        if b.done or b.run[-1:] and b.run[-1] in self.eos_ids:
            return False
        return min(self.most - len(b.run), self._left(b.at + 1 + len(b.run))) > 0

    def _prepare(self) -> None:
        """Opens branches while the worker has rows for them: at the run's positions whose second
        choice the draft thinks likeliest to be the target's token there (its probability of
        reaching the position times its probability of the second choice), where likely enough."""
        if self.rows is None or not self.rows.free or not self.spec.drafter.uses_model:
            return
        if any(d is None for d in self.drawn):   # a token not drawn by the model: no estimate past it
            return
        taken, base = {b.at for b in self.branches}, len(self.spec.tokens)
        for v, i in sorted(((v, i) for v, i in second_choices(self.drawn) if base + i not in taken), reverse=True):
            if v < BRANCH_AT_LEAST or not self.rows.take():
                return
            if not self.spares:
                try:
                    self.spares.append(self.spec.start_state())
                except KVPoolFull:
                    self.rows.give()
                    return                       # no room for another line: fewer branches
            self.branches.append(Branch(base + i, self.drawn[i].alt, self.spares.pop()))

    async def _next_verdict(self, seen: int) -> None:
        """Returns once a verdict after the first `seen` has been taken in."""
        while self.verdicts == seen:
            self._wake.clear()
            await self._wake.wait()

    async def _send(self, tokens: list[int], start: int, after: int) -> None:
        metrics.STREAMED.labels("sent").inc(len(tokens))
        async with self._writing:
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

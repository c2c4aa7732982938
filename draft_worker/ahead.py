"""Drafting ahead (the draft worker's --pipeline): the next proposal is drafted while the target
verifies the last one, so that a draft pool on hardware of its own works while the verify pool does.

The guess is the likeliest verdict: every proposed token accepted, and the bonus token the draft's
own next one. A wrong guess costs at most one drafting step, never output: drafting stops at its
next step once the verdict is in, and the drafter rolls its cache back to the accepted tokens as
it does after any verdict. Greedy requests only (Speculation._drafts_ahead says why).
"""

from __future__ import annotations

import asyncio

from tandem.v1 import internal_pb2 as pb


class Ahead:
    """The next proposal, drafted while the target verifies the last one (`sent` tokens) on the
    guess that the target accepts all of them and that its bonus token is the draft's own next
    token, the first drafted here. Drafting stops at its next step once the verdict is in and
    proves the guess wrong, and once it holds `limit` tokens (the guess and the next proposal)."""

    def __init__(self, sent: int) -> None:
        self.sent = sent
        self.job: asyncio.Future | None = None
        self.verdict: pb.Verdict | None = None
        self.limit: int | None = None

    def guessed(self, verdict: pb.Verdict, drafted: list[int]) -> bool:
        return (verdict.accepted == self.sent and not verdict.stop_reason and verdict.unverified == 0
                and bool(drafted) and verdict.token_ids[-1] == drafted[0])

    def keep_going(self, drafted: list[int]) -> bool:
        """On the drafting thread: the verdict and limit are set on the event loop."""
        verdict, limit = self.verdict, self.limit
        if verdict is not None and not self.guessed(verdict, drafted):
            return False
        return limit is None or len(drafted) < limit

"""Why a generation ended: one type from the verify worker's verdict to every public face."""

from __future__ import annotations

from enum import StrEnum


class Finish(StrEnum):
    """The value is the name metrics, logs and traces carry."""
    NONE = ""                          # not finished
    LENGTH = "length"                  # max_new_tokens reached
    EOS = "eos"                        # the model produced end-of-sequence
    CONTEXT_LENGTH = "context_length"  # the model's context window is full
    GUIDE = "guide_complete"           # structured output: nothing but end-of-sequence may follow
    STOP_SEQUENCE = "stop_sequence"    # decided by the gateway, which sees text
    TIME_LIMIT = "time_limit"          # decided by the TGIS face (its time_limit_millis)
    STOP_TOKEN = "stop_token"          # decided by the gateway: one of the request's stop token ids

    @property
    def wire(self) -> int:
        """internal.proto's StopReason number: only the workers' own reasons cross it."""
        return _WIRE[self]

    @classmethod
    def from_wire(cls, number: int) -> Finish:
        """ValueError for a number internal.proto does not define."""
        for finish, n in _WIRE.items():
            if n == number:
                return finish
        raise ValueError(f"unknown stop reason {number}")


_WIRE = {Finish.NONE: 0, Finish.LENGTH: 1, Finish.EOS: 2, Finish.CONTEXT_LENGTH: 3, Finish.GUIDE: 4}

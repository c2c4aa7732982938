"""Turning a growing list of token ids into text deltas, and cutting at stop sequences."""

from __future__ import annotations

from gateway.events import TokenReport


class IncrementalDetokenizer:
    """Emits only text that is final: a delta never ends inside a multi-byte character.

    Decoding token by token breaks characters split across tokens (they decode to U+FFFD), and
    some tokenizers change a token's text depending on its left neighbour. So each step decodes a
    short window before the new tokens and emits what the window gained, holding back output that
    still ends in a replacement character.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-4:])   # left context for the first tokens
        self.prefix = 0          # window start
        self.read = len(self.ids)  # tokens already turned into emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """What is left at the end, replacement characters included."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Finds stop sequences in streamed text and holds back any tail that could begin one, so no
    part of a stop sequence is ever sent before it is known not to be one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Returns the text safe to send now; after a match, `matched` is set and the text is cut
        before the stop sequence."""
        if not self.stops:
            return delta
        text = self.pending + delta
        first = None
        for stop in self.stops:
            i = text.find(stop)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            self.matched = first[1]
            self.pending = ""
            return text[:first[0]]
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TokenTexts:
    """Each token's text alone, decoded once (bounded by the vocabulary), and token reports with it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def reports(self, ids, reports) -> list[TokenReport]:
        """ids with their logprob reports (None: ids and text only)."""
        if reports is None:
            return [TokenReport(int(t), self.text(int(t))) for t in ids]
        return [TokenReport(r.token_id, self.text(r.token_id), r.logprob, r.rank,
                            tuple((t, self.text(t), lp) for t, lp in r.top)) for r in reports]

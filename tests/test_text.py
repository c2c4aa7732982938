"""Incremental detokenization and stop sequences."""

import pytest
from transformers import AutoTokenizer

from gateway.text import IncrementalDetokenizer, StopMatcher

pytestmark = pytest.mark.unit

TEXTS = ["Grüße aus Köln! Ça va? 日本語のテキスト。 Emoji: 🙂🚀 done",
         "def add(a, b):\n    return a + b\n", "🚀🚀🚀 x 🙂"]


@pytest.fixture(scope="module")
def tok(tiny_pair):
    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_deltas_rebuild_the_text_without_broken_characters(tok, text, step):
    ids = tok(text).input_ids
    prompt = tok("prompt: ").input_ids
    # the byte-level tokenizer splits multi-byte characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids) or "🚀" not in text
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_stop_sequence_split_across_deltas_is_never_sent():
    m = StopMatcher(["STOP"])
    out = [m.feed(d) for d in ["hello S", "T", "O", "P and more"]]
    assert "".join(out) == "hello " and m.matched == "STOP"


def test_held_back_text_is_released_when_it_is_not_a_stop():
    m = StopMatcher(["END"])
    out = [m.feed("abc E"), m.feed("N"), m.feed("x")]
    assert "".join(out) == "abc ENx" and m.matched is None
    assert out[0] == "abc "          # 'E' could start 'END': held back


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["bb", "a"])
    assert m.feed("xxbba") == "xx" and m.matched == "bb"


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.feed("anything") == "anything" and m.flush() == ""

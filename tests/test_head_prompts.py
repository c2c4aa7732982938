"""The drafter head's prompt set (tandem/head/prompts.py): the committed file is what build() gives,
the held-out split shares no subject with train, and no benchmark prompt or near copy is in it."""

import builtins
import keyword
import math
import re
from collections import Counter

import pytest

from tandem.head import prompts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def records():
    return prompts.build()


def content(record: dict) -> str:
    return record["messages"][0]["content"]


def test_the_file_is_what_build_gives(records, tmp_path):
    assert prompts.PATH.read_text(encoding="utf-8") == prompts.dumps(records)
    assert prompts.is_current()
    stale = tmp_path / "prompts.jsonl"
    stale.write_text("".join(prompts.PATH.read_text(encoding="utf-8").splitlines(keepends=True)[1:]))
    assert not prompts.is_current(stale)


def test_records_are_well_formed(records):
    assert len({r["id"] for r in records}) == len(records)
    assert len({content(r) for r in records}) == len(records)
    for r in records:
        assert list(r) == ["id", "kind", "split", "subject", "messages"]
        assert r["kind"] in prompts.KINDS and r["split"] in prompts.SPLITS
        assert [m["role"] for m in r["messages"]] == ["user"] and content(r).strip()


def test_sizes_and_shares(records):
    counts = Counter((r["split"], r["kind"]) for r in records)
    assert 800 <= len(records) <= 1000
    assert 0.4 <= (counts["train", "code"] + counts["heldout", "code"]) / len(records) <= 0.6
    assert 0.08 <= (counts["heldout", "code"] + counts["heldout", "chat"]) / len(records) <= 0.16
    for split in prompts.SPLITS:
        for kind in prompts.KINDS:
            assert counts[split, kind] >= 20, (split, kind)


def family(record: dict) -> str:
    return record["id"].rsplit("-", 1)[0]


def test_splits_share_no_subject(records):
    train = {r["subject"] for r in records if r["split"] == "train"}
    heldout = {r["subject"] for r in records if r["split"] == "heldout"}
    assert train and heldout and not train & heldout
    families = {}
    for r in records:
        families.setdefault(r["subject"], set()).add(family(r))
    assert {s: f for s, f in families.items() if len(f) > 1} == {}


def test_each_family_holds_out_its_subjects_with_the_first_digests(records):
    by_family = {}
    for r in records:
        by_family.setdefault(family(r), {})[r["subject"]] = r["split"]
    assert len(by_family) == len(prompts.FAMILIES)
    for name, splits in by_family.items():
        held = {s for s, split in splits.items() if split == "heldout"}
        assert held == prompts.heldout(list(splits)), name
        assert 1 <= len(held) < len(splits), name


def test_load_filters_and_refuses_unknown_names(records):
    assert prompts.load() == records
    heldout_chat = prompts.load("heldout", "chat")
    assert heldout_chat == [r for r in records if r["split"] == "heldout" and r["kind"] == "chat"]
    assert {r["split"] for r in prompts.load("train")} == {"train"}
    assert {r["kind"] for r in prompts.load(kind="code")} == {"code"}
    assert len(prompts.load(split="heldout")) + len(prompts.load(split="train")) == len(records)
    with pytest.raises(ValueError):
        prompts.load("test")
    with pytest.raises(ValueError):
        prompts.load(kind="poem")


# ---- no benchmark prompt, nor a near copy ----

def bench_prompts() -> list[str]:
    """Every prompt bench/ sends."""
    from bench import e2e, guided, load, multiturn, tracing
    return [*e2e.PROMPTS, *load.PROMPTS, *(guided.prompt_of(s, t) for s, t in guided.TASKS),
            multiturn.TEXT + multiturn.QUESTION, tracing.PROMPT]


# Words that say nothing about what a prompt is about: Python's keywords and builtins, and "python".
_COMMON = set(keyword.kwlist) | set(dir(builtins)) | {"self", "__init__", "python"}
# A cosine at or above this is a near copy. The set's prompts reach 0.42 at most against the
# benchmark's, the rewordings in test_the_near_copy_check_sees_rewordings 0.53 at least.
NEAR = 0.46


def vectorizer(docs: list[str]):
    """TF-IDF vectors over `docs`' words (3 characters or more), normalized, so that a dot product
    is a cosine similarity: words that many prompts share (the templates' "write a function
    that") weigh little, a subject's words ("palindrome", the names in the benchmark's code) much."""
    def words(s):
        return [w for w in re.findall(r"[a-z0-9_]{3,}", s.lower()) if w not in _COMMON]
    df = Counter(w for d in docs for w in set(words(d)))

    def vector(s):
        v = {w: c * math.log((len(docs) + 1) / (df[w] + 1)) for w, c in Counter(words(s)).items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {w: x / norm for w, x in v.items()}
    return vector


def cosine(a: dict, b: dict) -> float:
    return sum(x * b.get(w, 0.0) for w, x in a.items())


def test_no_benchmark_prompt_nor_a_near_copy(records):
    bench = bench_prompts()
    assert len(bench) >= 10
    ours = [content(r) for r in records]
    vector = vectorizer(ours + bench)
    ours_vectors = [(o, vector(o)) for o in ours]
    bench_vectors = [(b, vector(b)) for b in bench]
    near = [(round(cosine(u, v), 2), o[:70], b[:50]) for o, u in ours_vectors for b, v in bench_vectors
            if cosine(u, v) >= NEAR]
    assert near == []


def test_the_near_copy_check_sees_rewordings():
    """The check above can fail: rewordings of benchmark prompts, and their code, are near."""
    from bench import load, multiturn
    bench = bench_prompts()
    probes = ["Write a Python function that checks whether a word is a palindrome.",
              "Write a function that returns the nth Fibonacci number.",
              "Write a Python function that merges two sorted lists.",
              "Implement a Stack class in Python with push and pop.",
              "Add type hints to this function.\n\n" + load._ADD,
              "Explain this code:\n" + multiturn.TEXT,
              "Extract the name, age and email as JSON: Maria Santos, 34, lives in Lisbon."]
    ours = [content(r) for r in prompts.build()]
    vector = vectorizer(ours + bench)
    for probe in probes:
        assert max(cosine(vector(probe), vector(b)) for b in bench) >= NEAR, probe

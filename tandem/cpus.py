"""CPU affinity for the local stack's processes (tandem.launch): the --cpus flag, CPU lists, and
starting a process pinned."""

from __future__ import annotations

import contextlib
import os

KINDS = ("verify_worker", "draft_worker", "gateway")     # the processes a Stack starts, by kind


def parse_cpu_list(text: str) -> set[int]:
    """CPU numbers from a list like taskset's: "0", "0-3", "0,2-3"; ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdecimal() or (sep and not last.isdecimal()):
            raise ValueError(f"{text!r} is not a CPU list such as 0, 0-1 or 0,2-3")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"{part.strip()!r}: a range goes from low to high")
        cpus.update(range(lo, hi + 1))
    return cpus


def parse_cpus(text: str) -> dict[str, str]:
    """launch's --cpus: "verify=0,draft=1,gateway=1" -> {"verify_worker": "0", "draft_worker": "1",
    "gateway": "1"}. A bare number or range after an entry adds to its list ("verify=0-1,3,draft=2");
    "verify_worker=" works as "verify=". ValueError names what is wrong."""
    cpus: dict[str, list[str]] = {}
    kind = None
    for item in (i.strip() for i in text.split(",") if i.strip()):
        if "=" in item:
            name, _, item = (x.strip() for x in item.partition("="))
            kind = name if name in KINDS else f"{name}_worker"
            if kind not in KINDS:
                raise ValueError(f"unknown process {name!r}: one of verify, draft, gateway")
            if kind in cpus:
                raise ValueError(f"{name} is given twice")
            cpus[kind] = []
        elif kind is None:
            raise ValueError(f"{item!r} comes before any process: write verify=CPUS,draft=CPUS,gateway=CPUS")
        try:
            parse_cpu_list(item)
        except ValueError as e:
            raise ValueError(f"{kind.removesuffix('_worker')}: {e}") from None
        cpus[kind].append(item)
    return {kind: ",".join(parts) for kind, parts in cpus.items()}


def cpu_sets(cpus: dict[str, str]) -> dict[str, set[int]]:
    """Stack.cpus as sets of CPU numbers, checked against the CPUs this process may use, so that a
    typo fails before any process starts. ValueError names what is wrong."""
    allowed, sets = os.sched_getaffinity(0), {}
    for kind, text in cpus.items():
        if kind not in KINDS:
            raise ValueError(f"unknown process kind {kind!r}, one of {', '.join(KINDS)}")
        sets[kind] = parse_cpu_list(text)
        if not sets[kind] <= allowed:
            raise ValueError(f"{kind} on CPU {', '.join(map(str, sorted(sets[kind] - allowed)))}, but this "
                             f"process may use only {', '.join(map(str, sorted(allowed)))}")
    return sets


@contextlib.contextmanager
def children_on(cpus: set[int] | None):
    """This thread on `cpus` while it starts a process, which inherits the affinity from its first
    instruction on, and every thread it starts with it. Not Popen's preexec_fn: with one, Python forks
    instead of using vfork, and gRPC's fork handlers hung the child before exec."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)

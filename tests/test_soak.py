"""A short soak in `make test` (the full one is `make soak`): concurrent clients with cancellations,
deadlines and worker restarts; every completed stream equals the target's greedy output and
nothing leaks. See tests/soak.py."""

import pytest

from tests.soak import run_soak

pytestmark = pytest.mark.system


def test_short_soak(tiny_pair, tmp_path):
    report = run_soak(*tiny_pair, seconds=30, clients=6, restart_every=4.0, lengths=(8, 24), workdir=tmp_path,
                      min_restarts=2)
    print("\n" + report.table())
    assert report.requests >= 30 and report.checked_outputs >= 10
    assert report.wrong_outputs == 0
    assert sum(report.restarts.values()) >= 2
    assert report.leaks == []
    # Failures a client may see while workers restart are transient (UNAVAILABLE after every
    # migration failed) or its own doing (deadline, cancel); nothing else.
    allowed = {"OK", "CANCELLED (by the client)", "DEADLINE_EXCEEDED", "UNAVAILABLE"}
    assert set(report.statuses) <= allowed, report.statuses

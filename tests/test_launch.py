"""CPU pinning in tandem.launch (tandem.cpus): the --cpus flag and Stack.cpus, checked before any
process starts (unit), and a pinned process's threads on its CPUs (system)."""

from __future__ import annotations

import os

import pytest

from tandem.cluster.redis_conn import free_port
from tandem.cpus import parse_cpu_list, parse_cpus
from tandem.launch import Stack, main


@pytest.mark.unit
def test_cpus_flag_names_each_process_and_its_cpu_list():
    assert parse_cpus("verify=0,draft=1,gateway=1") == {"verify_worker": "0", "draft_worker": "1", "gateway": "1"}
    # a bare number or range after an entry belongs to it: CPU lists have commas of their own
    assert parse_cpus("verify=0-1,3,draft=2") == {"verify_worker": "0-1,3", "draft_worker": "2"}
    assert parse_cpus(" verify_worker = 0 , ") == {"verify_worker": "0"}
    assert parse_cpus("") == {}


@pytest.mark.unit
def test_cpu_lists():
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_cpu_list("3-3") == {3}            # a range of one: its ends may meet


@pytest.mark.unit
@pytest.mark.parametrize("text, problem", [
    ("foo=1", "unknown process 'foo'"),
    ("gateway_worker=1", "unknown process 'gateway_worker'"),
    ("0,verify=1", "'0' comes before any process"),
    ("verify=0,verify=1", "verify is given twice"),
    ("verify=2-1", "'2-1': a range goes from low to high"),
    ("verify=a", "verify: 'a' is not a CPU list"),
    ("verify=0,draft=", "draft: '' is not a CPU list"),
    ("verify=-1", "verify: '-1' is not a CPU list"),
])
def test_cpus_flag_says_what_is_wrong(text, problem):
    with pytest.raises(ValueError) as e:
        parse_cpus(text)
    assert problem in str(e.value)


@pytest.mark.unit
def test_launch_refuses_bad_cpus_before_fetching_models(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--cpus", "verify=0,dra=1"])
    assert e.value.code == 2
    assert "--cpus 'verify=0,dra=1': unknown process 'dra'" in capsys.readouterr().err


@pytest.mark.unit
def test_stack_refuses_cpus_it_cannot_use():
    beyond = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"verify_worker on CPU {beyond}, but this process may use only"):
        Stack("t", "d", cpus={"verify_worker": f"0,{beyond}"})
    with pytest.raises(ValueError, match="unknown process kind 'verify'"):
        Stack("t", "d", cpus={"verify": "0"})


@pytest.mark.system
def test_a_pinned_process_and_all_its_threads_run_on_its_cpus(tiny_pair):
    """A gateway (static routing: no Redis, no workers needed) pinned to one CPU: every thread it
    started (gRPC, tokenizer, torch) inherited the affinity; this process's is unchanged."""
    target, _ = tiny_pair
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    stack = Stack(str(target), "none", cpus={"gateway": str(cpu)})
    try:
        name = stack.add_gateway(["--verify-workers", f"127.0.0.1:{free_port()}"], timeout=120)
        pid = stack.procs[name].pid
        tasks = os.listdir(f"/proc/{pid}/task")
        assert len(tasks) > 1
        assert {t: os.sched_getaffinity(int(t)) for t in tasks} == {t: {cpu} for t in tasks}
        assert os.sched_getaffinity(0) == mine
    finally:
        stack.stop()


@pytest.mark.unit
@pytest.mark.parametrize("draft, set_here, want", [
    # beside a draft model the verify worker spins a short while, every other process sleeps at once
    ("a-model", {}, {"verify_worker": ("PASSIVE", "10000"), "draft_worker": ("PASSIVE", None),
                     "gateway": ("PASSIVE", None)}),
    # with the cores to itself the verify worker keeps OpenMP's default
    ("none", {}, {"verify_worker": (None, None), "draft_worker": ("PASSIVE", None)}),
    # either variable set by the caller wins over all of it
    ("a-model", {"OMP_WAIT_POLICY": "ACTIVE"}, {"verify_worker": ("ACTIVE", None), "draft_worker": ("ACTIVE", None)}),
    ("a-model", {"GOMP_SPINCOUNT": "5"}, {"verify_worker": (None, "5"), "draft_worker": (None, "5")}),
])
def test_each_process_waits_for_openmp_work_by_what_shares_its_cores(draft, set_here, want, monkeypatch):
    import subprocess

    from tandem import launch
    started = {}

    class Popen:                      # records the environment a process would be started with
        def __init__(self, argv, env, stderr):
            started[argv[2]] = (env.get("OMP_WAIT_POLICY"), env.get("GOMP_SPINCOUNT"))

    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(subprocess, "Popen", Popen)
    stack = launch.Stack("t", draft, extra_env=set_here)
    for kind in want:
        stack._spawn(kind, [], free_port())
    assert started == want


@pytest.mark.unit
def test_a_draft_worker_of_several_threads_spins_like_the_verify_worker(monkeypatch):
    import subprocess

    from tandem import launch
    started = []
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(subprocess, "Popen", lambda argv, env, stderr: started.append(
        (env.get("OMP_WAIT_POLICY"), env.get("GOMP_SPINCOUNT"))))
    stack = launch.Stack("t", "a-model")
    for name, args in (("draft_worker", ["--threads", "2"]), ("draft_worker-2", ["--threads", "2", "--threads", "1"]),
                       ("draft_worker-3", ["--threads", "1", "--dtype", "int4", "--threads", "3"])):
        stack._spawn(name, args, free_port())
    assert started == [("PASSIVE", "10000"), ("PASSIVE", None), ("PASSIVE", "10000")]


@pytest.mark.unit
@pytest.mark.parametrize("cpus, draft_threads, want", [
    ({}, 0, 1),                                               # beside the target: one thread
    ({"verify_worker": "0", "draft_worker": "0"}, 0, 1),      # pinned, but to the target's CPU
    ({"verify_worker": "0", "draft_worker": "1"}, 0, 2),      # CPUs of its own: the stack's threads
    ({"draft_worker": "1"}, 0, 1),                            # the target may run anywhere, its CPU too
    ({}, 3, 3),                                               # asked for
])
def test_a_draft_worker_beside_the_target_drafts_on_one_thread(cpus, draft_threads, want):
    if os.cpu_count() < 2:
        pytest.skip("needs two CPUs")
    assert Stack("t", "a-model", threads=2, cpus=cpus, draft_threads=draft_threads).threads_of_draft() == want

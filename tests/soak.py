"""Soak: many concurrent clients against the three services as real processes (mutual TLS, bearer
tokens, a private Redis, loopback only) for a bounded time, with random cancellations, deadlines and
worker restarts (kill -9 or SIGTERM, then a fresh worker). Every stream that completes is checked
against the target's own greedy output; at the end no session, KV reservation, Redis lock or
registry entry may be left over.

`python -m tests.soak --seconds 300` (what `make soak` runs) prints the report and writes it as
JSON; tests/test_soak.py runs a short one in `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import redis

from tandem.client import build_request
from tandem.cluster.redis_conn import RedisServer
from tandem.cluster.registry import DRAFT, VERIFY, Registry
from tandem.engine.modeling import CausalLM
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.certs import CA, SERVER_NAME
from tests.local import reference

TOKEN = "soak-token-5e1f"
PROMPTS = ["def add(a, b):", "for i in range(10):\n", "class Point:", "import os\n", "x = [1, 2, 3]\n"]
METHODS = ["model", "ngram", "none"]


@dataclass
class Report:
    seconds: float
    clients: int
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)     # completed (OK) or ended with a status
    by_action: dict[str, int] = field(default_factory=dict)     # full, cancel, deadline
    checked_outputs: int = 0                                      # OK streams compared with the target
    wrong_outputs: int = 0
    restarts: dict[str, int] = field(default_factory=dict)       # e.g. verify_worker SIGKILL: 3
    leaks: list[str] = field(default_factory=list)

    def table(self) -> str:
        rows = [("requests", self.requests), ("checked against the target, all equal" if not self.wrong_outputs
                 else "checked against the target, WRONG", f"{self.checked_outputs} ({self.wrong_outputs} wrong)")]
        rows += [(f"status {k}", v) for k, v in sorted(self.statuses.items(), key=lambda kv: -kv[1])]
        rows += [(f"action {k}", v) for k, v in sorted(self.by_action.items())]
        rows += [(f"restart {k}", v) for k, v in sorted(self.restarts.items())]
        rows += [("leaks", len(self.leaks))] + [("  leak", x) for x in self.leaks]
        return "\n".join(f"{k:<45} {v}" for k, v in rows)


def expected_texts(target: Path, tok, lengths: list[int]) -> dict[tuple[str, int], str]:
    model = CausalLM(str(target))
    return {(p, n): tok.decode(reference(model, tok(p).input_ids, SamplingParams(max_new_tokens=n)),
                               skip_special_tokens=True) for p in PROMPTS for n in lengths}


async def client(stub, expected, running, rng: random.Random, report: Report, lengths: list[int]) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    while running():
        prompt, n = rng.choice(PROMPTS), rng.choice(lengths)
        action = rng.choices(["full", "cancel", "deadline"], weights=[6, 2, 2])[0]
        timeout = rng.uniform(0.05, 1.0) if action == "deadline" else 60
        req = build_request(prompt, max_new_tokens=n, method=rng.choice(METHODS), k=rng.randint(1, 6))
        call = stub.GenerateStream(req, timeout=timeout, metadata=metadata)
        report.requests += 1
        report.by_action[action] = report.by_action.get(action, 0) + 1
        stop_after = rng.randint(0, 3) if action == "cancel" else None
        parts: list[str] = []
        try:
            async for msg in call:
                parts.append(msg.text)
                if stop_after is not None and len(parts) > stop_after:
                    call.cancel()
                    break
            code = "CANCELLED (by the client)" if call.cancelled() else "OK"
        except asyncio.CancelledError:
            code = "CANCELLED (by the client)"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        report.statuses[code] = report.statuses.get(code, 0) + 1
        if code == "OK":
            report.checked_outputs += 1
            if "".join(parts) != expected[(prompt, n)]:
                report.wrong_outputs += 1


async def chaos(stack: Stack, end: float, rng: random.Random, report: Report, every: float,
                at_least: int = 0) -> None:
    """Restarts a random worker now and then: kill -9 (mid-stream loss) or SIGTERM (a drain); at
    least `at_least` times, however long the replacements take to start."""
    loop = asyncio.get_running_loop()
    while time.monotonic() + every < end or sum(report.restarts.values()) < at_least:
        await asyncio.sleep(rng.uniform(0.5, 1.5) * every)
        kind = rng.choice(["verify_worker", "draft_worker"])
        alive = [n for n, p in stack.procs.items() if n.startswith(kind) and p.poll() is None]
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        # Pools of two: the other worker serves while the replacement starts.
        stack.kill(rng.choice(alive), sig)
        await loop.run_in_executor(None, stack.add_worker, kind)
        key = f"{kind} {sig.name}"
        report.restarts[key] = report.restarts.get(key, 0) + 1


def check_leaks(stack: Stack, redis_url: str, report: Report, timeout: float = 20) -> None:
    """Every live worker holds no session and no KV reservation, the gateway streams nothing, Redis
    holds no session lock, no key without a TTL but the registry's index sets, and the index sets
    name only live workers (dead ones pruned once their heartbeat keys expire)."""
    deadline = time.monotonic() + timeout
    while True:
        leaks = []
        for name, proc in stack.procs.items():
            if proc.poll() is not None or name == "gateway":
                continue
            with stack.tls.channel(stack.address(name)) as ch:
                stub = (ipb_grpc.VerifyServiceStub if name.startswith("verify") else ipb_grpc.DraftServiceStub)(ch)
                try:
                    s = stub.Status(ipb.StatusRequest(), timeout=10)
                except grpc.RpcError:           # sent SIGTERM at the end: it stops listening first
                    if proc.wait(15) != 0:
                        leaks.append(f"{name}: exited with status {proc.returncode} after SIGTERM")
                    continue
            if s.live_sessions or s.reserved_kv_tokens:
                leaks.append(f"{name}: {s.live_sessions} live sessions, {s.reserved_kv_tokens} KV tokens reserved")
        metrics = urllib.request.urlopen(stack.metrics_url("gateway"), timeout=10).read().decode()
        running = [line for line in metrics.splitlines() if line.startswith("tandem_gateway_running_requests ")]
        if not running or float(running[0].split()[1]) != 0:
            leaks.append(f"gateway: {running}")
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            asyncio.run(_prune(redis_url))
            live = {stack.address(n) for n, p in stack.procs.items() if p.poll() is None and n != "gateway"}
            for key in r.scan_iter("*"):
                if key.startswith("tandem:session-lock:"):
                    leaks.append(f"Redis: {key} still held")
                elif key.startswith("tandem:workers:"):
                    stale = set(r.smembers(key)) - live
                    if stale:
                        leaks.append(f"Redis: {key} names workers that are gone: {sorted(stale)}")
                elif r.pttl(key) < 0:
                    leaks.append(f"Redis: {key} has no TTL")
        finally:
            r.close()
        if not leaks or time.monotonic() > deadline:
            report.leaks = leaks
            return
        time.sleep(0.5)


async def _prune(redis_url: str) -> None:
    from tandem.cluster.redis_conn import connect
    client = connect(redis_url)
    try:
        for pool in (VERIFY, DRAFT):
            await Registry(client).workers(pool)      # drops entries whose heartbeat key expired
    finally:
        await client.aclose()


async def _load(stack: Stack, expected, seconds: float, clients: int, seed: int, restart_every: float,
                lengths: list[int], report: Report, min_restarts: int) -> None:
    with open(stack.tls.ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(f.read())
    async with grpc.aio.secure_channel(stack.address("gateway"), creds,
                                       options=[("grpc.ssl_target_name_override", SERVER_NAME)]) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        end = time.monotonic() + seconds
        rng = random.Random(seed)
        restarts = asyncio.ensure_future(chaos(stack, end, random.Random(rng.random()), report, restart_every,
                                               min_restarts))

        def running() -> bool:            # the load lasts `seconds`, and until the last restart is done
            return time.monotonic() < end or not restarts.done()
        tasks = [client(stub, expected, running, random.Random(rng.random()), report, lengths) for _ in range(clients)]
        await asyncio.gather(restarts, *tasks)


def run_soak(target: Path, draft: Path, seconds: float, clients: int = 8, seed: int = 0,
             restart_every: float = 8.0, lengths: tuple[int, ...] = (8, 24, 64), workdir: Path | None = None,
             min_restarts: int = 0) -> Report:
    from transformers import AutoTokenizer
    workdir = Path(workdir or tempfile.mkdtemp(prefix="tandem-soak-"))
    tls = CA(workdir / "pki").issue("service")
    tokens = workdir / "tokens"
    tokens.write_text(f"{TOKEN} soak\n")
    expected = expected_texts(target, AutoTokenizer.from_pretrained(str(target)), list(lengths))
    report = Report(seconds=seconds, clients=clients)
    redis_server = RedisServer(password="soak-redis-pw", username="tandem").start()
    try:
        with Stack(str(target), str(draft), threads=1, redis_url=redis_server.url, tls=tls, verify_workers=2,
                   draft_workers=2, heartbeat_seconds=0.5, log_dir=str(workdir),
                   gateway_args=["--auth-tokens-file", str(tokens), "--max-migrations", "6",
                                 "--session-ttl-seconds", "600"],
                   draft_args=["--no-adaptive-k", "--grace-seconds", "2"],
                   verify_args=["--grace-seconds", "2"]) as stack:
            asyncio.run(_load(stack, expected, seconds, clients, seed, restart_every, list(lengths), report,
                              min_restarts))
            check_leaks(stack, redis_server.url, report)
    finally:
        redis_server.stop()
    return report


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tests.soak", description=__doc__)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--restart-every", type=float, default=10.0, help="mean seconds between worker restarts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/soak.json")
    a = p.parse_args(argv)
    import torch

    from tandem.testing import build_tiny_pair
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    target, draft = build_tiny_pair(workdir / "models")
    t0 = time.monotonic()
    report = run_soak(target, draft, a.seconds, a.clients, a.seed, a.restart_every, workdir=workdir)
    print(f"soak: {a.clients} clients for {a.seconds:.0f} s ({time.monotonic() - t0:.0f} s with start-up "
          f"and checks), logs in {workdir}\n{report.table()}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(asdict(report), indent=2) + "\n")
    if report.wrong_outputs or report.leaks:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

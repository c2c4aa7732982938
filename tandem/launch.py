"""Start the whole service locally: verify worker, draft worker and gateway as three processes.

`python -m tandem.launch` (what `make run` calls) fetches the default models if needed, starts
the services, streams one demonstration request and keeps serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cluster.redis_conn import RedisServer, ensure_redis, free_port, redacted
from tandem.cpus import children_on, cpu_sets, parse_cpus
from tandem.service.config import add_flag


@dataclass(frozen=True)
class TlsFiles:
    """PEM files every process of a Stack uses: one certificate for all, signed by `ca`."""
    cert: str
    key: str
    ca: str
    server_name: str = ""

    def args(self) -> list[str]:
        return ["--tls-cert-file", self.cert, "--tls-key-file", self.key, "--tls-ca-file", self.ca,
                "--tls-server-name", self.server_name]

    def channel(self, address: str) -> grpc.Channel:
        """A blocking channel presenting the same certificate (the services ask for it)."""
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()
        creds = grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, creds, options=options)


def wait_serving(address: str, proc: subprocess.Popen, timeout: float, tls: TlsFiles | None = None) -> None:
    deadline = time.monotonic() + timeout
    with (tls.channel(address) if tls else grpc.insecure_channel(address)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(proc.args)} exited with status {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not become SERVING within {timeout:.0f}s")


# Spin rounds of libgomp (GOMP_SPINCOUNT; about 0.1 ms) for a process that shares the cores with
# another and runs OpenMP teams (Stack._spawn).
SPINS = "10000"


@dataclass
class Stack:
    """Verify workers, draft workers and a gateway as processes on loopback ports, coordinated
    through Redis: `redis_url`, or else (see tandem.cluster.redis_conn.ensure_redis) REDIS_URL, a server on
    127.0.0.1:6379, or a private redis-server that stop() also stops."""

    target: str
    draft: str                       # a model spec, or "none" for n-gram drafting only
    threads: int = 2
    host: str = "127.0.0.1"
    gateway_port: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)
    gateway_args: list[str] = field(default_factory=list)
    redis_url: str = ""
    verify_workers: int = 1
    draft_workers: int = 1
    verify_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    heartbeat_seconds: float = 2.0
    log_dir: str = ""                # when set, each process's log goes to <log_dir>/<name>.log
    tls: TlsFiles | None = None      # None: every process is started with --insecure, said explicitly
    # CPU affinity by process kind, a CPU list each ({"verify_worker": "0", "draft_worker": "1-2"}): a
    # process and every thread it starts run only there. Kinds left out run anywhere.
    cpus: dict[str, str] = field(default_factory=dict)
    # A draft worker's torch threads: 0 for one thread where it shares the cores with the verify
    # worker (no CPUs of its own in `cpus`), else `threads` (threads_of_draft). One thread has no
    # OpenMP team to wake for each of a step's layers while the two processes take turns, and
    # leaves the verify worker a core when they run at once: a third of a round at one stream,
    # faster at four (docs/benchmarks.md, "A draft beside the target on one thread").
    draft_threads: int = 0
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)     # each process's /metrics port
    _redis: RedisServer | None = None
    _cpu_sets: dict[str, set[int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._cpu_sets = cpu_sets(self.cpus)

    def address(self, name: str) -> str:
        return f"{self.host}:{self.ports[name]}"

    def metrics_url(self, name: str) -> str:
        return f"http://{self.host}:{self.metrics_ports[name]}/metrics"

    def _spawn(self, name: str, args: list[str], port: int, cpus: str | None = None) -> None:
        # The processes share this machine's cores. An OpenMP thread that spins while it waits
        # (OpenMP's default: about 3 ms) takes a core from another process's forward passes; one
        # that sleeps at once must be woken by each parallel region of a pass. So with a draft model
        # beside it the verify worker spins SPINS rounds (the gaps between a pass's regions, not
        # those between passes), and so does a draft worker given several threads (a choice for one
        # stream, where the two take turns: a two-thread step of the int4 0.5B Qwen took 45 ms
        # sleeping at once, 33 spinning); every other process sleeps at once (one draft thread has
        # no team to wake), and a verify worker without a draft model keeps OpenMP's default.
        # Measured in docs/benchmarks.md ("Measurements behind the code's rules"). Either variable
        # set in the environment overrides all of this.
        verify = name.startswith("verify_worker")
        threads = [value for flag, value in zip(args, args[1:]) if flag == "--threads"]   # the last counts
        teams = name.startswith("draft_worker") and int((threads or ["1"])[-1]) > 1
        if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & (os.environ.keys() | self.extra_env.keys()):
            omp = {}                     # the caller's choice
        elif verify and self.draft == "none":
            omp = {}
        elif verify or teams:
            omp = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SPINS}
        else:
            omp = {"OMP_WAIT_POLICY": "PASSIVE"}
        env = {**omp, **os.environ, **self.extra_env}
        self.ports[name] = port
        # A free port per process: the services' fixed defaults would collide on one machine.
        self.metrics_ports[name] = free_port()
        kind = name.split("-")[0]
        pinned = cpu_sets({kind: cpus})[kind] if cpus is not None else self._cpu_sets.get(kind)
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab") if self.log_dir else None
        try:
            with children_on(pinned):
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", kind, "--host", self.host, "--port", str(port),
                     "--metrics-port", str(self.metrics_ports[name]), "--redis-url", self.redis_url,
                     *(self.tls.args() if self.tls else ["--insecure"]), *args],
                    env=env, stderr=log)
        finally:
            if log is not None:
                log.close()          # the child holds its own copy

    def _name(self, kind: str) -> str:
        n = 1
        while (name := kind if n == 1 else f"{kind}-{n}") in self.ports:    # never reuse a name
            n += 1
        return name

    def add_worker(self, kind: str, wait: bool = True, timeout: float = 600, extra_args: list[str] = (),
                   cpus: str | None = None) -> str:
        """Starts one more verify_worker or draft_worker, with the pool's flags and then
        `extra_args`, on `cpus` (a CPU list) instead of the kind's; returns its name (verify_worker-2, ...)."""
        name = self._name(kind)
        beat = ["--heartbeat-seconds", str(self.heartbeat_seconds)]
        if kind == "verify_worker":
            args = ["--model", self.target, "--threads", str(self.threads), *beat, *self.verify_args]
        else:
            args = ["--model", self.draft, "--target-model", self.target, "--threads", str(self.threads_of_draft()), *beat,
                    *self.draft_args]
        self._spawn(name, [*args, *extra_args], free_port(), cpus)
        if wait:
            wait_serving(self.address(name), self.procs[name], timeout, self.tls)
        return name

    def threads_of_draft(self) -> int:
        """`draft_threads`, else `threads` where the draft worker's CPUs are not the verify worker's, else 1."""
        if self.draft_threads:
            return self.draft_threads
        own, verify = self._cpu_sets.get("draft_worker"), self._cpu_sets.get("verify_worker")
        return self.threads if own and verify is not None and own.isdisjoint(verify) else 1

    def start(self, timeout: float = 600) -> "Stack":
        try:
            if not self.redis_url:
                self.redis_url, self._redis = ensure_redis()
            # A worker with a model times its forward passes at start-up (--calibrate), and two pools
            # loading at once on the same cores would time each other's noise: those pools start one
            # after the other. The gateway and a model-free draft pool time nothing; they start with the
            # first pool, their imports done while its workers import and load theirs (the gateway
            # finds workers in the registry per request, whenever they come).
            counts = {"verify_worker": self.verify_workers, "draft_worker": self.draft_workers}
            steps = [["verify_worker", "draft_worker"]] if self.draft == "none" else [["verify_worker"], ["draft_worker"]]
            self._spawn("gateway", ["--model", self.target, *self.gateway_args], self.gateway_port or free_port())
            for kinds in steps:
                names = [self.add_worker(kind, wait=False) for kind in kinds for _ in range(counts[kind])]
                for name in names:
                    wait_serving(self.address(name), self.procs[name], timeout, self.tls)
            wait_serving(self.address("gateway"), self.procs["gateway"], timeout, self.tls)
        except BaseException:
            self.stop()
            raise
        return self

    def add_gateway(self, args: list[str], timeout: float = 600) -> str:
        """Starts one more gateway for this target with `args` (e.g. static --verify-workers and
        --draft-workers to route to chosen workers); returns its name (gateway-2, ...)."""
        name = self._name("gateway")
        self._spawn(name, ["--model", self.target, *args], free_port())
        wait_serving(self.address(name), self.procs[name], timeout, self.tls)
        return name

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)

    def stop(self, grace: float = 15) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="tandem.launch", description=__doc__)
    add_flag(parser, "--target", default="qwen2.5-coder-1.5b-instruct", help="target model")
    add_flag(parser, "--draft", default="qwen2.5-coder-0.5b-instruct", help="draft model, or none")
    add_flag(parser, "--threads", default=2, type=int, help="torch threads per worker process")
    add_flag(parser, "--draft-threads", default=0, type=int,
             help="the draft worker's threads; 0: one beside the verify worker, --threads with --cpus of its own")
    add_flag(parser, "--gateway-port", default=50051, type=int, help="public port")
    add_flag(parser, "--head", default="",
             help="the verify worker's trained head ('shipped': the one shipped for --target); the demo "
                  "request then drafts with it")
    add_flag(parser, "--demo", default=True, type=bool, help="stream one request once serving")
    add_flag(parser, "--cpus", default="",
             help="pin processes to CPUs: verify=CPUS,draft=CPUS,gateway=CPUS, each a list like 0, 0-1 or "
                  "0,2-3 (verify=0-1,3,draft=2); a process left out runs on any CPU; keep --threads at most "
                  "a process's CPUs")
    add_flag(parser, "--pipeline", default=False, type=bool,
             help="the draft worker streams its proposals, drafting while the target verifies (its --pipeline): "
                  "for a draft worker with CPUs of its own (--cpus)")
    args = parser.parse_args(argv)
    try:
        cpus = parse_cpus(args.cpus)
        cpu_sets(cpus)          # before the models are fetched
    except ValueError as e:
        parser.error(f"--cpus {args.cpus!r}: {e}")

    from tandem import presets
    for spec in (args.target, args.draft):
        if spec and spec != "none":
            print(f"model {spec}: {presets.resolve_model(spec)}", flush=True)
    stack = Stack(args.target, args.draft, threads=args.threads, draft_threads=args.draft_threads,
                  gateway_port=args.gateway_port,
                  verify_args=["--head", args.head] if args.head else [], cpus=cpus,
                  draft_args=["--pipeline"] if args.pipeline else [])
    stack.start()
    print(f"\nTandem is serving on {stack.address('gateway')} (verify {stack.address('verify_worker')}, "
          f"draft {stack.address('draft_worker')}, Redis {redacted(stack.redis_url)})\n"
          f"metrics: {', '.join(f'{n} {stack.metrics_url(n)}' for n in stack.procs)}", flush=True)
    try:
        if args.demo:
            from tandem import client
            print(f"\n>>> {DEMO_PROMPT}\n", flush=True)
            client.run(stack.address("gateway"), DEMO_PROMPT, chat=True, max_new_tokens=160,
                       method="head" if args.head else "")
        print("\nPress Ctrl-C to stop.", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping...", flush=True)
        stack.stop()


if __name__ == "__main__":
    main()

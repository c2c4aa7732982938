"""The chart's pods as Docker containers: run by deploy/image-check.sh after it built the image.

Renders the Helm chart offline exactly as tests/test_deploy.py does (helm-python-sdk), takes each
Deployment's command, args, env (ConfigMaps, the downward API and $(VAR) expanded as the kubelet
does), securityContext, memory limit and volumes, and runs them with `docker run` on a
user-defined network. Only what Docker's network decides is supplied here: the pod IP (a fixed
address on the network), the pod name, and DNS aliases for the chart's Service names; the models
volume is an empty volume (the pod's emptyDir) with the host's converted presets mounted read-only
at `$TANDEM_CACHE_DIR/models`, so the init container's `tandem.presets fetch` finds them done.

Checks: time from `docker run` to SERVING (grpc.health.v1) per service; a greedy request through
the gateway equals the target alone (transformers on the host); `docker stop` (grace = the chart's
terminationGracePeriodSeconds) of the verify container holding a stream, with a second verify
container running, moves the stream (usage.migrations == 1, output unchanged); every container
runs as the chart's non-root user with a read-only root filesystem.

    python deploy/image_check.py --show              # the rendered containers as JSON, nothing run
    python deploy/image_check.py --image tandem:0.1.0-cpu --models DIR [--keep]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_deploy import (  # noqa: E402  the rendering code path of the deploy tests
    NAMESPACE, env_of, expand, find, load_values, pool_deployments, render_chart,
)

PROMPT = "def add(a, b):"
PREFIX = "tandem-ic"  # container and network names
# --tls: the client's credentials (CA, a client certificate, the chart's server name) and token
CLIENT: dict = {"tls": None, "token": ""}


def sh(docker: str, *args: str, check: bool = True, capture: bool = True) -> str:
    res = subprocess.run([docker, *args], capture_output=capture, text=True)
    if check and res.returncode != 0:
        raise SystemExit(f"docker {' '.join(args[:3])} ...: {res.stderr.strip()}")
    return (res.stdout or "").strip()


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


def containers_of(docs: list[dict]) -> dict[str, tuple[dict, list[dict]]]:
    """pool -> (pod spec, [init containers..., main container])."""
    out = {}
    for pool, deployment in pool_deployments(docs).items():
        spec = deployment["spec"]["template"]["spec"]
        out[pool] = (spec, [*spec.get("initContainers", []), spec["containers"][0]])
    redis = [d for d in find(docs, "Deployment") if d["metadata"]["name"].endswith("-redis")]
    if redis:
        spec = redis[0]["spec"]["template"]["spec"]
        out["redis"] = (spec, [spec["containers"][0]])
    return out


def resolved_env(docs: list[dict], container: dict, pod_name: str, pod_ip: str) -> dict[str, str]:
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for key, value in env_of(docs, container).items():
        if isinstance(value, dict):
            if "fieldRef" not in value:
                raise SystemExit(f"{key}: {value} is not emulated (a Secret?)")
            value = fields[value["fieldRef"]["fieldPath"]]
        env[key] = expand(str(value), env)  # $(VAR) of variables defined earlier, as the kubelet does
    return env


def run_args(docs, spec, container, *, name, ip, image, network, models, aliases=(), secrets=None) -> list[str]:
    """`docker run` arguments for one container of a rendered pod."""
    env = resolved_env(docs, container, name, ip)
    args = ["run", "-d", "--name", name, "--hostname", name, "--network", network, "--ip", ip]
    for alias in aliases:
        args += ["--network-alias", alias]
    pod_sc, sc = spec.get("securityContext", {}), container.get("securityContext", {})
    user, group = sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    if user is not None:
        args += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if pod_sc.get("fsGroup") is not None:
        args += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    for cap in sc.get("capabilities", {}).get("drop", []):
        args += ["--cap-drop", cap]
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    if limit:
        args += ["--memory", str(memory_bytes(limit))]
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        path, volume = mount["mountPath"], volumes[mount["name"]]
        if path == env.get("TANDEM_CACHE_DIR"):
            # the pod's models volume: empty and writable, with the host's presets inside, read-only
            args += ["--mount", f"type=volume,dst={path}", "-v", f"{models}:{path}/models:ro"]
        elif "emptyDir" in volume:
            args += ["--tmpfs", f"{path}:mode=1777"]
        elif "secret" in volume and volume["secret"]["secretName"] in (secrets or {}):
            args += ["-v", f"{secrets[volume['secret']['secretName']]}:{path}:ro"]   # files of the Secret
        else:
            raise SystemExit(f"volume {mount['name']} ({list(volume)}) is not emulated")
    for key, value in env.items():
        args += ["-e", f"{key}={value}"]
    command = container.get("command") or []
    if command:
        args += ["--entrypoint", command[0]]
    return args + [image, *command[1:], *[expand(a, env) for a in container.get("args", [])]]


# ---- gRPC from the host (as the kubelet probes a pod IP) ----

def channel(address: str):
    """Plaintext, or with --tls mutual TLS as a peer service would connect."""
    import grpc
    if not CLIENT["tls"]:
        return grpc.insecure_channel(address)
    ca, cert, key, server_name = CLIENT["tls"]
    creds = grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", server_name)])


def health(address: str) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return -1


def reference(model_dir: Path, n: int) -> str:
    """The target alone, greedy, n tokens (EOS suppressed, as min_new_tokens = n asks)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def stream(address: str, n: int, during=None):
    """Streams a greedy request of exactly n tokens (the gateway's default draft method);
    calls during() once 16 tokens arrived. Returns (text, final message, seconds)."""
    import grpc
    from tandem.client import build_request
    from tandem.v1 import generation_pb2_grpc as pb_grpc
    req = build_request(PROMPT, max_new_tokens=n)
    req.sampling.min_new_tokens = n
    start = time.monotonic()
    metadata = [("authorization", f"Bearer {CLIENT['token']}")] if CLIENT["token"] else None
    with channel(address) as ch:
        msgs, called = [], during is None
        for msg in pb_grpc.GenerationServiceStub(ch).GenerateStream(req, timeout=600, metadata=metadata):
            msgs.append(msg)
            if not called and sum(m.token_count for m in msgs) >= 16:
                called = True
                during()
    return "".join(m.text for m in msgs), msgs[-1], time.monotonic() - start


def live_sessions(address: str) -> int:
    from tandem.v1 import internal_pb2 as ipb
    from tandem.v1 import internal_pb2_grpc as ipb_grpc
    with channel(address) as ch:
        return ipb_grpc.VerifyServiceStub(ch).Status(ipb.StatusRequest(), timeout=5).live_sessions


# ---- the check ----

class Check:
    def __init__(self, a):
        self.a, self.docker = a, a.docker
        self.docs = render_chart(values_of(a))
        self.secrets: dict[str, str] = {}
        self.secrets_folder: Path | None = None
        if a.tls:
            self.make_secrets()
        self.pods = containers_of(self.docs)
        self.net = f"{PREFIX}-net"
        base = a.subnet.rsplit(".", 1)[0]
        self.ips = {p: f"{base}.{i}" for i, p in enumerate(["redis", "gateway", "draft", "verify", "verify-2"], 10)}
        self.started: list[str] = []
        self.timings: dict[str, float] = {}
        self.failures: list[str] = []

    def make_secrets(self) -> None:
        """The Secrets tls.yaml names, as folders: a throwaway CA and one certificate for server
        and client use naming the chart's tls.serverName (tests/certs.py), and a token file."""
        import secrets
        import tempfile

        import tests.certs as certs
        values = values_of(self.a)
        folder = Path(tempfile.mkdtemp(prefix="tandem-ic-secrets-"))
        certs.SERVER_NAME = values["tls"].get("serverName", "tandem-internal")
        files = certs.CA(folder / "pki").issue("tandem")
        tls = folder / "tls"
        tls.mkdir()
        for src, dst in ((files.cert, "tls.crt"), (files.key, "tls.key"), (files.ca, "ca.crt")):
            (tls / dst).write_bytes(Path(src).read_bytes())
        auth = folder / "auth"
        auth.mkdir()
        CLIENT["token"] = secrets.token_hex(16)
        (auth / values["auth"].get("secretKey", "tokens")).write_text(f"{CLIENT['token']} image-check\n")
        for path in (folder, tls, auth, *tls.iterdir(), *auth.iterdir()):
            path.chmod(0o755 if path.is_dir() else 0o644)   # a Secret volume's default mode
        self.secrets = {values["tls"]["secretName"]: str(tls), values["auth"]["existingSecret"]: str(auth)}
        self.secrets_folder = folder
        CLIENT["tls"] = (str(tls / "ca.crt"), str(tls / "tls.crt"), str(tls / "tls.key"), certs.SERVER_NAME)
        print(f"--tls: certificates for {certs.SERVER_NAME!r} and a token generated")

    def ok(self, cond: bool, what: str) -> None:
        print(f"  [{'PASS' if cond else 'FAIL'}] {what}", flush=True)
        if not cond:
            self.failures.append(what)

    def cleanup(self) -> None:
        for name in self.started:
            sh(self.docker, "rm", "-f", "-v", name, check=False)
        sh(self.docker, "network", "rm", self.net, check=False)

    def remove_secrets(self) -> None:
        if self.secrets_folder:
            import shutil
            shutil.rmtree(self.secrets_folder, ignore_errors=True)

    def docker_run(self, pool: str, container: dict, name: str, ip: str, detach=True) -> float:
        spec = self.pods[pool.split("-")[0]][0]
        service = f"tandem-{pool}"
        args = run_args(self.docs, spec, container, name=name, ip=ip, image=self.a.image,
                        network=self.net, models=self.a.models, aliases=[] if "-" in pool else [service],
                        secrets=self.secrets)
        if not detach:
            args.remove("-d")
            args.insert(1, "--rm")
        start = time.monotonic()
        res = subprocess.run([self.docker, *args], capture_output=True, text=True)
        if detach:
            self.started.append(name)
        if res.returncode != 0:
            raise SystemExit(f"docker run {name} failed ({res.returncode}): {res.stderr.strip()}\n{res.stdout[-3000:]}")
        return start

    def run_redis(self) -> None:
        spec, (c,) = self.pods["redis"]
        url = urlparse(env_of(self.docs, self.pods["verify"][1][-1])["REDIS_URL"])
        sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
        args = ["run", "-d", "--name", f"{PREFIX}-redis", "--network", self.net, "--ip", self.ips["redis"],
                "--network-alias", url.hostname, "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-w", "/data"]
        if sc.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        args += ["--tmpfs", "/data:mode=1777", "--entrypoint", "redis-server", self.a.redis_image,
                 "--port", str(url.port or 6379), *c.get("args", []),
                 "--protected-mode", "no"]  # what the official image's entry point adds without a config
        sh(self.docker, *args)
        self.started.append(f"{PREFIX}-redis")
        for _ in range(100):
            if sh(self.docker, "exec", f"{PREFIX}-redis", "redis-cli", "ping", check=False) == "PONG":
                return
            time.sleep(0.1)
        raise SystemExit("redis did not answer PING")

    def wait_serving(self, names: dict[str, tuple[str, float]], limit: float = 900) -> None:
        """names: container -> (address, docker run start)."""
        from grpc_health.v1 import health_pb2
        pending = dict(names)
        deadline = time.monotonic() + limit
        while pending and time.monotonic() < deadline:
            for name, (address, start) in list(pending.items()):
                if health(address) == health_pb2.HealthCheckResponse.SERVING:
                    self.timings[name] = time.monotonic() - start
                    print(f"  {name}: SERVING {self.timings[name]:.1f} s after docker run", flush=True)
                    del pending[name]
                elif sh(self.docker, "inspect", "-f", "{{.State.Running}}", name, check=False) != "true":
                    logs = subprocess.run([self.docker, "logs", "--tail", "40", name], capture_output=True, text=True)
                    raise SystemExit(f"{name} exited before SERVING:\n{logs.stdout}{logs.stderr}")
            time.sleep(0.25)
        if pending:
            raise SystemExit(f"not SERVING after {limit} s: {sorted(pending)}")

    def main(self) -> int:
        a = self.a
        print(f"chart rendered with values/{a.values}.yaml{' + values/tls.yaml' if a.tls else ''}: "
              + ", ".join(f"{p}: {[c['name'] for c in cs]}" for p, (_, cs) in self.pods.items()))
        model = env_of(self.docs, self.pods["verify"][1][-1])["TANDEM_MODEL"]

        self.cleanup()
        sh(self.docker, "network", "create", "--subnet", a.subnet, self.net)
        self.run_redis()
        # init containers (fetch-models) first, as the kubelet does, one per pod that has them
        for pool in ("verify", "gateway", "draft"):
            for init in self.pods[pool][1][:-1]:
                start = self.docker_run(pool, init, f"{PREFIX}-{pool}-{init['name']}", self.ips[pool], detach=False)
                self.ok(True, f"{pool} init container {init['name']} ({' '.join(init['args'])}) "
                              f"exited 0 in {time.monotonic() - start:.1f} s")
        ports = {p: next(port["containerPort"] for port in self.pods[p][1][-1]["ports"] if port["name"] == "grpc")
                 for p in ("gateway", "draft", "verify")}
        addr = {p: f"{self.ips[p]}:{ports[p]}" for p in ports}
        # probes: the startup probe's gRPC port (the service port, or with TLS the plaintext health port)
        probe = {p: self.pods[p][1][-1]["startupProbe"]["grpc"]["port"] for p in ports}
        starts = {}
        for pool in ("verify", "draft", "gateway"):
            name = f"{PREFIX}-{pool}"
            starts[name] = (f"{self.ips[pool]}:{probe[pool]}",
                            self.docker_run(pool, self.pods[pool][1][-1], name, self.ips[pool]))
        print("time from docker run to SERVING (grpc.health.v1 from the host, as a probe):")
        self.wait_serving(starts)
        self.ok(True, "every container reports SERVING")

        # security: the user and root filesystem the chart declares
        for pool in ("gateway", "draft", "verify"):
            name = f"{PREFIX}-{pool}"
            spec, cs = self.pods[pool]
            want_uid = cs[-1].get("securityContext", {}).get("runAsUser", spec["securityContext"]["runAsUser"])
            uid = sh(self.docker, "exec", name, "id", "-u")
            ro = sh(self.docker, "inspect", "-f", "{{.HostConfig.ReadonlyRootfs}}", name)
            write = subprocess.run([self.docker, "exec", name, "touch", "/app/probe"], capture_output=True)
            proc_uid = sh(self.docker, "exec", name, "sh", "-c", "stat -c %u /proc/1")
            self.ok(uid == proc_uid == str(want_uid) and uid != "0",
                    f"{pool}: runs as uid {proc_uid} (chart: {want_uid}, non-root)")
            if cs[-1].get("securityContext", {}).get("readOnlyRootFilesystem"):
                self.ok(ro == "true" and write.returncode != 0, f"{pool}: read-only root filesystem "
                        f"(ReadonlyRootfs={ro}, touch /app/probe: {write.stderr.decode().strip().split(': ')[-1]})")

        # greedy equality through the gateway
        n1 = 128
        text, final, seconds = stream(addr["gateway"], n1)
        rate = final.usage.generated_tokens / seconds
        print(f"request 1: {final.usage.generated_tokens} tokens in {seconds:.1f} s ({rate:.0f} tokens/s), "
              f"draft method {final.usage.draft_method!r}")
        # the migrated stream must outlast the drain, or it simply drains in place (migrations = 0);
        # n-gram drafting speeds up on repetitive text, hence the margin
        gateway_env = env_of(self.docs, self.pods["gateway"][1][-1])
        drain = float(env_of(self.docs, self.pods["verify"][1][-1]).get("TANDEM_GRACE_SECONDS", 10))
        n2 = min(int(gateway_env.get("TANDEM_MAX_NEW_TOKENS", 2048)), max(a.tokens, int(4 * rate * drain)))
        t = time.monotonic()
        want = reference(Path(a.models) / model, n2)   # request 1's output is its prefix (greedy)
        print(f"reference: {model}, greedy, {n2} tokens with transformers on the host in "
              f"{time.monotonic() - t:.1f} s", flush=True)
        self.ok(text == want[: len(text)] and final.usage.generated_tokens == n1 and len(text) > 0,
                f"greedy output through the gateway container equals transformers' ({n1} tokens)")

        # migration: a second verify container, then `docker stop` of the one holding the stream
        verify2 = f"{PREFIX}-verify-2"
        addr2 = f"{self.ips['verify-2']}:{ports['verify']}"
        self.wait_serving({verify2: (f"{self.ips['verify-2']}:{probe['verify']}", self.docker_run("verify-2", self.pods["verify"][1][-1], verify2,
                                                            self.ips["verify-2"]))})
        for _ in range(100):   # both registered in Redis
            keys = sh(self.docker, "exec", f"{PREFIX}-redis", "redis-cli", "--scan", "--pattern", "tandem:worker:verify:*")
            if len(keys.split()) >= 2:
                break
            time.sleep(0.1)
        grace = str(self.pods["verify"][0].get("terminationGracePeriodSeconds", 30))
        stopped = {}

        def stop_holder():
            holder = next(n for n, ad in ((f"{PREFIX}-verify", addr["verify"]), (verify2, addr2)) if live_sessions(ad))
            stopped["name"] = holder

            def stop():
                t0 = time.monotonic()
                sh(self.docker, "stop", "-t", grace, holder)
                stopped["seconds"] = time.monotonic() - t0
            stopped["thread"] = threading.Thread(target=stop)
            stopped["thread"].start()

        text, final, seconds = stream(addr["gateway"], n2, during=stop_holder)
        stopped["thread"].join()
        code = sh(self.docker, "inspect", "-f", "{{.State.ExitCode}}", stopped["name"])
        print(f"request 2: {final.usage.generated_tokens} tokens in {seconds:.1f} s; docker stop -t {grace} "
              f"{stopped['name']} took {stopped['seconds']:.1f} s, exit code {code}")
        self.ok(final.usage.migrations == 1, f"docker stop mid-stream moved the stream "
                f"(usage.migrations = {final.usage.migrations}"
                + (f"; the stream ended within the {drain:.0f} s drain: raise --tokens)"
                   if final.usage.migrations == 0 and seconds < drain + 2 else ")"))
        self.ok(text == want and final.usage.generated_tokens == n2,
                f"the moved stream's output equals transformers' ({n2} tokens)")
        self.ok(code == "0", "the stopped verify container exited 0 (drained, left the registry)")

        print("\ntimings:")
        for name, seconds in self.timings.items():
            print(f"  {name:<24} docker run -> SERVING {seconds:6.1f} s")
        if a.build_seconds:
            print(f"  image build {a.build_seconds} s")
        print(f"\n{'FAILED: ' + '; '.join(self.failures) if self.failures else 'all checks passed'}")
        return 1 if self.failures else 0


def values_of(a) -> dict:
    """The values file, with --tls the tls.yaml example over it (merged key by key)."""
    values = load_values(a.values) or {}
    if a.tls:
        for key, value in load_values("tls").items():
            values[key] = {**values.get(key, {}), **value}
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", default="cpu-dev", help="a file of deploy/helm/values/ (without .yaml)")
    p.add_argument("--tls", action="store_true",
                   help="also apply values/tls.yaml: mutual TLS and a token, certificates generated here")
    p.add_argument("--show", action="store_true", help="print the rendered containers as JSON and exit")
    p.add_argument("--image", default="tandem:0.1.0-cpu")
    p.add_argument("--redis-image", default="tandem-redis-debian:bookworm")
    p.add_argument("--models", help="the host's preset cache models folder (mounted read-only)")
    p.add_argument("--docker", default="docker")
    p.add_argument("--subnet", default="10.213.7.0/24", help="the user-defined network's subnet")
    p.add_argument("--tokens", type=int, default=512,
                   help="least length of the migrated stream; it is made long enough to outlast the drain "
                        "(TANDEM_GRACE_SECONDS) at 4 times the first request's rate")
    p.add_argument("--build-seconds", default="")
    p.add_argument("--keep", action="store_true", help="leave the containers running")
    a = p.parse_args(argv)
    if a.show:
        docs = render_chart(values_of(a))
        out = {}
        for pool, (spec, cs) in containers_of(docs).items():
            out[pool] = {"podSecurityContext": spec.get("securityContext"), "containers": [
                {k: c.get(k) for k in ("name", "image", "command", "args", "securityContext", "volumeMounts")}
                | {"env": env_of(docs, c)} for c in cs]}
        print(json.dumps(out, indent=2))
        return 0
    if not a.models:
        p.error("--models is required")
    check = Check(a)
    try:
        return check.main()
    finally:
        if not a.keep:
            check.cleanup()
            check.remove_secrets()


if __name__ == "__main__":
    sys.exit(main())

"""The deployment: the Helm chart rendered with each example values file and every kustomize overlay,
linted by Helm's own library, validated against the Kubernetes schemas (kubernetes-validate, strict)
and checked for meaning: which pool gets GPUs, probes, drain timing, budgets, spreading, scaling,
Redis discovery, one target model name for gateway, verify and draft, dtypes that fit the device.

No cluster and no network: helm-python-sdk renders offline, kubectl kustomize renders locally.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm  # helm-python-sdk and kubernetes-validate: the test extra (make setup)
import kubernetes_validate as kv
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "tandem"
VALUES_DIR = ROOT / "deploy" / "helm" / "values"
OVERLAYS_DIR = ROOT / "deploy" / "k8s" / "overlays"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
# Custom resources whose schemas are not part of Kubernetes; their shape is checked below instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
POOLS = {"gateway": "gateway", "draft": "draft_worker", "verify": "verify_worker"}  # pool -> module
VALUES_FILES = sorted(p.stem for p in VALUES_DIR.glob("*.yaml"))
OVERLAYS = sorted(p.name for p in OVERLAYS_DIR.iterdir() if (p / "kustomization.yaml").is_file())
RELEASE, NAMESPACE = "tandem", "tandem"
DTYPES = {"float32", "bfloat16", "float16", "int8"}  # --dtype; int8 is CPU only


# ---- rendering ----

def load_values(name: str) -> dict | None:
    return None if name == "defaults" else yaml.safe_load((VALUES_DIR / f"{name}.yaml").read_text())


def render_chart(values: dict | None) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def require_tool(tool: str, why: str) -> None:
    """A missing tool skips the tests that need it on a workstation, and fails them under CI (the
    CI variable set, as .ci/run does), so a CI run never passes with the deploy tier skipped."""
    if shutil.which(tool) is None:
        message = f"{tool} is not installed; {why}"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{message} (CI is set: a missing tool fails the run)", pytrace=False)
        pytest.skip(message)


def render_overlay(name: str) -> list[dict]:
    require_tool("kubectl", "it renders the kustomize overlays")
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAYS_DIR / name)],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def charts() -> dict[str, list[dict]]:
    return {name: render_chart(load_values(name)) for name in ["defaults", *VALUES_FILES]}


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict]]:
    return {name: render_overlay(name) for name in OVERLAYS}


# ---- reading rendered objects ----

def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def component(obj: dict) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def pool_deployments(docs: list[dict]) -> dict[str, dict]:
    deployments = {component(d): d for d in find(docs, "Deployment") if component(d) in POOLS}
    assert set(deployments) == set(POOLS), f"pools rendered: {sorted(deployments)}"
    return deployments


def main_container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(docs: list[dict], container: dict) -> dict[str, object]:
    """The container's environment: ConfigMap envFrom first, then env (which wins, as in a pod).
    A configMapKeyRef reads the ConfigMap; other valueFrom sources stay as they are."""
    env: dict[str, object] = {}
    for source in container.get("envFrom", []):
        env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            env[var["name"]] = one(docs, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            env[var["name"]] = var["value"] if "value" in var else var["valueFrom"]
    return env


def expand(text: str, env: dict[str, object]) -> str:
    """$(VAR) references in args, as the kubelet expands them."""
    return re.sub(r"\$\((\w+)\)", lambda m: str(env.get(m.group(1), m.group(0))), text)


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def all_renders(charts, overlays) -> dict[str, list[dict]]:
    return {**{f"helm:{k}": v for k, v in charts.items()}, **{f"kustomize:{k}": v for k, v in overlays.items()}}


# ---- lint and schemas ----

@pytest.mark.parametrize("values_name", ["defaults", *VALUES_FILES])
def test_chart_lints_without_warnings(values_name):
    for version in KUBE_VERSIONS:
        report = helm.lint(CHART, load_values(values_name), strict=True, kube_version=f"v{version}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], (version, problems, report["errors"])


def validate_all(docs: list[dict]) -> list[str]:
    """kubernetes-validate --strict for each object; returns the kinds left to CRD checks."""
    skipped = []
    for doc in docs:
        for version in KUBE_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except SchemaNotFoundError:
                assert (doc["apiVersion"], doc["kind"]) in CRD_KINDS, f"no schema for {doc['kind']}"
                skipped.append(doc["kind"])
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {path}: {e.message}")
    return skipped


def test_every_rendered_manifest_is_valid(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        assert len(docs) >= 9, f"{name} rendered only {len(docs)} objects"
        validate_all(docs)


def test_the_validator_can_fail(charts):
    broken = json.loads(json.dumps(pool_deployments(charts["defaults"])["verify"]))
    main_container(broken)["readinesProbe"] = main_container(broken).pop("readinessProbe")
    with pytest.raises(kv.ValidationError, match="readinesProbe"):
        kv.validate(broken, KUBE_VERSIONS[0], strict=True)


def test_values_schema_rejects_typos_and_bad_numbers():
    with pytest.raises(helm.HelmValuesError, match="additional properties 'replica' not allowed"):
        render_chart({"verify": {"replica": 3}})
    with pytest.raises(helm.HelmValuesError, match="gpu/count"):
        render_chart({"verify": {"gpu": {"count": -1}}})


def test_custom_resources_have_the_shape_their_operators_expect(charts):
    monitor = one(charts["observability"], "ServiceMonitor", "tandem")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert set(monitor["spec"]["selector"]["matchExpressions"][0]["values"]) == set(POOLS)
    for obj in find(charts["keda"], "ScaledObject"):
        assert obj["spec"]["scaleTargetRef"]["name"] == obj["metadata"]["name"]
        trigger = obj["spec"]["triggers"][0]
        assert trigger["type"] == "prometheus"
        assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}


# ---- meaning ----

def test_gpus_go_where_the_values_say(charts, overlays):
    for docs in (charts["gpu"], overlays["gpu"], overlays["gpu-autoscaling"]):
        pools = pool_deployments(docs)
        assert gpus(main_container(pools["verify"])) == 1
        assert gpus(main_container(pools["draft"])) == 1
        assert gpus(main_container(pools["gateway"])) == 0
        for pool in ("draft", "verify"):
            spec = pools[pool]["spec"]["template"]["spec"]
            assert env_of(docs, main_container(pools[pool]))["TANDEM_DEVICE"] == "cuda"
            assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
            assert spec["nodeSelector"]["tandem/pool"] == pool
        requests = main_container(pools["verify"])["resources"]["requests"]
        assert int(requests["nvidia.com/gpu"]) == 1
    for docs in (charts["defaults"], charts["cpu-dev"], overlays["cpu-dev"]):
        pools = pool_deployments(docs)
        assert all(gpus(main_container(d)) == 0 for d in pools.values())
        assert env_of(docs, main_container(pools["verify"]))["TANDEM_DEVICE"] == "cpu"
    only_draft = pool_deployments(render_chart({"draft": {"gpu": {"count": 2}}}))
    assert (gpus(main_container(only_draft["draft"])), gpus(main_container(only_draft["verify"]))) == (2, 0)


def test_probes_are_native_grpc_on_the_service_port(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        for pool, deployment in pool_deployments(docs).items():
            container = main_container(deployment)
            env = env_of(docs, container)
            port = int(env["TANDEM_PORT"])
            assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == port
            # With TLS, kubelet (which cannot speak it) probes the plaintext health-only port.
            probe_port = int(env["TANDEM_HEALTH_PORT"]) if "TANDEM_TLS_CERT_FILE" in env else port
            assert ("TANDEM_TLS_CERT_FILE" in env) != (env.get("TANDEM_INSECURE") == "true"), (name, pool)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"] == {"port": probe_port}, (name, pool, probe)
            # model loading is covered by the startup probe, not by liveness restarts
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, (name, pool)


def module_constant(path: str, name: str) -> float:
    """A module-level number from a service source file, read without importing it."""
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return float(ast.literal_eval(node.value))
    raise AssertionError(f"{name} not found in {path}")


def test_termination_grace_outlasts_pre_stop_notice_and_drain(charts, overlays):
    # After SIGTERM a service reports NOT_SERVING for a short notice, then drains; a worker first
    # leaves the Redis registry, which takes up to a connect plus a command timeout when Redis is down.
    notice = module_constant("tandem/service/server.py", "DRAIN_NOTICE_S")
    deregister = 2 * module_constant("tandem/cluster/redis_conn.py", "TIMEOUT_S")
    longer = render_chart({"graceSeconds": 45, "preStopSleepSeconds": 8})
    for name, docs in {**all_renders(charts, overlays), "helm:grace 45": longer}.items():
        for pool, deployment in pool_deployments(docs).items():
            container = main_container(deployment)
            pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
            drain = float(env_of(docs, container)["TANDEM_GRACE_SECONDS"])
            leave = 0.0 if pool == "gateway" else deregister
            grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace > pre_stop + notice + leave + drain, (name, pool, grace, pre_stop, drain)
    # preStop 8 + ceil(45 + 0.5) + margin 15
    assert pool_deployments(longer)["verify"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 69


def test_each_pool_has_its_own_disruption_budget(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        budgets = find(docs, "PodDisruptionBudget")
        if name == "helm:cpu-dev":  # one replica each: budgets switched off on purpose
            assert budgets == []
            continue
        for pool, deployment in pool_deployments(docs).items():
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            covering = [b for b in budgets if matches(b["spec"]["selector"], labels)]
            assert len(covering) == 1, (name, pool, len(covering))
            assert covering[0]["spec"]["maxUnavailable"] == 1


def test_replicas_spread_over_nodes(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        for pool, deployment in pool_deployments(docs).items():
            anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
            terms = [t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
            terms += anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
            own = deployment["spec"]["template"]["metadata"]["labels"]
            assert any(t["topologyKey"] == "kubernetes.io/hostname" and matches(t["labelSelector"], own)
                       for t in terms), (name, pool)
    hard = pool_deployments(charts["gpu"])["verify"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in hard


def test_pools_have_independent_replica_counts():
    pools = pool_deployments(render_chart({"gateway": {"replicas": 2}, "draft": {"replicas": 5},
                                           "verify": {"replicas": 3}}))
    assert {p: d["spec"]["replicas"] for p, d in pools.items()} == {"gateway": 2, "draft": 5, "verify": 3}


def hpa_by_target(docs: list[dict]) -> dict[str, dict]:
    return {h["spec"]["scaleTargetRef"]["name"]: h for h in find(docs, "HorizontalPodAutoscaler")}


def pod_metrics(hpa: dict) -> list[str]:
    return [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]


def test_each_pool_scales_on_its_own_signal(charts, overlays):
    for docs in (charts["autoscaling"], overlays["gpu-autoscaling"]):
        pools = pool_deployments(docs)
        hpas = hpa_by_target(docs)
        assert set(hpas) == {d["metadata"]["name"] for d in pools.values()}
        assert pod_metrics(hpas[pools["verify"]["metadata"]["name"]]) == ["tandem_verify_queue_depth"]
        assert pod_metrics(hpas[pools["draft"]["metadata"]["name"]]) == ["tandem_draft_queue_depth"]
        assert pod_metrics(hpas[pools["gateway"]["metadata"]["name"]]) == []
        assert all("replicas" not in d["spec"] for d in pools.values()), "the HPAs own the replica counts"
    # changing one pool's bounds leaves the other's alone
    values = load_values("autoscaling")
    values["verify"]["autoscaling"]["maxReplicas"] = 9
    hpas = hpa_by_target(render_chart(values))
    assert (hpas["tandem-verify"]["spec"]["maxReplicas"], hpas["tandem-draft"]["spec"]["maxReplicas"]) == (9, 12)
    assert hpa_by_target(charts["defaults"]) == {}


def test_keda_scales_the_worker_pools_from_prometheus(charts):
    docs = charts["keda"]
    assert find(docs, "HorizontalPodAutoscaler") == []  # KEDA makes its own
    scaled = {o["metadata"]["name"]: o for o in find(docs, "ScaledObject")}
    assert set(scaled) == {"tandem-draft", "tandem-verify"}
    query = scaled["tandem-verify"]["spec"]["triggers"][0]["metadata"]["query"]
    assert query.startswith("sum(tandem_verify_queue_depth{") and 'pod=~"tandem-verify-.*"' in query
    assert "tandem_draft_queue_depth" in scaled["tandem-draft"]["spec"]["triggers"][0]["metadata"]["query"]
    assert all("replicas" not in d["spec"] for p, d in pool_deployments(docs).items() if p != "gateway")
    with pytest.raises(helm.HelmError, match="not both"):
        render_chart({"verify": {"keda": {"enabled": True}, "autoscaling": {"enabled": True}}})


def test_the_gateway_finds_worker_pods_in_redis(charts, overlays):
    """Discovery through Redis everywhere: no static worker lists (they would switch it off), a
    REDIS_URL in every pod, and each worker advertising its own pod IP, so the gateway dials pods
    and spreads requests over them instead of holding one connection to a Service."""
    for name, docs in all_renders(charts, overlays).items():
        pools = pool_deployments(docs)
        gateway = env_of(docs, main_container(pools["gateway"]))
        assert not {"TANDEM_VERIFY_WORKERS", "TANDEM_DRAFT_WORKERS"} & set(gateway), name
        for pool, deployment in pools.items():
            env = env_of(docs, main_container(deployment))
            assert "REDIS_URL" in env, (name, pool)
            if pool != "gateway":
                assert env["TANDEM_ADVERTISE_ADDRESS"] == f"$(POD_IP):{env['TANDEM_PORT']}", (name, pool)
                assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}, (name, pool)
    for docs in (charts["defaults"], *overlays.values()):
        redis = one(docs, "Service", "tandem-redis")
        host_port = env_of(docs, main_container(pool_deployments(docs)["gateway"]))["REDIS_URL"].split("/")[2]
        assert host_port == f"tandem-redis:{redis['spec']['ports'][0]['port']}"
    with pytest.raises(helm.HelmError, match="needs a Redis"):
        render_chart({"redis": {"enabled": False}})


def test_static_discovery_is_an_explicit_choice_naming_the_pools_services():
    docs = render_chart({"gateway": {"workerDiscovery": "static"}})
    pools = pool_deployments(docs)
    env = env_of(docs, main_container(pools["gateway"]))
    for pool, flag in (("verify", "TANDEM_VERIFY_WORKERS"), ("draft", "TANDEM_DRAFT_WORKERS")):
        host, port = env[flag].split(":")
        service = one(docs, "Service", host)
        assert matches({"matchLabels": service["spec"]["selector"]},
                       pools[pool]["spec"]["template"]["metadata"]["labels"]), pool
        grpc_port = {p["name"]: p for p in service["spec"]["ports"]}["grpc"]
        assert grpc_port["port"] == int(port) == int(env_of(docs, main_container(pools[pool]))["TANDEM_PORT"])
    without_redis = render_chart({"gateway": {"workerDiscovery": "static"}, "redis": {"enabled": False}})
    assert "TANDEM_VERIFY_WORKERS" in env_of(without_redis, main_container(pool_deployments(without_redis)["gateway"]))


def target_model_names(docs: list[dict]) -> dict[str, object]:
    """The names the registry matches: gateway and verify TANDEM_MODEL, draft TANDEM_TARGET_MODEL."""
    pools = pool_deployments(docs)
    return {"gateway": env_of(docs, main_container(pools["gateway"]))["TANDEM_MODEL"],
            "verify": env_of(docs, main_container(pools["verify"]))["TANDEM_MODEL"],
            "draft": env_of(docs, main_container(pools["draft"])).get("TANDEM_TARGET_MODEL")}


def test_gateway_verify_and_draft_name_the_same_target(charts, overlays):
    """The registry compares model names as strings: a draft with another (or no) TANDEM_TARGET_MODEL
    is only used for n-gram drafting, a verify worker under another name not at all."""
    for name, docs in all_renders(charts, overlays).items():
        names = target_model_names(docs)
        assert len(set(names.values())) == 1 and names["gateway"], (name, names)
    # the check sees a difference ...
    docs = json.loads(json.dumps(charts["gpu"]))
    for var in main_container(pool_deployments(docs)["draft"])["env"]:
        if var["name"] == "TANDEM_TARGET_MODEL":
            var["value"] = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert len(set(target_model_names(docs).values())) == 2
    # ... the chart derives the draft's target from the verify model, and refuses another spelling
    renamed = target_model_names(render_chart({"verify": {"model": "smollm2-135m-instruct"}}))
    assert set(renamed.values()) == {"smollm2-135m-instruct"}
    with pytest.raises(helm.HelmError, match="spelled exactly as verify.model"):
        render_chart({"gateway": {"model": "/models/qwen2.5-coder-1.5b-instruct"}})
    with pytest.raises(helm.HelmValuesError, match="additional properties 'targetModel' not allowed"):
        render_chart({"draft": {"targetModel": "qwen2.5-coder-1.5b-instruct"}})


def test_worker_dtypes_fit_their_device_and_the_kv_budget_is_set(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        pools = pool_deployments(docs)
        for pool in ("draft", "verify"):
            env = env_of(docs, main_container(pools[pool]))
            assert env["TANDEM_DTYPE"] in DTYPES, (name, pool)
            assert env["TANDEM_DTYPE"] != "int8" or env["TANDEM_DEVICE"] == "cpu", (name, pool)
            assert env["TANDEM_CALIBRATE"] == "true", (name, pool)
        verify, draft = (env_of(docs, main_container(pools[p])) for p in ("verify", "draft"))
        # the development values check greedy output against transformers' float32 (image-check)
        assert verify["TANDEM_DTYPE"] == ("float32" if name == "helm:cpu-dev" else "bfloat16"), name
        assert draft["TANDEM_DTYPE"] == ("int8" if draft["TANDEM_DEVICE"] == "cpu" else "bfloat16"), name
        assert int(verify["TANDEM_KV_BUDGET_TOKENS"]) == 32768, name
        gateway = env_of(docs, main_container(pools["gateway"]))
        if name.startswith("helm:") and "TANDEM_VERIFY_WORKERS" not in gateway:
            # the gateway routes to verify workers of the pool's dtype only (not a stale release's)
            assert gateway["TANDEM_VERIFY_DTYPE"] == verify["TANDEM_DTYPE"], name
    docs = render_chart({"verify": {"kvBudgetTokens": 1048576, "calibrate": False, "dtype": "bfloat16"}})
    env = env_of(docs, main_container(pool_deployments(docs)["verify"]))
    assert (env["TANDEM_KV_BUDGET_TOKENS"], env["TANDEM_CALIBRATE"], env["TANDEM_DTYPE"]) == ("1048576", "false", "bfloat16")
    with pytest.raises(helm.HelmError, match="CPU only"):
        render_chart({"draft": {"gpu": {"count": 1}, "dtype": "int8"}})
    with pytest.raises(helm.HelmError, match="GPU only"):
        render_chart({"verify": {"dtype": "float16"}})
    with pytest.raises(helm.HelmValuesError, match="kvBudgetTokens"):
        render_chart({"verify": {"kvBudgetTokens": -1}})


def test_models_are_fetched_into_a_volume_not_baked_in(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        for pool, deployment in pool_deployments(docs).items():
            spec = deployment["spec"]["template"]["spec"]
            container = main_container(deployment)
            env = env_of(docs, container)
            model = env.get("TANDEM_MODEL")
            inits = spec.get("initContainers", [])
            if model == "none":  # n-gram drafting only: nothing to fetch
                assert inits == [], (name, pool)
                continue
            assert len(inits) == 1, (name, pool)
            args = [expand(a, env_of(docs, inits[0])) for a in inits[0]["args"]]
            assert args[:2] == ["tandem.presets", "fetch"] and model in args[2:], (name, pool, args)
            if pool == "draft":  # the vocabulary check before start-up reads the target too
                assert env["TANDEM_TARGET_MODEL"] in args[2:], (name, args)
            cache = env["TANDEM_CACHE_DIR"]
            for c in (container, inits[0]):
                assert env_of(docs, c)["TANDEM_CACHE_DIR"] == cache
                assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[cache] == "models"
    shared = pool_deployments(charts["gpu"])["verify"]["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v for v in shared}["models"]["persistentVolumeClaim"]["claimName"] == "tandem-models"
    assert len(find(charts["gpu"], "PersistentVolumeClaim")) == 1


def test_pods_run_as_non_root_with_a_read_only_root(charts, overlays):
    for name, docs in all_renders(charts, overlays).items():
        for pool, deployment in pool_deployments(docs).items():
            spec = deployment["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                assert c["securityContext"]["readOnlyRootFilesystem"] is True, (name, pool, c["name"])
                assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_redis_is_bundled_or_external(charts):
    bundled = charts["defaults"]
    assert one(bundled, "Service", "tandem-redis")
    for deployment in pool_deployments(bundled).values():
        assert env_of(bundled, main_container(deployment))["REDIS_URL"] == "redis://tandem-redis:6379/0"
    external = charts["external-redis"]
    assert find(external, "Deployment", "tandem-redis") == [] and find(external, "Secret") == []
    for deployment in pool_deployments(external).values():
        ref = env_of(external, main_container(deployment))["REDIS_URL"]["secretKeyRef"]
        assert ref == {"name": "tandem-redis-url", "key": "REDIS_URL"}
    by_url = render_chart({"redis": {"enabled": False, "external": {"url": "rediss://cache:6380/0"}}})
    secret = one(by_url, "Secret", "tandem-redis")
    assert secret["stringData"] == {"REDIS_URL": "rediss://cache:6380/0"}
    with pytest.raises(helm.HelmError, match="redis.enabled=false"):
        render_chart({"redis": {"external": {"url": "redis://cache:6379/0"}}})


def test_metrics_and_tracing_settings_reach_every_pool(charts):
    for docs in (charts["defaults"], charts["observability"]):
        for deployment in pool_deployments(docs).values():
            container = main_container(deployment)
            assert env_of(docs, container)["TANDEM_METRICS_PORT"] == "9090"
            assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == 9090
    names = set()
    for deployment in pool_deployments(charts["observability"]).values():
        env = env_of(charts["observability"], main_container(deployment))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
        names.add(env["OTEL_SERVICE_NAME"])
    assert names == {"tandem-gateway", "tandem-draft", "tandem-verify"}
    assert not any(k.startswith("OTEL_") for k in env_of(charts["defaults"], main_container(
        pool_deployments(charts["defaults"])["verify"])))


# ---- the manifests and the code agree ----

def service_flags() -> dict[str, set[str]]:
    """TANDEM_* variables each service reads, from the add_flag calls in its source."""
    def flags_in(tree: ast.AST) -> set[str]:
        return {"TANDEM_" + call.args[1].value.lstrip("-").replace("-", "_").upper()
                for call in ast.walk(tree) if isinstance(call, ast.Call)
                and getattr(call.func, "id", None) == "add_flag" and len(call.args) > 1
                and isinstance(call.args[1], ast.Constant)}

    config = ast.parse((ROOT / "tandem" / "service" / "config.py").read_text())
    shared = {f.name: flags_in(f) for f in config.body if isinstance(f, ast.FunctionDef)}
    result = {}
    for pool, module in POOLS.items():
        tree = ast.parse((ROOT / module / "__main__.py").read_text())
        called = {c.func.id for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        result[pool] = flags_in(tree).union(*(shared[f] for f in called if f in shared))
    return result


# Read by tandem.presets (the init container's fetch, and model resolution in every pod).
NOT_FLAGS = {"TANDEM_CACHE_DIR"}
# Flags of work on other branches, set ahead so the manifests need no change when it merges:
# --metrics-port (every service) and the speed work's --dtype / --calibrate (the workers).
# Once a service reads one, the check below covers it like any other flag.
NOT_MERGED = {"gateway": {"TANDEM_METRICS_PORT"},
              "draft": {"TANDEM_METRICS_PORT", "TANDEM_DTYPE", "TANDEM_CALIBRATE"},
              "verify": {"TANDEM_METRICS_PORT", "TANDEM_DTYPE", "TANDEM_CALIBRATE"}}


def test_tls_and_tokens_come_from_mounted_secrets(charts):
    docs = charts["tls"]
    for pool, deployment in pool_deployments(docs).items():
        container, spec = main_container(deployment), deployment["spec"]["template"]["spec"]
        env = env_of(docs, container)
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        for var in ("TANDEM_TLS_CERT_FILE", "TANDEM_TLS_KEY_FILE", "TANDEM_TLS_CA_FILE"):
            assert secrets[mounts[env[var].rsplit("/", 1)[0]]] == "tandem-tls", (pool, var)
        assert env["TANDEM_TLS_SERVER_NAME"] == "tandem-internal"
        assert not any("subPath" in m for m in container["volumeMounts"])    # so rotation reaches the pod
        if pool == "gateway":
            assert secrets[mounts[env["TANDEM_AUTH_TOKENS_FILE"].rsplit("/", 1)[0]]] == "tandem-tokens"
        else:
            assert "TANDEM_AUTH_TOKENS_FILE" not in env


def test_every_tandem_variable_set_is_one_a_service_reads(charts, overlays):
    flags = service_flags()
    assert {"TANDEM_VERIFY_WORKERS", "TANDEM_GRACE_SECONDS", "TANDEM_MAX_MIGRATIONS"} <= flags["gateway"]
    assert {"TANDEM_MAX_PROPOSAL", "TANDEM_KV_BUDGET_TOKENS", "TANDEM_ADVERTISE_ADDRESS"} <= flags["verify"]
    assert {"TANDEM_TARGET_MODEL", "TANDEM_HEARTBEAT_SECONDS", "TANDEM_DEVICE"} <= flags["draft"]
    for name, docs in all_renders(charts, overlays).items():
        for pool, deployment in pool_deployments(docs).items():
            container = main_container(deployment)
            assert container["args"] == [POOLS[pool]], (name, pool)
            unknown = ({k for k in env_of(docs, container) if k.startswith("TANDEM_")}
                       - flags[pool] - NOT_FLAGS - NOT_MERGED[pool])
            assert not unknown, f"{name}: {pool} sets {sorted(unknown)}, which {POOLS[pool]} does not read"


def test_the_image_has_both_variants_runs_as_non_root_and_bakes_no_model():
    text = DOCKERFILE.read_text()
    stages = {stage for _, stage in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.M)}
    assert {"base-cpu", "base-gpu", "build", "runtime"} <= stages
    assert re.search(r"^FROM base-\$\{VARIANT\} AS runtime$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and not users[-1].startswith(("root", "0"))
    assert "presets fetch" not in text and "/models" in text
    for source in re.findall(r"^COPY (?!--from)(\S+) ", text, re.M):
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    for module in POOLS.values():
        assert (ROOT / module / "__main__.py").is_file() and f"COPY {module} " in text

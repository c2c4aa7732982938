"""TLS, mutual TLS, bearer tokens and Redis ACL + TLS, with the three services as real processes.

One stack runs everything at once: the gateway's public endpoint on TLS with tokens from a file,
mutual TLS between gateway, draft and verify workers, and Redis with an ACL user over TLS."""

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fmaas import generation_pb2 as tgis_pb
from fmaas import generation_pb2_grpc as tgis_grpc
from tandem.client import build_request
from tandem.cluster.redis_conn import RedisServer, free_port
from tandem.launch import Stack
from tandem.speculation.sampling import SamplingParams
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.v1 import internal_pb2 as ipb
from tandem.v1 import internal_pb2_grpc as ipb_grpc
from tests.certs import CA, SERVER_NAME
from tests.local import reference

pytestmark = pytest.mark.system

TOKEN, TGIS_ONLY, ROTATED = "tok-alpha-3f9c2e", "tok-tgis-77aa01", "tok-rotated-b1c4d8"
REDIS_PASSWORD = "redis-pw-9d8e7f"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    ca = CA(folder / "ca")
    return {"ca": ca, "service": ca.issue("service"), "client": ca.issue("client"),
            "rogue": CA(folder / "rogue", "rogue CA").issue("rogue")}


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(f"# comments and blank lines are fine\n\n{TOKEN} alice\n{TGIS_ONLY} bob tgis\n")
    return path


@pytest.fixture(scope="module")
def stack(tiny_pair, pki, tokens_file, tmp_path_factory):
    svc = pki["service"]
    redis = RedisServer(password=REDIS_PASSWORD, username="tandem", tls_files=(svc.cert, svc.key, svc.ca)).start()
    logs = tmp_path_factory.mktemp("logs")
    target, draft = tiny_pair
    health_port = free_port()
    try:
        with Stack(str(target), str(draft), threads=1, redis_url=redis.url, tls=svc, log_dir=str(logs),
                   gateway_args=["--auth-tokens-file", str(tokens_file)],
                   verify_args=["--health-port", str(health_port)], draft_args=["--no-adaptive-k"]) as s:
            s.health_port, s.log_folder = health_port, logs
            yield s
    finally:
        redis.stop()


def client_channel(stack, files, name="gateway"):
    return files.channel(stack.address(name))


def public_channel(stack, ca_path):
    """What a client of the public endpoint needs: the CA, no certificate of its own."""
    with open(ca_path, "rb") as f:
        creds = grpc.ssl_channel_credentials(f.read())
    return grpc.secure_channel(stack.address("gateway"), creds,
                               options=[("grpc.ssl_target_name_override", SERVER_NAME)])


def bearer(token):
    return (("authorization", f"Bearer {token}"),)


def test_generation_over_tls_and_mutual_tls_equals_target_greedy(stack, pki, tiny_pair, tiny_models):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompt = "def add(a, b):"
    expected = reference(tiny_models[0], tok(prompt).input_ids, SamplingParams(max_new_tokens=24))
    with public_channel(stack, pki["service"].ca) as ch:
        msgs = list(pb_grpc.GenerationServiceStub(ch).GenerateStream(
            build_request(prompt, max_new_tokens=24, method="model", k=3), timeout=60, metadata=bearer(TOKEN)))
    assert "".join(m.text for m in msgs) == tok.decode(expected, skip_special_tokens=True)
    assert msgs[-1].usage.draft_tokens > 0          # the draft worker reached the verify worker over mTLS


def test_plaintext_client_gets_no_answer(stack):
    with grpc.insecure_channel(stack.address("gateway")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationServiceStub(ch).Generate(build_request("x", max_new_tokens=2), timeout=5,
                                                      metadata=bearer(TOKEN))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("metadata", [(), bearer("not-a-token"), (("authorization", TOKEN),),
                                      (("authorization", "Basic " + TOKEN),), bearer("")])
def test_missing_or_wrong_token_is_unauthenticated(stack, pki, metadata):
    with public_channel(stack, pki["service"].ca) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationServiceStub(ch).GenerateStream(build_request("x", max_new_tokens=2),
                                                                 timeout=10, metadata=metadata))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN not in e.value.details() and "not-a-token" not in e.value.details()


def test_token_scoped_to_tgis(stack, pki):
    with public_channel(stack, pki["service"].ca) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationServiceStub(ch).Generate(build_request("x", max_new_tokens=2), timeout=10,
                                                      metadata=bearer(TGIS_ONLY))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        info = tgis_grpc.GenerationServiceStub(ch).ModelInfo(tgis_pb.ModelInfoRequest(), timeout=10,
                                                             metadata=bearer(TGIS_ONLY))
        assert info.max_sequence_length > 0


def test_health_stays_open(stack, pki):
    with public_channel(stack, pki["service"].ca) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # The workers' plaintext probe port serves health and nothing else.
    with grpc.insecure_channel(f"127.0.0.1:{stack.health_port}") as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            ipb_grpc.VerifyServiceStub(ch).Status(ipb.StatusRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_tokens_rotate_without_restart(stack, pki, tokens_file):
    pid = stack.procs["gateway"].pid
    original = tokens_file.read_text()
    with public_channel(stack, pki["service"].ca) as ch:
        stub = tgis_grpc.GenerationServiceStub(ch)
        def code(token):
            try:
                stub.ModelInfo(tgis_pb.ModelInfoRequest(), timeout=10, metadata=bearer(token))
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()
        assert (code(TOKEN), code(ROTATED)) == (grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED)
        try:
            # As a Kubernetes Secret update does it: a new file moved into place.
            tmp = tokens_file.with_name("tokens.new")
            tmp.write_text(f"{ROTATED} alice\n")
            os.replace(tmp, tokens_file)
            deadline = time.monotonic() + 10
            while code(ROTATED) != grpc.StatusCode.OK and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (code(TOKEN), code(ROTATED)) == (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK)
        finally:
            tokens_file.write_text(original)
            deadline = time.monotonic() + 10
            while code(TOKEN) != grpc.StatusCode.OK and time.monotonic() < deadline:
                time.sleep(0.2)
    assert stack.procs["gateway"].pid == pid and stack.procs["gateway"].poll() is None


@pytest.mark.parametrize("name", ["verify_worker", "draft_worker"])
def test_workers_refuse_peers_without_a_valid_client_certificate(stack, pki, name):
    stub_cls = ipb_grpc.VerifyServiceStub if name == "verify_worker" else ipb_grpc.DraftServiceStub
    with client_channel(stack, pki["client"], name) as ch:     # signed by the CA: accepted
        assert stub_cls(ch).Status(ipb.StatusRequest(), timeout=5).model
    with open(pki["service"].ca, "rb") as f:
        ca = f.read()
    no_cert = grpc.secure_channel(stack.address(name), grpc.ssl_channel_credentials(ca),
                                  options=[("grpc.ssl_target_name_override", SERVER_NAME)])
    rogue = pki["rogue"]
    with open(rogue.cert, "rb") as c, open(rogue.key, "rb") as k:
        wrong_ca = grpc.secure_channel(stack.address(name), grpc.ssl_channel_credentials(ca, k.read(), c.read()),
                                       options=[("grpc.ssl_target_name_override", SERVER_NAME)])
    for ch in (no_cert, wrong_ca, grpc.insecure_channel(stack.address(name))):
        with ch, pytest.raises(grpc.RpcError) as e:
            stub_cls(ch).Status(ipb.StatusRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_no_secret_in_any_log(stack, pki):
    with public_channel(stack, pki["service"].ca) as ch:       # a request, so there is something to log
        pb_grpc.GenerationServiceStub(ch).Generate(build_request("x", max_new_tokens=2), timeout=30,
                                                  metadata=bearer(TOKEN))
    text = "".join(p.read_text(errors="replace") for p in stack.log_folder.iterdir())
    assert '"message": "gateway serving' in text and "mutual TLS" in text    # the logs were written
    for secret in (TOKEN, TGIS_ONLY, ROTATED, REDIS_PASSWORD):
        assert secret not in text
    with open(pki["service"].key) as f:
        assert f.read().splitlines()[1] not in text


@pytest.mark.parametrize("args,message", [
    ([], "--insecure"),
    (["--insecure", "--tls-cert-file", "x.pem"], "exclude each other"),
    (["--tls-cert-file", "/nonexistent.pem", "--tls-key-file", "k", "--tls-ca-file", "c"], "cannot read"),
])
def test_a_service_without_an_explicit_transport_refuses_to_start(args, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    out = subprocess.run([sys.executable, "-m", "verify_worker", "--model", "none", *args], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr


def test_command_line_client_speaks_tls_with_a_token(stack, pki, tiny_pair, tiny_models):
    import io

    from transformers import AutoTokenizer

    from tandem import client
    tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    expected = reference(tiny_models[0], tok("def f(x):").input_ids, SamplingParams(max_new_tokens=4))
    out = io.StringIO()
    last = client.run(stack.address("gateway"), "def f(x):", out=out, ca_file=pki["service"].ca,
                      server_name=SERVER_NAME, token=TOKEN, max_new_tokens=4)
    assert last.usage.generated_tokens == len(expected) > 0
    assert out.getvalue().startswith(tok.decode(expected, skip_special_tokens=True) + "\n\n[")   # then the summary

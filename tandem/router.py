"""The Shepherd Model Gateway (SMG, `smg` on PyPI) in front of a Tandem gateway, as a process: an
OpenAI-compatible HTTP API whose requests reach Tandem over the vLLM engine protocol (the
gateway's vllm.grpc.engine face). SMG tokenizes, renders chat templates and detokenizes; it takes
the tokenizer from the folder GetModelInfo names, or fetches it with GetTokenizer. Used by the
tests and benchmarks; by hand it is one command:

    smg launch --worker-urls grpc://GATEWAY_HOST:PORT --port 30000
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from tandem.cluster.redis_conn import free_port


@dataclass
class SmgRouter:
    gateway: str                          # host:port of a Tandem gateway
    host: str = "127.0.0.1"
    port: int = 0
    log_path: str = ""                    # its log (else discarded)
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    model: str = ""                       # the served model's id, once started

    @property
    def url(self) -> str:
        """The OpenAI API's base URL."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 120) -> SmgRouter:
        self.port = self.port or free_port()
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "smg", "launch", "--worker-urls", f"grpc://{self.gateway}", "--host",
                 self.host, "--port", str(self.port), "--prometheus-port", str(free_port()), "--log-level", "warn",
                 *self.extra_args], stdout=log, stderr=log)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()                 # the process has its own copy
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until the router lists the model and has its tokenizer: a one-token chat completion answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with status {self.proc.returncode}")
            try:
                if not self.model:
                    models = self._call("GET", "/models")["data"]
                    self.model = models[0]["id"] if models else ""
                if self.model:
                    self._call("POST", "/chat/completions", {"model": self.model, "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": "hi"}]})
                    return
            except (urllib.error.URLError, OSError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"smg on port {self.port} did not serve {self.gateway} within {timeout:.0f}s")

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def stop(self, grace: float = 10) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> SmgRouter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Command-line flags with environment-variable twins (`--max-batch-tokens` <-> `TANDEM_MAX_BATCH_TOKENS`)."""

from __future__ import annotations

import argparse
import os
from typing import Any


def env_name(flag: str) -> str:
    return "TANDEM_" + flag.lstrip("-").replace("-", "_").upper()


def add_flag(parser: argparse.ArgumentParser, flag: str, *, default: Any, type: type = str,
             help: str = "") -> None:
    """Adds `flag`; its default comes from the environment twin when that is set."""
    env = env_name(flag)
    raw = os.environ.get(env)
    value = default
    if raw is not None:
        value = (raw.lower() in ("1", "true", "yes", "on")) if type is bool else type(raw)
    if type is bool:
        parser.add_argument(flag, default=value, action=argparse.BooleanOptionalAction,
                            help=f"{help} [env {env}]")
    else:
        parser.add_argument(flag, default=value, type=type, help=f"{help} [env {env}, default {default}]")


def add_common_flags(parser: argparse.ArgumentParser, default_port: int, default_metrics_port: int) -> None:
    from tandem.service.server import MAX_MESSAGE_BYTES
    add_flag(parser, "--host", default="127.0.0.1", help="address to listen on")
    add_flag(parser, "--port", default=default_port, type=int, help="gRPC port")
    add_flag(parser, "--health-port", default=0, type=int,
             help="plaintext port serving only grpc.health.v1, for probes that cannot speak TLS (0 = none)")
    add_flag(parser, "--max-message-bytes", default=MAX_MESSAGE_BYTES, type=int,
             help="largest gRPC message received or sent; larger ones get RESOURCE_EXHAUSTED")
    # Transport security (tandem.service.tls): certificates, or plaintext said out loud.
    add_flag(parser, "--insecure", default=False, type=bool,
             help="plaintext gRPC everywhere (local runs only); otherwise the --tls-* files are required")
    add_flag(parser, "--tls-cert-file", default="", help="PEM certificate of this service (server and client)")
    add_flag(parser, "--tls-key-file", default="", help="PEM private key of --tls-cert-file")
    add_flag(parser, "--tls-ca-file", default="",
             help="PEM CA that signs the services' certificates: peers must present one it signed")
    add_flag(parser, "--tls-server-name", default="",
             help="name the workers' certificates carry, checked instead of the dialed address")
    add_flag(parser, "--metrics-port", default=default_metrics_port, type=int,
             help="Prometheus /metrics HTTP port on --host (0 = off)")
    add_flag(parser, "--log-level", default="INFO", help="logging level")
    add_flag(parser, "--log-format", default="json", help="json (one object per line) or text")
    add_flag(parser, "--grace-seconds", default=10.0, type=float,
             help="how long in-flight streams may finish after SIGTERM")


def add_redis_flag(parser: argparse.ArgumentParser) -> None:
    from tandem.cluster.redis_conn import DEFAULT_URL, default_url
    add_flag(parser, "--redis-url", default=default_url(),
             help=f"Redis for the worker registry and sessions; REDIS_URL also sets it (default {DEFAULT_URL})")


def checked_redis_url(url: str) -> str:
    """--redis-url, or exit with what is wrong with it (before any model is loaded)."""
    from tandem.cluster.redis_conn import check_url
    try:
        return check_url(url)
    except ValueError as e:
        raise SystemExit(f"--redis-url / REDIS_URL: {e}") from None


def check_worker_flags(args: argparse.Namespace) -> None:
    """Exits with a clear message on registry and TLS flags that cannot work, before any model is loaded."""
    from tandem.service.tls import tls_from_args
    checked_redis_url(args.redis_url)
    tls_from_args(args)
    if not args.heartbeat_seconds > 0:
        raise SystemExit(f"--heartbeat-seconds must be > 0, got {args.heartbeat_seconds}")
    from tandem.engine.modeling import dtype_problem
    problem = dtype_problem(args.dtype, args.device)
    if problem:
        raise SystemExit(f"--dtype: {problem}")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    """How a worker announces itself in the Redis registry."""
    add_redis_flag(parser)
    add_flag(parser, "--advertise-address", default="",
             help="host:port the gateway dials; empty = --host:--port (the machine's name for 0.0.0.0)")
    add_flag(parser, "--heartbeat-seconds", default=2.0, type=float,
             help="registry heartbeat interval; the entry expires after three missed beats")


def add_model_flags(parser: argparse.ArgumentParser, default_model: str, default_dtype: str) -> None:
    add_flag(parser, "--model", default=default_model,
             help="preset name, Hugging Face folder or .gguf file")
    add_flag(parser, "--dtype", default=default_dtype,
             help="float32, bfloat16, float16 (GPU only), int8 (weights and each row of inputs in "
                  "int8, CPU only), or int4 (weights in 4 bits in groups of 64 inputs, the output layer "
                  "int8, inputs as int8's; CPU with AVX512-VNNI or AVX2 only, for a draft)")
    add_flag(parser, "--threads", default=2, type=int, help="torch intra-op threads")
    add_flag(parser, "--device", default="cpu", help="torch device, e.g. cpu or cuda")
    add_flag(parser, "--calibrate", default=True, type=bool,
             help="at start-up, measure the forward pass for each number of new tokens and pad "
                  "inputs to a longer length where that is faster; the verify worker also times passes "
                  "of 1, 2, 4, ... sessions, the speculation price's cost curve")
    add_flag(parser, "--packed-gemm", default=True, type=bool,
             help="float32 and bfloat16 on the CPU: run Linear layers in oneDNN on weights packed at start-up "
                  "instead of torch's stock kernel, which is not batch-invariant (a tied output layer gets its "
                  "own packed copy)")


def add_kv_flags(parser: argparse.ArgumentParser, default_tokens: int) -> None:
    """The KV cache pool a worker preallocates for all its sessions."""
    add_flag(parser, "--kv-budget-tokens", default=default_tokens, type=int,
             help="size of the preallocated KV cache pool, in token positions, all sessions together")
    add_flag(parser, "--kv-memory-mb", default=0, type=int,
             help="size of the KV cache pool in MiB; when set, overrides --kv-budget-tokens")


def check_kv_flags(args: argparse.Namespace) -> None:
    if args.kv_budget_tokens <= 0:
        raise SystemExit(f"--kv-budget-tokens must be > 0, got {args.kv_budget_tokens}")
    if args.kv_memory_mb < 0:
        raise SystemExit(f"--kv-memory-mb must be >= 0 (0 = use --kv-budget-tokens), got {args.kv_memory_mb}")


def add_guide_flags(parser: argparse.ArgumentParser) -> None:
    """Structured output (tandem.speculation.grammar): the bounds on what a request may ask."""
    add_flag(parser, "--max-guide-chars", default=65536, type=int,
             help="longest JSON Schema, regex or grammar (choices: all together) a request may set")
    add_flag(parser, "--guide-compile-timeout", default=10.0, type=float,
             help="seconds a guide may take to compile before the request is refused (INVALID_ARGUMENT)")


def check_guide_flags(args: argparse.Namespace) -> None:
    if args.max_guide_chars <= 0 or args.guide_compile_timeout <= 0:
        raise SystemExit("--max-guide-chars and --guide-compile-timeout must be > 0")

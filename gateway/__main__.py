"""python -m gateway: the public gRPC endpoint (tandem.v1, TGIS fmaas and vLLM's engine protocol)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from transformers import AutoConfig

from gateway.conversation import Conversations
from gateway.core import GenerationCore
from gateway.guard import ClientGuard, TokenSet
from gateway.request import Limits
from gateway.routing import RedisRouter, StaticRouter
from gateway.faces import SERVICES, add_faces
from gateway.observe import export_load
from gateway.vllm import ModelFacts
from tandem.cluster.redis_conn import connect, redacted
from tandem.cluster.registry import Registry
from tandem.cluster.sessions import SessionStore
from tandem.engine.modeling import DTYPES, context_length, load_tokenizer, resolve
from tandem.service.config import add_common_flags, add_flag, add_redis_flag, checked_redis_url
from tandem.service.server import service_from_args, setup_observability

log = logging.getLogger("gateway")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    add_common_flags(parser, default_port=50051, default_metrics_port=9090)
    add_flag(parser, "--public-tls-cert-file", default="",
             help="certificate for the public endpoint, when it is not --tls-cert-file")
    add_flag(parser, "--public-tls-key-file", default="", help="private key of --public-tls-cert-file")
    add_flag(parser, "--model", default="qwen2.5-coder-1.5b-instruct",
             help="the target model (its tokenizer and context length are used here)")
    add_redis_flag(parser)
    add_flag(parser, "--verify-workers", default="",
             help="static comma-separated host:port list instead of Redis discovery (no sessions kept)")
    add_flag(parser, "--draft-workers", default="", help="static draft workers, with --verify-workers")
    add_flag(parser, "--verify-dtype", default="",
             help="route only to verify workers registered at this --dtype (float32, bfloat16, int8, float16); "
                  "empty: any, with a warning when the target's workers differ in numerics")
    add_flag(parser, "--max-migrations", default=3, type=int,
             help="times one request may move to another worker after a worker fails")
    add_flag(parser, "--link-retry-seconds", default=2.0, type=float,
             help="after the link from a draft worker to a verify worker fails while that verify worker still "
                  "answers, its requests decode there without speculation this long, then try it again")
    add_flag(parser, "--session-ttl-seconds", default=3600.0, type=float,
             help="a session's history is kept this long after its last use")
    add_flag(parser, "--default-draft-method", default="model", help="model, ngram, head or none")
    add_flag(parser, "--default-speculative-tokens", default=16, type=int,
             help="k when a request leaves it 0 (an upper bound: the model drafter stops earlier on low confidence)")
    add_flag(parser, "--max-speculative-tokens", default=16, type=int, help="largest k a request may ask for")
    add_flag(parser, "--default-max-new-tokens", default=128, type=int, help="when a request leaves it 0")
    add_flag(parser, "--max-new-tokens", default=2048, type=int, help="largest max_new_tokens accepted")
    add_flag(parser, "--max-prompt-tokens", default=0, type=int,
             help="largest prompt accepted, in tokens (0 = the model's context window)")
    add_flag(parser, "--max-prompt-chars", default=1_000_000, type=int, help="largest prompt text accepted")
    add_flag(parser, "--max-stop-sequences", default=6, type=int, help="stop sequences a request may give")
    add_flag(parser, "--max-stop-sequence-chars", default=240, type=int, help="longest stop sequence")
    add_flag(parser, "--max-guide-chars", default=65536, type=int,
             help="longest JSON Schema, regex or grammar (a choice's strings together) a request may set")
    add_flag(parser, "--auth-tokens", default="",
             help="comma-separated bearer tokens clients must send (empty, and no file: no authentication)")
    add_flag(parser, "--auth-tokens-file", default="",
             help="file of bearer tokens, one 'TOKEN [NAME [SERVICE ...]]' a line; re-read when it changes")
    add_flag(parser, "--max-streams-per-client", default=0, type=int,
             help="concurrent requests one client (token, else host) may have (0 = unlimited)")
    add_flag(parser, "--rate-limit", default=0.0, type=float,
             help="requests per second one client may start on average (0 = unlimited)")
    add_flag(parser, "--rate-burst", default=10, type=int, help="requests one client may start at once")
    add_flag(parser, "--trace-content", default=False, type=bool,
             help="record prompt and completion text on the request span (off: they may be private)")
    return parser.parse_args(argv)


def build_guard(args: argparse.Namespace) -> ClientGuard:
    for flag in ("max_prompt_tokens", "max_streams_per_client", "rate_burst"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    tokens = TokenSet([t for t in args.auth_tokens.split(",") if t.strip()], args.auth_tokens_file)
    if not tokens.enabled:
        log.warning("no --auth-tokens or --auth-tokens-file: clients are not authenticated")
    return ClientGuard(tokens, args.max_streams_per_client, args.rate_limit, args.rate_burst)


def build_core(args: argparse.Namespace) -> tuple[GenerationCore, ModelFacts]:
    if args.max_migrations < 0:
        raise SystemExit(f"--max-migrations must be >= 0, got {args.max_migrations}")
    if args.link_retry_seconds <= 0:
        raise SystemExit(f"--link-retry-seconds must be positive, got {args.link_retry_seconds}")
    if args.verify_dtype and args.verify_dtype not in DTYPES:
        raise SystemExit(f"--verify-dtype must be one of {', '.join(DTYPES)} or empty, got {args.verify_dtype!r}")
    if not args.verify_workers:
        checked_redis_url(args.redis_url)
    config = AutoConfig.from_pretrained(resolve(args.model))
    if args.verify_workers:
        router, conversations = StaticRouter(args.verify_workers.split(","), args.draft_workers.split(",")), None
        log.info("static routing: verify %s, draft %s; Redis is not used", args.verify_workers, args.draft_workers)
    else:
        client = connect(args.redis_url)
        router = RedisRouter(Registry(client), args.model, args.redis_url, dtype=args.verify_dtype)
        conversations = Conversations(SessionStore(client, ttl=args.session_ttl_seconds), redacted(args.redis_url))
        log.info("discovering workers for %s in Redis at %s", args.model, redacted(args.redis_url))
    router.link_seconds = args.link_retry_seconds
    tokenizer = load_tokenizer(args.model)
    core = GenerationCore(tokenizer, args.model, context_length(config), router,
                          conversations, max_migrations=args.max_migrations, trace_content=args.trace_content)
    return core, ModelFacts.read(args.model, resolve(args.model), config, tokenizer)


async def main(args: argparse.Namespace) -> None:
    limits = Limits(max_new_tokens=args.max_new_tokens, default_max_new_tokens=args.default_max_new_tokens,
                    max_speculative_tokens=args.max_speculative_tokens,
                    default_speculative_tokens=args.default_speculative_tokens,
                    default_draft_method=args.default_draft_method, max_prompt_tokens=args.max_prompt_tokens,
                    max_prompt_chars=args.max_prompt_chars, max_stop_sequences=args.max_stop_sequences,
                    max_stop_sequence_chars=args.max_stop_sequence_chars, max_guide_chars=args.max_guide_chars)
    guard = build_guard(args)
    core, facts = build_core(args)
    service = service_from_args(list(SERVICES), args, entry=True, guard=guard)
    add_faces(service.server, core, limits, facts)
    export_load(core.router.kv_snapshot)
    port = service.listen(args.host, args.port)
    await service.serve(args.grace_seconds, on_ready=lambda: log.info(
        "gateway serving %s on %s:%d", args.model, args.host, port))
    await core.router.close()


if __name__ == "__main__":
    args = parse_args()
    setup_observability("gateway", args)
    asyncio.run(main(args))

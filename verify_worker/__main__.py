"""python -m verify_worker: serve a target model for verification and plain decoding."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import time

from tandem.cluster.registry import VERIFY, WorkerInfo, advertise_address, heartbeat_for
from tandem.engine.batcher import Batcher
from tandem.engine.kvpool import MAX_PROPOSAL, proposal_room
from tandem.engine.modeling import CausalLM, load_tokenizer
from tandem.engine.thread import InferenceThread
from tandem.service import metrics
from tandem.service.config import (
    add_common_flags,
    add_flag,
    add_guide_flags,
    add_kv_flags,
    add_model_flags,
    add_worker_flags,
    check_guide_flags,
    check_kv_flags,
    check_worker_flags,
)
from tandem.service.server import service_from_args, setup_observability
from tandem.speculation.grammar import Grammars
from tandem.v1 import internal_pb2, internal_pb2_grpc
from tandem.head.checkpoint import HeadFileError, load_drafter
from verify_worker.engine import VerifyEngine
from verify_worker.headspec import HEAD_TREE_LEAVES
from verify_worker.headspec import METHOD as HEAD
from verify_worker.headspec import HeadSpeculation
from verify_worker.kvstore import SessionKeeper
from verify_worker.service import VerifyServicer

log = logging.getLogger("verify_worker")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verify_worker", description=__doc__)
    add_common_flags(parser, default_port=50052, default_metrics_port=9091)
    add_model_flags(parser, default_model="qwen2.5-coder-1.5b-instruct", default_dtype="float32")
    add_flag(parser, "--max-proposal", default=MAX_PROPOSAL, type=int, help="largest k accepted per round")
    add_flag(parser, "--batch-invariant", default=True, type=bool,
             help="a token's logits do not depend on the other tokens of its pass (its proposal, other "
                  "sessions), so speculation's output is the plain decoding's at every --dtype; off, "
                  "sessions sharing a copied prompt prefix attend it once (faster under such load), and "
                  "output may differ at near-ties (CPU kernels; on a GPU neither holds yet)")
    add_kv_flags(parser, default_tokens=32768)
    add_flag(parser, "--max-batch-tokens", default=512, type=int,
             help="most tokens (all sessions' proposals and prefill chunks) in one batched forward pass")
    add_flag(parser, "--prefill-chunk", default=256, type=int,
             help="a prompt is prefilled in pieces of at most this many tokens, so that a long one "
                  "cannot stall the other sessions' rounds")
    add_flag(parser, "--admission-timeout", default=5.0, type=float,
             help="seconds a request waits for KV cache space before RESOURCE_EXHAUSTED")
    add_flag(parser, "--share-prefixes", default=True, type=bool,
             help="a new session copies the KV of the longest prompt prefix (16+ tokens) another live or "
                  "kept session holds, instead of computing it")
    add_flag(parser, "--head", default="",
             help="a trained head to draft with beside the target (draft method 'head'): a head file, a "
                  "DeepSpec checkpoint folder, or 'shipped' for the one shipped for --model; empty: none")
    add_flag(parser, "--head-sha256", default="",
             help="the sha256 (hex) the --head file (a DeepSpec folder's weights file) must have, or the worker "
                  "does not start; 'shipped' is always checked against the sha256 shipped with it")
    add_flag(parser, "--head-tree-leaves", default=HEAD_TREE_LEAVES, type=int,
             help="greedy rounds of draft method 'head': propose a token tree, the chain (the head's block or a "
                  "prompt lookup's), the other of the two as a branch where it leaves the chain, and up to this "
                  "many of the head's second choices as leaves, each node only where the estimate that the "
                  "target takes it pays for its position in the pass; 0: chains")
    add_guide_flags(parser)
    add_worker_flags(parser)
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    check_worker_flags(args)
    check_kv_flags(args)
    check_guide_flags(args)
    for flag in ("max_batch_tokens", "prefill_chunk"):
        if getattr(args, flag) <= 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.head_tree_leaves < 0:
        raise SystemExit(f"--head-tree-leaves must be 0 or more, got {args.head_tree_leaves}")
    if args.admission_timeout < 0:
        raise SystemExit(f"--admission-timeout must be >= 0, got {args.admission_timeout}")
    if args.head_sha256 and not (args.head and re.fullmatch(r"[0-9a-fA-F]{64}", args.head_sha256)):
        raise SystemExit(f"--head-sha256 must be 64 hex digits and needs --head, got {args.head_sha256!r}"
                         f"{'' if args.head else ' without --head'}")
    inference = InferenceThread("verify", metrics.queue_gauge("verify"))

    def load() -> CausalLM:
        model = CausalLM(args.model, device=args.device, threads=args.threads, dtype=args.dtype,
                         kv_tokens=args.kv_budget_tokens, kv_bytes=args.kv_memory_mb << 20,
                         packed_gemm=args.packed_gemm, batch_invariant=args.batch_invariant)
        if args.calibrate:
            model.calibrate(args.max_proposal + 1)
            model.calibrate_passes(args.max_batch_tokens)     # the speculation price's cost curve
        return model

    engine = VerifyEngine(await inference.run(load), max_proposal=args.max_proposal)
    model = engine.model
    if not model.invariant:
        log.warning("batch invariance is off (--no-batch-invariant, --no-packed-gemm, a GPU, or this CPU's kernels "
                    "failed the start-up probe): a token's logits "
                    "may depend on the other rows of its pass, so greedy output with speculation can differ "
                    "from plain decoding at near-ties")
    head = None
    if args.head:
        try:
            head = HeadSpeculation(load_drafter(args.head, model, args.model, args.head_sha256), engine,
                                   args.head_tree_leaves)
        except HeadFileError as e:
            raise SystemExit(f"--head: {e}") from None
        metrics.register("verify_worker_head")
        metrics.declare_methods([HEAD])
    grammars = Grammars(load_tokenizer(args.model), model.vocab_size, model.eos_ids, max_chars=args.max_guide_chars)
    service = service_from_args([internal_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name], args)
    batcher = Batcher(engine.model, inference, max_tokens=args.max_batch_tokens, taps=head.taps if head else ())
    batcher.observers.append(lambda sessions, tokens, prefill, seconds: (
        metrics.BATCH_SESSIONS.observe(sessions), metrics.BATCH_TOKENS.observe(tokens + prefill),
        metrics.BUSY_SECONDS.inc(seconds)))
    keeper = SessionKeeper(engine.model.pool.slots, admission_timeout=args.admission_timeout)
    servicer = VerifyServicer(engine, batcher, keeper, prefill_chunk=args.prefill_chunk,
                              share_prefixes=args.share_prefixes, grammars=grammars,
                              compile_timeout=args.guide_compile_timeout, drafting=[head] if head else [])
    internal_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, service.server)
    port = service.listen(args.host, args.port)
    address, started = advertise_address(args.host, port, args.advertise_address), time.time()
    numerics = model.numerics           # fixed once loaded: every heartbeat announces it

    def describe() -> WorkerInfo:
        return WorkerInfo(address=address, pool=VERIFY, model=args.model, capacity=keeper.budget,
                          load=len(servicer.sessions), kv_free=servicer.keeper.free(),
                          kv_margin=proposal_room(engine.max_proposal), started_at=started,
                          methods=[HEAD] if head else [], dtype=args.dtype, numerics=numerics)

    heartbeat = heartbeat_for(args, describe)
    await service.serve(args.grace_seconds, on_started=heartbeat.start, on_stopping=heartbeat.stop,
                        on_ready=lambda: log.info("verify worker serving %s on %s:%d (numerics: %s)",
                                                  args.model, args.host, port, numerics))
    inference.shutdown()


if __name__ == "__main__":
    args = parse_args()
    setup_observability("verify_worker", args)
    asyncio.run(main(args))

"""python -m draft_worker: propose tokens (a draft model or n-gram lookup) for verify workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from draft_worker.drafters import NgramDrafter
from draft_worker.model import ModelDrafter
from draft_worker.service import DraftServicer
from tandem.cluster.registry import DRAFT, WorkerInfo, advertise_address, heartbeat_for
from tandem.engine.batcher import Batcher
from tandem.engine.modeling import CausalLM, load_tokenizer, vocab_mismatch
from tandem.engine.thread import InferenceThread
from tandem.service import metrics
from tandem.service.config import (add_common_flags, add_flag, add_guide_flags, add_kv_flags, add_model_flags,
                                   add_worker_flags, check_guide_flags, check_kv_flags, check_worker_flags)
from tandem.service.server import service_from_args, setup_observability
from tandem.speculation.grammar import Grammars
from tandem.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("draft_worker")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="draft_worker", description=__doc__)
    add_common_flags(parser, default_port=50053, default_metrics_port=9092)
    add_model_flags(parser, default_model="qwen2.5-coder-0.5b-instruct", default_dtype="int8")
    add_flag(parser, "--target-model", default="",
             help="the target this draft serves; when set, a vocabulary mismatch refuses start-up")
    add_flag(parser, "--adaptive-k", default=True, type=bool,
             help="per round, speculate or decode plainly (k = 0), whichever gives more tokens per second; "
                  "greedy requests only")
    add_flag(parser, "--confidence", default=0.6, type=float,
             help="stop a proposal early after a token the draft gives less than this probability")
    add_flag(parser, "--draft-lookup", default=4, type=int,
             help="each draft model step of a chain also feeds up to N tokens that a prompt lookup says the draft "
                  "drafts next, and takes from that one pass as many of its own next tokens as agree: the same "
                  "proposal in fewer steps. 0: a token a step")
    add_flag(parser, "--draft-vocab", default=0, type=int,
             help="the draft model scores only its first N token ids (the most frequent in a BPE vocabulary), "
                  "its special tokens and the tokens it has been fed: a shorter draft step; a token outside "
                  "them is never proposed (verification stays lossless). 0: the whole vocabulary")
    add_flag(parser, "--ngram-max", default=3, type=int, help="longest n-gram prompt lookup matches")
    add_flag(parser, "--pipeline", default=False, type=bool,
             help="greedy requests without a guide: stream proposals, drafting on while the verify worker "
                  "checks what has arrived; pays off when draft and verify workers run on hardware of their own")
    add_flag(parser, "--prepare", default=True, type=bool,
             help="with --pipeline and a draft model: also draft, in the same batched steps, the continuation "
                  "after the draft's second choice where the target is likeliest to take it, sent the moment "
                  "a verdict does")
    add_flag(parser, "--tree-branches", default=0, type=int,
             help="rounds of greedy requests without a guide (not --pipeline): propose a token tree, with up to "
                  "this many branches off the draft model's line at its second choices (drafted in the same "
                  "batched steps) and its second choices as leaves, or prompt lookup's other continuations; "
                  "nodes priced by what a position costs the verify pass. 0: chains. Pays where a pass costs "
                  "about the same for any length (a GPU); about even with chains on a CPU (docs/benchmarks.md)")
    add_flag(parser, "--verify-route", default="",
             help="comma-separated ADDRESS=VIA pairs: dial VIA where a verify worker registered ADDRESS "
                  "(a proxy or tunnel on the link between the pools)")
    add_flag(parser, "--link-timeout", default=1.0, type=float,
             help="seconds to wait for a connection to a verify worker before giving a request back to the "
                  "gateway, which then decodes it on that worker without speculation")
    add_kv_flags(parser, default_tokens=16384)
    add_flag(parser, "--max-batch-tokens", default=512, type=int,
             help="most tokens (all sessions' draft steps) in one batched forward pass of the draft model")
    add_guide_flags(parser)
    add_flag(parser, "--jump-forward", default=True, type=bool,
             help="under a guide, propose the tokens it forces (keys, punctuation) ahead of the drafted ones")
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    if args.draft_vocab < 0:
        parser.error(f"--draft-vocab must be 0 (the whole vocabulary) or a number of token ids, got {args.draft_vocab}")
    return args


def parse_routes(text: str) -> dict[str, str]:
    """--verify-route's ADDRESS=VIA pairs."""
    routes = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        address, sep, via = pair.partition("=")
        if not sep or not address or not via:
            raise SystemExit(f"--verify-route: expected ADDRESS=VIA pairs separated by commas, got {pair!r}")
        routes[address] = via
    return routes


async def main(args: argparse.Namespace) -> None:
    check_worker_flags(args)
    if args.link_timeout <= 0:
        raise SystemExit(f"--link-timeout must be positive, got {args.link_timeout}")
    if args.tree_branches < 0:
        raise SystemExit(f"--tree-branches must be 0 or more, got {args.tree_branches}")
    check_kv_flags(args)
    check_guide_flags(args)
    grammars = None
    drafters = {"ngram": NgramDrafter(max_ngram=args.ngram_max)}
    eos_ids: list[int] = []
    vocab_size = None
    batcher = None
    inference = InferenceThread("draft", metrics.queue_gauge("draft"))
    if args.model and args.model != "none":
        if args.target_model:
            problem = vocab_mismatch(args.target_model, args.model)
            if problem:
                raise SystemExit(f"refusing to start: {problem}")

        def load() -> CausalLM:
            model = CausalLM(args.model, device=args.device, threads=args.threads, dtype=args.dtype,
                             kv_tokens=args.kv_budget_tokens, kv_bytes=args.kv_memory_mb << 20,
                             packed_gemm=args.packed_gemm, batch_invariant=False,   # drafts change only speed
                             vocab=args.draft_vocab)
            if args.calibrate:
                model.calibrate(4, last=1)  # a round feeds 1 or 2 tokens; prompts are long enough not to matter
            return model

        model = await inference.run(load)
        drafters["model"] = ModelDrafter(model, confidence=args.confidence, lookup_tokens=args.draft_lookup)
        eos_ids, vocab_size = model.eos_ids, model.vocab_size
        grammars = Grammars(load_tokenizer(args.model), vocab_size, eos_ids, max_chars=args.max_guide_chars)
        batcher = Batcher(model, inference, max_tokens=args.max_batch_tokens)
    service = service_from_args([internal_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name], args)
    servicer = DraftServicer(drafters, eos_ids, vocab_size, inference, adaptive_k=args.adaptive_k,
                             batcher=batcher, pipeline=args.pipeline, prepare=args.prepare, grammars=grammars,
                             tree_branches=args.tree_branches,
                             compile_timeout=args.guide_compile_timeout, jump_forward=args.jump_forward,
                             routes=parse_routes(args.verify_route), link_timeout=args.link_timeout)
    internal_pb2_grpc.add_DraftServiceServicer_to_server(servicer, service.server)
    port = service.listen(args.host, args.port)
    address, started = advertise_address(args.host, port, args.advertise_address), time.time()

    def describe() -> WorkerInfo:
        # Registered under the target it drafts for: the gateway never pairs it with another model.
        return WorkerInfo(address=address, pool=DRAFT, model=args.target_model, methods=sorted(drafters),
                          load=len(servicer.sessions), started_at=started, links_down=sorted(servicer.links.down_since))

    heartbeat = heartbeat_for(args, describe)
    probing = asyncio.create_task(servicer.links.probe(args.heartbeat_seconds))
    await service.serve(args.grace_seconds, on_started=heartbeat.start, on_stopping=heartbeat.stop,
                        on_ready=lambda: log.info("draft worker serving %s on %s:%d", sorted(drafters),
                                                  args.host, port))
    probing.cancel()
    await servicer.close()
    inference.shutdown()


if __name__ == "__main__":
    args = parse_args()
    setup_observability("draft_worker", args)
    asyncio.run(main(args))

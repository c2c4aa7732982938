"""python -m gateway: the public gRPC endpoint (tandem.v1 and TGIS fmaas)."""

from __future__ import annotations

import argparse
import asyncio
import logging

from transformers import AutoConfig

from gateway.core import GenerationCore, WorkerPool
from gateway.request import Limits
from gateway.service import GenerationServicer
from gateway.tgis import add_tgis_service
from tandem.config import add_common_flags, add_flag
from tandem.modeling import context_length, load_tokenizer, resolve
from tandem.server import Service, setup_logging
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger("gateway")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gateway", description=__doc__)
    add_common_flags(parser, default_port=50051)
    add_flag(parser, "--model", default="qwen2.5-coder-1.5b-instruct",
             help="the target model (its tokenizer and context length are used here)")
    add_flag(parser, "--draft-workers", default="127.0.0.1:50053", help="comma-separated host:port list")
    add_flag(parser, "--verify-workers", default="127.0.0.1:50052", help="comma-separated host:port list")
    add_flag(parser, "--default-draft-method", default="model", help="model, ngram or none")
    add_flag(parser, "--default-speculative-tokens", default=4, type=int, help="k when a request leaves it 0")
    add_flag(parser, "--max-speculative-tokens", default=16, type=int, help="largest k a request may ask for")
    add_flag(parser, "--default-max-new-tokens", default=128, type=int, help="when a request leaves it 0")
    add_flag(parser, "--max-new-tokens", default=2048, type=int, help="largest max_new_tokens accepted")
    return parser.parse_args(argv)


def build_core(args: argparse.Namespace) -> GenerationCore:
    config = AutoConfig.from_pretrained(resolve(args.model))
    return GenerationCore(load_tokenizer(args.model), args.model, context_length(config),
                          WorkerPool(args.draft_workers.split(",")), WorkerPool(args.verify_workers.split(",")))


async def main(args: argparse.Namespace) -> None:
    limits = Limits(max_new_tokens=args.max_new_tokens, default_max_new_tokens=args.default_max_new_tokens,
                    max_speculative_tokens=args.max_speculative_tokens,
                    default_speculative_tokens=args.default_speculative_tokens,
                    default_draft_method=args.default_draft_method)
    core = build_core(args)
    names = [generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
             "fmaas.GenerationService"]
    service = Service(names)
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(core, limits), service.server)
    add_tgis_service(service.server, core, limits)
    port = service.listen(args.host, args.port)
    await service.serve(args.grace_seconds, on_ready=lambda: log.info(
        "gateway serving %s on %s:%d", args.model, args.host, port))
    await core.drafts.close()
    await core.verifiers.close()


if __name__ == "__main__":
    args = parse_args()
    setup_logging(args.log_level)
    asyncio.run(main(args))

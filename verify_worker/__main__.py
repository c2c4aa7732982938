"""python -m verify_worker: serve a target model for verification and plain decoding."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from tandem.config import add_common_flags, add_flag, add_model_flags, add_worker_flags, check_worker_flags
from tandem.modeling import CausalLM
from tandem.registry import VERIFY, WorkerInfo, advertise_address, heartbeat_for
from tandem.server import InferenceThread, service_from_args, setup_observability
from tandem.v1 import internal_pb2, internal_pb2_grpc
from verify_worker.engine import VerifyEngine
from verify_worker.kvstore import SessionKeeper
from verify_worker.service import VerifyServicer

log = logging.getLogger("verify_worker")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verify_worker", description=__doc__)
    add_common_flags(parser, default_port=50052, default_metrics_port=9091)
    add_model_flags(parser, default_model="qwen2.5-coder-1.5b-instruct", default_dtype="float32")
    add_flag(parser, "--max-proposal", default=16, type=int, help="largest k accepted per round")
    add_flag(parser, "--kv-budget-tokens", default=32768, type=int,
             help="KV cache positions all sessions may hold together; finished sessions are evicted "
                  "least recently used first (0 = unbounded)")
    add_worker_flags(parser)
    return parser.parse_args(argv)


async def main(args: argparse.Namespace) -> None:
    check_worker_flags(args)
    if args.kv_budget_tokens < 0:
        raise SystemExit(f"--kv-budget-tokens must be >= 0 (0 = unbounded), got {args.kv_budget_tokens}")
    inference = InferenceThread("verify")

    def load() -> CausalLM:
        model = CausalLM(args.model, device=args.device, threads=args.threads, dtype=args.dtype)
        if args.calibrate:
            model.calibrate(args.max_proposal + 1)
        return model

    engine = VerifyEngine(await inference.run(load), max_proposal=args.max_proposal)
    service = service_from_args([internal_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name], args)
    servicer = VerifyServicer(engine, inference, SessionKeeper(args.kv_budget_tokens))
    internal_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, service.server)
    port = service.listen(args.host, args.port)
    address, started = advertise_address(args.host, port, args.advertise_address), time.time()

    def describe() -> WorkerInfo:
        return WorkerInfo(address=address, pool=VERIFY, model=args.model, capacity=args.kv_budget_tokens,
                          load=len(servicer.sessions), kv_free=servicer.keeper.free(), started_at=started)

    heartbeat = heartbeat_for(args, describe)
    await service.serve(args.grace_seconds, on_started=heartbeat.start, on_stopping=heartbeat.stop,
                        on_ready=lambda: log.info("verify worker serving %s on %s:%d", args.model, args.host, port))
    inference.shutdown()


if __name__ == "__main__":
    args = parse_args()
    setup_observability("verify_worker", args)
    asyncio.run(main(args))

"""The gateway's public faces, each a translation of its wire format to the one core: tandem.v1
(Tandem's own API), fmaas (TGIS) and vllm.grpc.engine (vLLM's engine protocol, for routers)."""

from __future__ import annotations

import grpc

from gateway.core import GenerationCore
from gateway.request import Limits
from gateway.service import GenerationServicer
from gateway.tgis import add_tgis_service
from gateway.vllm import SERVICE as VLLM_SERVICE
from gateway.vllm import ModelFacts, add_vllm_service
from tandem.v1 import generation_pb2, generation_pb2_grpc

SERVICES = (generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name,
            "fmaas.GenerationService", VLLM_SERVICE)


def add_faces(server: grpc.aio.Server, core: GenerationCore, limits: Limits, facts: ModelFacts) -> None:
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(core, limits), server)
    add_tgis_service(server, core, limits)
    add_vllm_service(server, core, limits, facts)

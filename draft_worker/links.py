"""The draft worker's links to verify workers: a channel each, dialed where --verify-route says, and
which links are down.

A link is down when no connection comes up within the link timeout, or a stream over it is lost.
The worker's registry entry lists the verify workers of its down links (WorkerInfo.links_down), so
that no gateway pairs the two (gateway/routing.py), until a probe gets an answer through the link."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from tandem.service import metrics
from tandem.service.server import channel as traced_channel
from tandem.v1 import internal_pb2 as pb
from tandem.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
FORGET_S = 600.0   # a link down this long is taken off the list: its verify worker is likely gone


class Links:
    def __init__(self, routes: dict[str, str] | None = None, timeout: float = 1.0) -> None:
        """routes: the address to dial for a verify worker's registered one, where they differ.
        timeout: how long a request waits for a connection to its verify worker."""
        self.routes = routes or {}
        self.timeout = timeout
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.down_since: dict[str, float] = {}     # verify worker -> when its link was found down

    async def stub(self, address: str) -> pb_grpc.VerifyServiceStub | None:
        """A stub for the verify worker registered at `address`; None (and the link down) when no
        connection to it is up within the timeout (a partition, a stalled link)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = traced_channel(self.routes.get(address, address))
        try:
            await asyncio.wait_for(channel.channel_ready(), self.timeout)
        except asyncio.TimeoutError:
            self.down(address)
            return None
        return pb_grpc.VerifyServiceStub(channel)

    def down(self, address: str) -> None:
        if address not in self.down_since:
            log.warning("the link to verify worker %s is down: listed in this worker's registry entry until "
                        "that worker answers through it", address)
            self.down_since[address] = time.monotonic()

    async def probe(self, every: float) -> None:
        """Every `every` seconds, asks each verify worker whose link is down for its status, through
        the link: an answer within the timeout takes the link off the list (a connection alone does
        not: a stalled link keeps its connection up until keepalive drops it). One down for FORGET_S
        is forgotten, and a gateway that still routes there learns of a partition per request again."""
        while True:
            await asyncio.sleep(every)
            for address, since in list(self.down_since.items()):
                if time.monotonic() - since > FORGET_S:
                    del self.down_since[address]
                    continue
                stub = await self.stub(address)
                try:
                    if stub is not None:
                        await stub.Status(pb.StatusRequest(), timeout=self.timeout)
                        del self.down_since[address]
                        metrics.LINK_EVENTS.labels("restored").inc()
                        log.info("the link to verify worker %s is up again", address)
                except grpc.aio.AioRpcError:
                    pass

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

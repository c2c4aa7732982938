"""The link proxy over real loopback sockets: an echo server behind it, a client in front. Timing
checks hold lower bounds strictly (the proxy must delay at least this much) and upper bounds loosely
(a loaded machine may add to any time, never take away)."""

import asyncio
import random
import socket
import socketserver
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.linkproxy import DOWN, UP, LinkProxy, ProxyThread, Schedule

pytestmark = pytest.mark.unit

# asyncio's timers run on time.monotonic; its callbacks may fire up to the clock's resolution early.
EARLY = 0.001


def test_schedule_serializes_at_the_rate_then_adds_the_delay():
    link = Schedule(delay_ms=10, rate_kbps=80)      # 1000 bytes take 0.1 s to send
    assert link.release(UP, 1000, now=0) == pytest.approx(0.11)
    assert link.release(UP, 1000, now=0) == pytest.approx(0.21)     # queued behind the first
    assert link.release(DOWN, 1000, now=0) == pytest.approx(0.11)   # the other direction is its own link
    assert link.release(UP, 1000, now=5) == pytest.approx(5.11)     # an idle link starts afresh
    assert link.release(UP, 0, now=6) == pytest.approx(6.01)        # EOF: no bytes, still delayed


def test_schedule_jitter_is_seeded_never_negative_and_keeps_order():
    def releases(seed):
        link, previous, out = Schedule(delay_ms=5, jitter_ms=10, seed=seed), 0.0, []
        for i in range(300):
            previous = link.release(UP, 100, now=i * 0.001, previous=previous)
            out.append(previous)
        return out
    out = releases(3)
    assert out == releases(3) and out != releases(4)
    assert out == sorted(out)
    assert all(release >= i * 0.001 for i, release in enumerate(out))
    held = sum(a == b for a, b in zip(out, out[1:]))   # would have overtaken the chunk before
    assert 0 < held < len(out)


def test_schedule_spike_ends_exactly_at_its_end():
    link = Schedule(delay_ms=1)
    link.spike(50, until=1.0)
    assert link.release(UP, 10, now=0.5) == pytest.approx(0.551)
    assert link.release(UP, 10, now=1.0) == pytest.approx(1.001)


@pytest.mark.parametrize("settings", [{"delay_ms": 7, "rate_kbps": -1}, {"jitter_ms": -0.5}, {"loss": 1}])
def test_schedule_refuses_bad_settings(settings):
    link = Schedule(delay_ms=3)
    with pytest.raises(ValueError):
        link.set(**settings)
    assert link.delay_ms == 3 and link.rate_kbps == 0


class Echo:
    """An echo server on loopback that records how each of its connections ended."""

    def __init__(self):
        self.ends: list[str] = []

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def handle(self, reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            self.ends.append("eof")
        except ConnectionResetError:
            self.ends.append("reset")
        finally:
            writer.close()


@pytest.fixture
async def echo():
    server = Echo()
    address = await server.start()
    yield server, address
    server.server.close()
    await server.server.wait_closed()


@pytest.fixture
async def link(echo):
    """Makes proxies in front of the echo server and stops them after the test."""
    proxies = []

    async def make(**settings) -> LinkProxy:
        proxies.append(await LinkProxy(echo[1], seed=0, **settings).start())
        return proxies[-1]
    yield make
    for proxy in proxies:
        await proxy.stop()


@pytest.fixture
async def connect():
    """Opens client connections to a proxy and closes them after the test (before its proxies stop)."""
    writers = []

    async def open_connection(proxy: LinkProxy):
        host, port = proxy.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writers.append(writer)
        return reader, writer
    yield open_connection
    for writer in writers:
        writer.close()


async def round_trip(reader, writer, payload: bytes = b"ping") -> float:
    """Seconds from writing payload to having all of it back."""
    start = time.monotonic()
    writer.write(payload)
    assert await reader.readexactly(len(payload)) == payload
    return time.monotonic() - start


async def test_bytes_arrive_intact_and_in_order_both_ways(link, connect):
    proxy = await link()
    payload = random.Random(1).randbytes(2_000_000)
    reader, writer = await connect(proxy)
    writer.write(payload)                           # buffered: the echo returns it while it still goes out
    assert await reader.readexactly(len(payload)) == payload
    assert proxy.counters.forwarded == {UP: len(payload), DOWN: len(payload)}
    assert proxy.counters.connections == 1


async def test_delay_applies_once_each_way(link, connect):
    plain, delayed = await link(), await link(delay_ms=20)
    fast = [await round_trip(*await connect(plain)) for _ in range(3)]
    slow = [await round_trip(*await connect(delayed)) for _ in range(3)]
    assert min(slow) >= 0.040 - EARLY
    assert min(fast) < 0.020


async def test_delay_does_not_serialize_chunks(link, connect):
    proxy = await link(delay_ms=50)
    reader, writer = await connect(proxy)
    start = time.monotonic()
    for _ in range(20):                             # 20 chunks in flight together, not one at a time
        writer.write(b"x")
        await asyncio.sleep(0.005)
    await reader.readexactly(20)
    assert 0.100 - EARLY <= time.monotonic() - start < 0.9


async def test_jitter_never_reorders(link, connect):
    proxy = await link(delay_ms=10, jitter_ms=10)
    reader, writer = await connect(proxy)
    messages = [b"%04d" % i for i in range(100)]
    for message in messages:                        # apart in time, so each is a chunk of its own
        writer.write(message)
        await asyncio.sleep(0.002)
    assert await reader.readexactly(400) == b"".join(messages)


async def test_rate_cap_serializes_bytes(link, connect):
    proxy = await link(rate_kbps=1024)
    reader, writer = await connect(proxy)
    took = await round_trip(reader, writer, bytes(64 * 1024))
    assert 64 * 1024 * 8 / 1_024_000 - EARLY <= took < 1.5


async def test_stall_holds_bytes_then_releases_them_in_order(link, connect):
    proxy = await link()
    reader, writer = await connect(proxy)
    assert await round_trip(reader, writer) < 1
    proxy.stall(True)
    late_reader, late_writer = await connect(proxy)   # accepted during the stall: stalled too
    writer.write(b"first")
    await asyncio.sleep(0.05)
    writer.write(b"second")
    late_writer.write(b"late")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.3)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(late_reader.read(1), 0.05)
    proxy.stall(False)
    assert await asyncio.wait_for(reader.readexactly(11), 1) == b"firstsecond"
    assert await asyncio.wait_for(late_reader.readexactly(4), 1) == b"late"


async def test_reset_reaches_both_peers_and_new_connections_work(link, connect, echo):
    proxy = await link()
    reader, writer = await connect(proxy)
    await round_trip(reader, writer)
    assert proxy.reset() == 1
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), 1)
    await asyncio.sleep(0.05)
    assert echo[0].ends == ["reset"]
    assert await round_trip(*await connect(proxy)) < 1
    assert proxy.counters.resets == 1 and proxy.counters.connections == 2


async def test_spike_adds_delay_then_goes_away(link, connect):
    proxy = await link()
    reader, writer = await connect(proxy)
    proxy.spike(100, 0.3)
    assert await round_trip(reader, writer) >= 0.200 - EARLY
    await asyncio.sleep(0.3)
    assert await round_trip(reader, writer) < 0.100


async def test_settings_change_live(link, connect):
    proxy = await link()
    reader, writer = await connect(proxy)
    proxy.set(delay_ms=30)
    assert await round_trip(reader, writer) >= 0.060 - EARLY


class SyncEcho(socketserver.StreamRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)


def test_proxy_thread_from_sync_code():
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), SyncEcho) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with ProxyThread("127.0.0.1:%d" % server.server_address[1], delay_ms=10) as proxy:
            host, port = proxy.address.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=2) as client:
                start = time.monotonic()
                client.sendall(b"ping")
                assert client.recv(4) == b"ping"
                assert time.monotonic() - start >= 0.020 - EARLY
                proxy.set(delay_ms=0)
                proxy.spike(0, 0)
                proxy.stall(True)
                client.sendall(b"held")
                client.settimeout(0.3)
                with pytest.raises(TimeoutError):
                    client.recv(4)
                proxy.stall(False)
                client.settimeout(2)
                assert client.recv(4) == b"held"
                assert proxy.reset() == 1
                with pytest.raises(ConnectionResetError):
                    client.recv(4)
            assert proxy.counters.forwarded == {UP: 8, DOWN: 8}
        server.shutdown()


async def test_grpc_calls_pass_and_reconnect_after_a_reset():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proxy = await LinkProxy(f"127.0.0.1:{port}", delay_ms=20).start()
    try:
        async with grpc.aio.insecure_channel(proxy.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest()
            assert (await stub.Check(check, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
            start = time.monotonic()
            await stub.Check(check, timeout=5)
            assert time.monotonic() - start >= 0.040 - EARLY
            assert proxy.reset() == 1
            # A call sent before the channel notices the RST fails UNAVAILABLE; the channel notices,
            # leaves READY and dials again for the next call.
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 2)
            reply = await stub.Check(check, timeout=5, wait_for_ready=True)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert proxy.counters.connections == 2
    finally:
        await proxy.stop()
        await server.stop(None)

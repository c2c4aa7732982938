"""A userspace TCP proxy that emulates the network link between the draft and the verify pools.

Each connection accepted on `listen` dials `target`, and each direction runs on a link of its own:

- Delay: a chunk read at t leaves at t + delay_ms + jitter (uniform in +-jitter_ms, seeded; the sum
  never below zero) + any active spike, and never before the previous chunk of its direction.
- Rate (rate_kbps > 0): n bytes occupy the link n * 8 / rate seconds after the previous chunk left
  it, before the delay; one link a direction, shared by all connections, as a real link is.
- Stall: a black hole both ways. What was read is held, as TCP keeps retransmitting it, and flows
  in order when the stall ends; a connection accepted meanwhile dials the target only then.
- Reset: every current connection is closed on both sides with a TCP RST (SO_LINGER 0). An error
  on either side of one connection (its peer resets it) resets both sides too.

`LinkProxy` runs on the caller's event loop, `ProxyThread` on a loop of its own for synchronous
code; `python -m tandem.linkproxy --target HOST:PORT ...` serves from the command line.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import signal
import socket
import struct
import threading
from dataclasses import dataclass, field

READ_BYTES = 16 * 1024
# Chunks waiting per direction before the reader stops reading: the rest waits in the kernel's
# buffers, so a slow (rate-capped or stalled) link pushes back on its sender as TCP does.
QUEUE_CHUNKS = 256
UP, DOWN = "up", "down"          # up: client -> target; down: target -> client
EOF = b""
SETTINGS = ("delay_ms", "jitter_ms", "rate_kbps")


def split_address(address: str) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6 host]:port"."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class Schedule:
    """When each chunk leaves the link, by the rules above, on a clock the caller passes in (the event
    loop's, or a test's): the settings, the seeded jitter, each direction's busy-until time, the spike."""

    def __init__(self, delay_ms: float = 0, jitter_ms: float = 0, rate_kbps: float = 0, seed: int | None = None):
        self.set(delay_ms=delay_ms, jitter_ms=jitter_ms, rate_kbps=rate_kbps)
        self._random = random.Random(seed)
        self._busy_until = {UP: 0.0, DOWN: 0.0}
        self._spike = (0.0, 0.0)                       # (extra ms, time it ends)

    def set(self, **settings: float) -> None:
        """Sets delay_ms, jitter_ms and/or rate_kbps (rate 0: unlimited), each >= 0, for later chunks."""
        for name, value in settings.items():
            if name not in SETTINGS or value < 0:
                raise ValueError(f"{name}={value}: settings are {', '.join(SETTINGS)}, each >= 0")
        for name, value in settings.items():
            setattr(self, name, float(value))

    def spike(self, ms: float, until: float) -> None:
        """Chunks read before `until` get `ms` more one-way delay (replaces any earlier spike)."""
        self._spike = (float(ms), until)

    def release(self, direction: str, n: int, now: float, previous: float = 0.0) -> float:
        """When a chunk of n bytes read at `now` leaves, given the previous chunk's release."""
        sent = now
        if self.rate_kbps > 0:
            sent = max(now, self._busy_until[direction]) + n * 8 / (self.rate_kbps * 1000)
            self._busy_until[direction] = sent
        delay_ms = self.delay_ms + (self._random.uniform(-self.jitter_ms, self.jitter_ms) if self.jitter_ms else 0)
        extra_ms, spike_end = self._spike
        if now < spike_end:
            delay_ms += extra_ms
        return max(sent + max(delay_ms, 0) / 1000, previous)


@dataclass
class Counters:
    """What the proxy has done since it started. Read from any thread."""
    forwarded: dict[str, int] = field(default_factory=lambda: {UP: 0, DOWN: 0})   # bytes, by direction
    connections: int = 0         # accepted
    resets: int = 0              # reset() calls


class LinkProxy:
    """The proxy on the running event loop. Faults (`stall`, `reset`, `spike`, `set`) are plain
    methods to call on that loop's thread; `ProxyThread` wraps them for other threads."""

    def __init__(self, target: str, listen: str = "127.0.0.1:0", delay_ms: float = 0, jitter_ms: float = 0,
                 rate_kbps: float = 0, seed: int | None = None):
        self.target = split_address(target)
        self.listen = split_address(listen)
        self.schedule = Schedule(delay_ms, jitter_ms, rate_kbps, seed)
        self.counters = Counters()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> LinkProxy:
        self._server = await asyncio.start_server(self._accept, *self.listen)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            links = list(self._links)
            for link in links:
                link.abort(rst=False)
            await asyncio.gather(*(link.task for link in links), return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    @property
    def address(self) -> str:
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def stall(self, on: bool) -> None:
        (self._flowing.clear if on else self._flowing.set)()

    def reset(self) -> int:
        """RST on both sides of every current connection; returns how many connections that was."""
        links = list(self._links)
        for link in links:
            link.abort(rst=True)
        self.counters.resets += 1
        return len(links)

    def spike(self, ms: float, seconds: float) -> None:
        """For the next `seconds`, every chunk read gets `ms` more one-way delay."""
        self.schedule.spike(ms, asyncio.get_running_loop().time() + seconds)

    def set(self, **settings: float) -> None:
        self.schedule.set(**settings)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback starting a task of our own: asyncio 3.11 logs an error when a coroutine
        # handler's task ends cancelled, and reset() cancels.
        self.counters.connections += 1
        link = _Link(self, reader, writer)
        self._links.add(link)
        link.task.add_done_callback(lambda _: self._links.discard(link))


class _Link:
    """One proxied connection: the client's side, the target's side once dialled, four tasks."""

    def __init__(self, proxy: LinkProxy, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter):
        self.proxy = proxy
        self.writers = [client]
        self.task = asyncio.create_task(self.run(client_reader))

    async def run(self, client_reader: asyncio.StreamReader) -> None:
        try:
            await self.proxy._flowing.wait()           # a stalled link black-holes the SYN too
            target_reader, target_writer = await asyncio.open_connection(*self.proxy.target)
            self.writers.append(target_writer)
            async with asyncio.TaskGroup() as tasks:
                for direction, reader, writer in ((UP, client_reader, target_writer),
                                                  (DOWN, target_reader, self.writers[0])):
                    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
                    tasks.create_task(self._read(direction, reader, queue))
                    tasks.create_task(self._write(direction, queue, writer))
        except* OSError:
            self.abort(rst=True)
        finally:
            for writer in self.writers:                # no-op where abort came first
                writer.close()

    async def _read(self, direction: str, reader: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        loop, release = asyncio.get_running_loop(), 0.0
        while True:
            data = await reader.read(READ_BYTES)
            release = self.proxy.schedule.release(direction, len(data), loop.time(), release)
            await queue.put((release, data))
            if data == EOF:
                return

    async def _write(self, direction: str, queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            release, data = await queue.get()
            if (wait := release - loop.time()) > 0:
                await asyncio.sleep(wait)
            await self.proxy._flowing.wait()
            if data == EOF:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
            self.proxy.counters.forwarded[direction] += len(data)

    def abort(self, rst: bool) -> None:
        """Closes both sides now, unsent bytes dropped; with rst, each peer gets a TCP RST."""
        if self.task is not asyncio.current_task():
            self.task.cancel()
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            if rst and sock is not None and sock.fileno() != -1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


class ProxyThread:
    """A LinkProxy on its own event loop in a daemon thread; every method is safe from any thread.
    `ProxyThread(target, delay_ms=20).start()` returns self; use `.address`, then `stop()`."""

    def __init__(self, target: str, **settings):
        self.proxy = LinkProxy(target, **settings)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="linkproxy", daemon=True)

    def start(self) -> ProxyThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def counters(self) -> Counters:
        return self.proxy.counters

    def _on_loop(self, method, *args, **kwargs):
        async def call():
            result = method(*args, **kwargs)
            await asyncio.sleep(0)                     # let the closes it scheduled run first
            return result
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    def stall(self, on: bool) -> None:
        self._on_loop(self.proxy.stall, on)

    def reset(self) -> int:
        return self._on_loop(self.proxy.reset)

    def spike(self, ms: float, seconds: float) -> None:
        self._on_loop(self.proxy.spike, ms, seconds)

    def set(self, **settings: float) -> None:
        self._on_loop(self.proxy.set, **settings)


async def serve(proxy: LinkProxy) -> None:
    """Serves until SIGINT or SIGTERM, after printing the listening address on one line."""
    await proxy.start()
    print(proxy.address, flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, done.set)
    await done.wait()
    await proxy.stop()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="tandem.linkproxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT to forward to")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (port 0: any free one)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform jitter around the delay")
    p.add_argument("--rate-kbps", type=float, default=0.0, help="bandwidth per direction (0: unlimited)")
    p.add_argument("--seed", type=int, default=None, help="seed for the jitter")
    a = p.parse_args(argv)
    try:
        proxy = LinkProxy(a.target, a.listen, a.delay_ms, a.jitter_ms, a.rate_kbps, seed=a.seed)
    except ValueError as e:
        p.error(str(e))
    asyncio.run(serve(proxy))


if __name__ == "__main__":
    main()

"""Several pylon processes on one UDP port (SO_REUSEPORT), as `pylon serve --processes N` runs
them: a packet of a connection this process does not know (its own process died, or the
client's address changed, so the kernel's hash picked another socket) gets a stateless reset,
which the client recognises at once by the node's shared key; ordinary connections stay put.

Each process is an `Http3Server` here, on the stack's one intake and engine, each on its own
socket of one reuseport group, exactly as the supervisor hands them out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aioquic.asyncio.client import connect

from pylon.server.http3 import Http3Server
from pylon.server.stateless_reset import ResetBudget, min_trigger_size
from tests.h3client import H3Client, chat, client_configuration
from tests.integration.test_metrics_scrape import scrape, value
from tests.stack import Stack, StackFactory

# `Resets` counts by patching `Http3Server.reset`, which the compiled class does not take.
pytestmark = pytest.mark.interpreted

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
IDLE_TIMEOUT = 20.0  # seconds: the hang a reset must beat by far


def reuseport_socket(port: int = 0) -> socket.socket:
    """One socket of a SO_REUSEPORT group on 127.0.0.1 (what the supervisor binds per process)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    return sock


class Resets:
    """Counts the stateless resets a server sends, and wakes a waiter at each."""

    def __init__(self, server: Http3Server) -> None:
        self.sent = 0
        self._event = asyncio.Event()
        send = server.reset

        def counted(*args: Any) -> None:
            send(*args)
            self.sent += 1
            self._event.set()

        server.reset = counted  # type: ignore[method-assign]

    async def wait_for(self, count: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while self.sent < count:
                self._event.clear()
                await self._event.wait()


@contextlib.asynccontextmanager
async def process(stack: Stack, key: bytes | None, port: int = 0) -> AsyncIterator[Http3Server]:
    """One pylon "process": an HTTP/3 server with reset key `key` on a reuseport socket."""
    options = dataclasses.replace(stack.server.options, reset_key=key, idle_timeout=IDLE_TIMEOUT)
    server = Http3Server(stack.server.ingress, stack.identity, options)
    await server.start("127.0.0.1", 0, sock=reuseport_socket(port))
    try:
        yield server
    finally:
        server.close()


def port_of(server: Http3Server) -> int:
    quic_server = server._quic_server
    assert quic_server is not None and quic_server.transport is not None
    return int(quic_server.transport.get_extra_info("sockname")[1])


@contextlib.asynccontextmanager
async def client_of(port: int) -> AsyncIterator[H3Client]:
    async with asyncio.timeout(10):
        async with connect(
            "127.0.0.1",
            port,
            configuration=client_configuration(idle_timeout=IDLE_TIMEOUT),
            create_protocol=H3Client,
            wait_connected=True,
        ) as client:
            assert isinstance(client, H3Client)
            yield client


async def test_a_connection_of_a_dead_process_is_reset_at_once(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with process(stack, KEY) as first:
        port = port_of(first)
        async with client_of(port) as client:
            assert (await client.request(body=chat())).status == 200
            await first.abandon()  # killed: no CONNECTION_CLOSE, its socket gone
            async with process(stack, KEY, port) as second:
                resets = Resets(second)
                started = time.monotonic()
                try:
                    reply = await client.request(body=chat(), timeout=IDLE_TIMEOUT / 4)
                except TimeoutError:
                    pytest.fail("no stateless reset: the client waits for its idle timeout")
                elapsed = time.monotonic() - started
                assert client.stateless_reset, f"the request ended otherwise: {reply}"
                assert reply.status is None and client.terminated is not None
                assert elapsed < IDLE_TIMEOUT / 10, f"{elapsed:.2f} s to see the reset"
                assert resets.sent >= 1
                # The restarted process serves new connections as usual.
                async with client_of(port) as fresh:
                    assert (await fresh.request(body=chat())).status == 200


async def test_a_reset_under_another_key_is_not_taken(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with process(stack, KEY) as first:
        port = port_of(first)
        async with client_of(port) as client:
            assert (await client.request(body=chat())).status == 200
            await first.abandon()
            async with process(stack, OTHER_KEY, port) as second:
                resets = Resets(second)
                reply = client.send(
                    [
                        (b":method", b"GET"),
                        (b":scheme", b"https"),
                        (b":authority", b"localhost"),
                        (b":path", b"/v1/models"),
                    ],
                    b"",
                )
                # The client retransmits; each copy is reset with a token it never saw. By the
                # second reset sent, the first has been read (loopback, in order).
                await resets.wait_for(2)
                assert not client.stateless_reset, "a reset with a foreign token was accepted"
                assert client.terminated is None and not reply.done.is_set()


async def test_two_processes_on_one_port_keep_every_connection(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    connections, requests = 16, 6
    async with process(stack, KEY) as first:
        port = port_of(first)
        async with process(stack, KEY, port) as second:
            counted = [Resets(first), Resets(second)]
            async with contextlib.AsyncExitStack() as clients:
                opened = await asyncio.gather(
                    *(clients.enter_async_context(client_of(port)) for _ in range(connections))
                )
                assert first.connections and second.connections, (
                    f"one process took every connection: {first.connections}, {second.connections}"
                )
                assert first.connections + second.connections == connections

                async def run(client: H3Client) -> list[int | None]:
                    return [(await client.request(body=chat())).status for _ in range(requests)]

                statuses = await asyncio.gather(*(run(client) for client in opened))
                assert statuses == [[200] * requests] * connections
                assert not any(client.terminated or client.stateless_reset for client in opened)
            assert [resets.sent for resets in counted] == [0, 0]


def forged(cid: bytes = b"\x11" * 8, size: int = 49) -> bytes:
    """A short-header packet of a connection nobody holds."""
    return bytes([0x41]) + cid + b"\x00" * (size - 1 - len(cid))


@contextlib.contextmanager
def udp_socket() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[bytes]:
    """What the socket holds now (loopback delivers during the sender's sendto)."""
    datagrams = []
    with contextlib.suppress(BlockingIOError):
        while True:
            datagrams.append(sock.recv(2048))
    return datagrams


@pytest.mark.parametrize("key", [KEY, None])
async def test_a_single_process_resets_what_it_does_not_know(
    make_stack: StackFactory, key: bytes | None
) -> None:
    """A forged short-header packet gets a reset (shorter than it) from a lone process too,
    with the random per-process key when none is given; a runt is never answered."""
    stack = await make_stack("dynamo")
    async with process(stack, key) as server:
        resets = Resets(server)
        address = ("127.0.0.1", port_of(server))
        loop = asyncio.get_running_loop()
        with udp_socket() as sock:
            runt = forged(size=min_trigger_size(8) - 1)
            await loop.sock_sendto(sock, runt, address)
            packet = forged()
            await loop.sock_sendto(sock, packet, address)
            async with asyncio.timeout(5):
                answer = await loop.sock_recv(sock, 2048)
            assert len(answer) < len(packet) and answer[0] & 0xC0 == 0x40
            assert answer[-16:] == server.reset_token(b"\x11" * 8)
            assert resets.sent == 1, "the runt was answered"
            assert received(sock) == []


async def test_a_flood_of_unknown_connections_gets_a_bounded_number_of_resets(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo")
    async with process(stack, KEY) as server:
        server._reset_budget = ResetBudget(rate=0.0, burst=5.0)  # no refill: exact counts
        resets = Resets(server)
        address = ("127.0.0.1", port_of(server))
        loop = asyncio.get_running_loop()
        with udp_socket() as sock:
            for n in range(50):
                await loop.sock_sendto(sock, forged(n.to_bytes(8, "big")), address)
            await resets.wait_for(50)  # every datagram considered
            assert len(received(sock)) == 5
        _, samples = await scrape(stack)
        events = "pylon_transport_events_total"
        assert value(samples, events, protocol="h3", event="quic_stateless_reset") == 5
        assert value(samples, events, protocol="h3", event="quic_stateless_reset_limited") == 45

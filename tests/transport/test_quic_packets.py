"""Raw QUIC packets at pylon's UDP port: address validation bounds what an unvalidated
(possibly spoofed) source can make pylon send, and Version Negotiation is never answered
(reliability cases F33, F34)."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
from aioquic.quic.connection import QuicConnection

from tests.h3client import client_configuration
from tests.stack import StackFactory


def client_initial(address: tuple[str, int]) -> bytes:
    """The first datagram a real client sends: a padded Initial with a ClientHello."""
    quic = QuicConnection(configuration=client_configuration())
    quic.connect(address, now=time.monotonic())
    datagrams = quic.datagrams_to_send(now=time.monotonic())
    return datagrams[0][0]


async def replies(address: tuple[str, int], datagram: bytes, wait: float = 0.5) -> list[bytes]:
    """Send one datagram from a fresh socket (a new, unvalidated source) and collect replies."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    sock.bind(("127.0.0.1", 0))
    received: list[bytes] = []
    try:
        await loop.sock_sendto(sock, datagram, address)
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            try:
                received.append(await asyncio.wait_for(loop.sock_recv(sock, 65536), left))
            except TimeoutError:
                break
    finally:
        sock.close()
    return received


@pytest.mark.parametrize("retry", [True, False])
async def test_unvalidated_source_gets_at_most_three_times_its_bytes(
    make_stack: StackFactory, retry: bool
) -> None:
    stack = await make_stack("dynamo", quic_retry=retry)
    address = (stack.host, stack.port)
    initial = client_initial(address)
    answer = await replies(address, initial)
    sent = sum(len(d) for d in answer)
    assert answer, "pylon should answer a well-formed Initial"
    assert sent <= 3 * len(initial), f"{sent} bytes out for {len(initial)} in"
    if retry:
        # A Retry packet (long header, type 3) and no handshake state: one small datagram.
        assert len(answer) == 1
        assert answer[0][0] & 0xF0 == 0xF0
        assert len(answer[0]) < 300


async def test_version_negotiation_packet_is_never_answered(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    dcid, scid = os.urandom(8), os.urandom(8)
    version_negotiation = (
        bytes([0x80 | 0x3F])
        + b"\x00\x00\x00\x00"
        + bytes([len(dcid)])
        + dcid
        + bytes([len(scid)])
        + scid
        + b"\x00\x00\x00\x01"
        + b"\x6b\x33\x43\xcf"
    )
    assert await replies((stack.host, stack.port), version_negotiation, wait=0.3) == []

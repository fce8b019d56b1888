"""What an unauthenticated QUIC client can make pylon do: nothing.

mTLS on QUIC is pylon's own check after the handshake (`Http3Protocol._check_client_certificate`);
these are the ways around it that tests/transport/test_http3_tls.py does not try: a request that
rides in the same datagram as the client's last handshake flight, the state a refused connection
leaves behind, and TLS resumption (a session ticket would allow replayable 0-RTT requests).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio.client import connect
from aioquic.quic.events import ProtocolNegotiated, QuicEvent
from aioquic.tls import SessionTicket
from cryptography.hazmat.primitives.serialization import Encoding

from pylon.server.http3 import Http3Protocol
from tests.certs import make_ca, make_leaf, write_pair
from tests.h3client import (
    CHAT,
    MODEL,
    H3Client,
    H3Response,
    chat,
    client_configuration,
    request_headers,
)
from tests.observers import SeenObserver
from tests.stack import Stack, StackFactory

CERTIFICATE_REQUIRED = 0x100 + 116  # QUIC CRYPTO_ERROR + TLS alert certificate_required
BODY = json.dumps(chat()).encode()


class EagerClient(H3Client):
    """Sends its request the moment ALPN is negotiated: before the client's Finished has left, so
    the request's 1-RTT packet shares a datagram with the client's Certificate, CertificateVerify
    and Finished, and reaches pylon in the same read as the end of the handshake."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eager: tuple[list[tuple[bytes, bytes]], bytes] | None = None
        self.eager_reply: H3Response | None = None

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and self.eager is not None:
            headers, body = self.eager
            self.eager = None
            self.eager_reply = self.send(headers, body)
        super().quic_event_received(event)


async def mtls_stack(
    make_stack: StackFactory, tmp_path: Path, **settings: Any
) -> tuple[Stack, tuple[Path, Path]]:
    """A stack requiring client certificates, and a certificate pair from another CA."""
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(Encoding.PEM))
    # mTLS needs a server certificate (without one the TCP listener would accept anyone).
    cert, key = write_pair(tmp_path, make_leaf(None), "server")
    stack = await make_stack(
        "dynamo", tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ca_file), **settings
    )
    rogue = write_pair(tmp_path, make_leaf(make_ca("rogue"), name="gateway"), "rogue")
    return stack, rogue


async def test_a_request_riding_with_a_refused_handshake_never_reaches_the_engine(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    observer = SeenObserver()
    stack, (cert, key) = await mtls_stack(make_stack, tmp_path, observer=observer)
    async with asyncio.timeout(10):
        async with connect(
            stack.host,
            stack.port,
            configuration=client_configuration(cert, key),
            create_protocol=EagerClient,
            wait_connected=False,
        ) as client:
            assert isinstance(client, EagerClient)
            extra = [("x-request-id", "eager-1"), ("x-model", MODEL)]
            client.eager = (request_headers(extra=extra, body=BODY), BODY)
            client.transmit()  # the Initial: without wait_connected, connect() sends nothing
            await client.wait_closed()
    assert client.eager_reply is not None, "the request was never sent"
    assert client.terminated is not None
    assert client.terminated.error_code == CERTIFICATE_REQUIRED
    # Once the connection is refused nothing of it is read: no admission, no answer, no engine.
    assert observer.seen == []
    assert await stack.records() == []


@pytest.mark.interpreted
async def test_a_refused_connection_is_forgotten_once_it_ends(
    make_stack: StackFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused client must not leave its connection behind: otherwise every failed handshake
    costs pylon memory for good (in the server's table and the lifecycle's drain listeners)."""
    stack, _ = await mtls_stack(make_stack, tmp_path)
    gone = asyncio.Event()
    forget = stack.server.forget

    def forget_and_note(protocol: Http3Protocol) -> None:
        forget(protocol)
        if stack.server.connections == 0:
            gone.set()

    monkeypatch.setattr(stack.server, "forget", forget_and_note)
    async with stack.connect(client_configuration()) as client:  # no certificate at all
        assert stack.server.connections == 1
        async with asyncio.timeout(5):
            await client.wait_closed()
        assert client.terminated is not None
        assert client.terminated.error_code == CERTIFICATE_REQUIRED
    # pylon's side ends after its closing period (three probe timeouts on loopback).
    async with asyncio.timeout(5):
        await gone.wait()
    assert stack.server.connections == 0


async def test_quic_issues_no_session_ticket(make_stack: StackFactory) -> None:
    """No resumption, hence no 0-RTT: early data could be replayed by anyone on the path."""
    stack = await make_stack("dynamo")
    tickets: list[SessionTicket] = []
    async with asyncio.timeout(10):
        async with connect(
            stack.host,
            stack.port,
            configuration=client_configuration(),
            create_protocol=H3Client,
            session_ticket_handler=tickets.append,
        ) as client:
            assert isinstance(client, H3Client)
            # A whole exchange: a ticket is sent right after the handshake, before any answer.
            reply = await client.request(CHAT, chat())
            assert reply.status == 200
    assert tickets == []

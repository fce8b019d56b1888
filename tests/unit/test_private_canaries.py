"""Canaries for every private library surface pylon touches: pylon/server/quic_private.py (aioquic)
and the h2 content-length hook in pylon/server/http2.py. Each check runs the real thing on
in-memory connections; a failure after an upgrade names the private attribute that changed."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

import pytest
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from _buffer
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, StreamDataReceived
from aioquic.quic.packet import pull_quic_header
from h2.config import H2Configuration
from h2.connection import H2Connection

from pylon.server import quic_private
from pylon.server.quic_private import (
    check_private_surface,
    closing,
    derive_reset_tokens,
    limit_peer_bidi_streams,
    peer_certificate,
    peer_reset_tokens,
    request_client_certificate,
    send_backlog,
    server_knows,
)
from pylon.server.stateless_reset import build_reset, is_reset
from tests.unit.quic_pair import (
    CLIENT_ADDR,
    SERVER_ADDR,
    QuicPair,
    certificate,
    client_configuration,
    server_configuration,
)


def streams_with_data(events: Sequence[object]) -> set[int]:
    return {e.stream_id for e in events if isinstance(e, StreamDataReceived)}


def test_the_private_surface_is_present() -> None:
    check_private_surface()


def test_a_missing_attribute_fails_the_import_check_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class SenderWithoutBuffer:
        def __init__(self, stream_id: int, writable: bool) -> None:
            self._reset_error_code = None

    monkeypatch.setattr(quic_private, "QuicStreamSender", SenderWithoutBuffer)
    with pytest.raises(ImportError, match=r"QuicStreamSender\._buffer is gone"):
        check_private_surface()


def test_send_backlog_counts_unacknowledged_bytes_until_the_peer_acks() -> None:
    pair = QuicPair().connect()
    client, server = pair.client.quic, pair.server.quic
    sid = client.get_next_available_stream_id()
    client.send_stream_data(sid, b"request", end_stream=True)
    pair.pump()
    assert send_backlog(server, sid) == 0, "QuicStreamSender._buffer not empty on a new stream"

    server.send_stream_data(sid, b"x" * 5000)
    assert send_backlog(server, sid) == 5000, "QuicStreamSender._buffer no longer holds unsent data"
    server.datagrams_to_send(now=pair.now)  # sent, but the ACKs are lost with these datagrams
    assert send_backlog(server, sid) == 5000, "QuicStreamSender._buffer drops sent, unacked data"
    server.send_stream_data(sid, b"y" * 3000)
    pair.pump()
    assert send_backlog(server, sid) == 0, "QuicStreamSender._buffer keeps acknowledged data"

    server.send_stream_data(sid, b"z" * 100)
    server.reset_stream(sid, 0x10C)
    assert send_backlog(server, sid) == 0, "QuicStreamSender._reset_error_code no longer set"
    assert send_backlog(server, 1234) == 0, "QuicConnection._streams has unknown streams"


def test_limit_peer_bidi_streams_caps_a_client() -> None:
    pair = QuicPair(server_setup=lambda quic: limit_peer_bidi_streams(quic, 3)).connect()
    client = pair.client.quic
    for _ in range(4):
        client.send_stream_data(client.get_next_available_stream_id(), b"hi", end_stream=True)
    pair.pump()
    assert streams_with_data(pair.server.take_events()) == {0, 4, 8}, (
        "QuicConnection._local_max_streams_bidi no longer sets initial_max_streams_bidi"
    )
    # Finishing a stream lets the peer open one more (aioquic raises the Limit's value).
    pair.server.quic.send_stream_data(0, b"", end_stream=True)
    pair.pump()
    assert streams_with_data(pair.server.take_events()) == {12}, (
        "QuicConnection._local_max_streams_bidi is not raised as streams close"
    )


def test_limit_peer_bidi_streams_caps_a_server_for_a_dialling_client() -> None:
    pair = QuicPair(client_setup=lambda quic: limit_peer_bidi_streams(quic, 2)).connect()
    server = pair.server.quic
    for _ in range(3):
        server.send_stream_data(server.get_next_available_stream_id(), b"hi", end_stream=True)
    pair.pump()
    assert streams_with_data(pair.client.take_events()) == {1, 5}, (
        "QuicConnection._local_max_streams_bidi does not apply to a client"
    )


def test_limit_peer_bidi_streams_is_refused_after_the_handshake_started() -> None:
    pair = QuicPair().connect()
    with pytest.raises(RuntimeError, match="before the handshake"):
        limit_peer_bidi_streams(pair.client.quic, 3)


def test_request_client_certificate_gets_the_client_certificate() -> None:
    pair = QuicPair(client_certificate=True, server_setup=request_client_certificate).connect()
    leaf, chain = peer_certificate(pair.server.quic)
    assert leaf == certificate("client.test")[0], (
        "QuicConnection._initialize / tls.Context._request_client_certificate no longer make "
        "the server ask for a certificate, or tls.Context._peer_certificate is not filled"
    )
    assert chain == [], "tls.Context._peer_certificate_chain changed shape"
    server_leaf, _ = peer_certificate(pair.client.quic)
    assert server_leaf == certificate("localhost")[0], "tls.Context._peer_certificate (client)"


def test_without_the_request_no_client_certificate_is_sent() -> None:
    pair = QuicPair(client_certificate=True).connect()
    assert peer_certificate(pair.server.quic) == (None, [])


def test_peer_certificate_before_the_handshake_is_empty() -> None:
    assert peer_certificate(QuicPair().client.quic) == (None, [])


def test_request_client_certificate_is_for_servers_only() -> None:
    with pytest.raises(ValueError, match="server"):
        request_client_certificate(QuicPair().client.quic)


def test_any_unacked_sees_every_stream_until_the_peer_acks() -> None:
    pair = QuicPair().connect()
    server = pair.server.quic
    sid = pair.client.quic.get_next_available_stream_id()
    pair.client.quic.send_stream_data(sid, b"request", end_stream=True)
    pair.pump()
    assert not quic_private.any_unacked(server)
    server.send_stream_data(sid, b"x" * 2000, end_stream=True)
    assert quic_private.any_unacked(server), "QuicConnection._streams no longer lists the stream"
    pair.pump()
    assert not quic_private.any_unacked(server)


# --- h2: the one private method pylon overrides (pylon/server/http2.py `_H2Connection`) ---


def _h2_pair() -> tuple[H2Connection, H2Connection]:
    from pylon.server.http2 import _H2Connection

    config = H2Configuration(client_side=False, header_encoding=None)
    server = _H2Connection(config)
    server.initiate_connection()
    client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    return client, server


REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"a")]


def test_h2_receive_frame_is_still_the_hook_for_content_length_errors() -> None:
    assert callable(getattr(H2Connection, "_receive_frame", None)), (
        "h2 H2Connection._receive_frame is gone: pylon/server/http2.py needs review"
    )
    from pylon.server.http2 import MalformedStream

    client, server = _h2_pair()
    # Declared 10, sent 3: h2 raises InvalidBodyLengthError, pylon's override makes it a
    # stream-level event and keeps the connection.
    client.send_headers(1, [*REQUEST, (b"content-length", b"10")])
    client.send_data(1, b"abc", end_stream=True)
    events = server.receive_data(client.data_to_send())
    assert [type(e) for e in events if isinstance(e, MalformedStream)] == [MalformedStream], (
        f"h2 no longer raises InvalidBodyLengthError through _receive_frame: {events}"
    )
    # Invalid syntax at HEADERS: h2 raises a plain ProtocolError naming content-length.
    client.send_headers(3, [*REQUEST, (b"content-length", b"x")], end_stream=True)
    events = server.receive_data(client.data_to_send())
    assert any(isinstance(e, MalformedStream) for e in events), (
        f"h2's content-length ProtocolError changed its type or text: {events}"
    )
    client.send_headers(5, REQUEST, end_stream=True)
    assert server.receive_data(client.data_to_send()), "the connection did not survive"


def test_closing_is_true_as_soon_as_the_peer_close_arrives() -> None:
    """aioquic reports the peer's CONNECTION_CLOSE (ConnectionTerminated) only after its draining
    period; `closing` must see it on receipt, and not before."""
    pair = QuicPair().connect()
    server = pair.server.quic
    pair.server.take_events()
    assert not closing(server), "QuicConnection._close_event set on an open connection"
    pair.client.quic.close(error_code=0, reason_phrase="bye")
    for datagram, _ in pair.client.quic.datagrams_to_send(now=pair.now):
        server.receive_datagram(datagram, CLIENT_ADDR, now=pair.now)
    assert closing(server), "QuicConnection._close_event not set when CONNECTION_CLOSE arrives"
    assert not [e for e in pair.server.take_events() if isinstance(e, ConnectionTerminated)], (
        "aioquic now reports ConnectionTerminated on receipt: closing() may be replaced by it"
    )


# --- stateless reset: tokens derived from the connection id, seen by the peer ---


class Derived:
    """A token function that records every connection id it was asked about."""

    def __init__(self) -> None:
        self.tokens: dict[bytes, bytes] = {}

    def __call__(self, cid: bytes) -> bytes:
        token = self.tokens[cid] = hashlib.sha256(b"key" + cid).digest()[:16]
        return token


def _client_dcid(pair: QuicPair) -> bytes:
    """The connection id the client sends to now (from a packet it sends)."""
    client = pair.client.quic
    client.send_ping(1)
    datagram, _ = client.datagrams_to_send(now=pair.now)[0]
    header = pull_quic_header(Buffer(data=datagram), host_cid_length=8)
    pair.server.quic.receive_datagram(datagram, CLIENT_ADDR, now=pair.now)
    pair.pump()
    return bytes(header.destination_cid)


def test_derived_reset_tokens_reach_the_peer_for_every_connection_id() -> None:
    derived = Derived()
    pair = QuicPair(server_setup=lambda quic: derive_reset_tokens(quic, derived)).connect()
    client = pair.client.quic
    tokens = peer_reset_tokens(client)
    assert len(tokens) >= 2, (
        "QuicConnection._peer_cid_available holds no NEW_CONNECTION_ID spares, or "
        "_replenish_connection_ids no longer issues them"
    )
    assert tokens <= set(derived.tokens.values()), (
        "QuicConnectionId.stateless_reset_token is not what aioquic sends (transport parameter "
        "or NEW_CONNECTION_ID): a token came from elsewhere"
    )
    assert derived.tokens[_client_dcid(pair)] in tokens, "the id in use has no derived token"
    # The client moves to a spare id and retires the old one: the server replenishes, derived.
    before = len(derived.tokens)
    client.change_connection_id()
    dcid = _client_dcid(pair)
    assert len(derived.tokens) > before, "QuicConnection._replenish_connection_ids not wrapped"
    assert peer_reset_tokens(client) <= set(derived.tokens.values())
    assert derived.tokens[dcid] in peer_reset_tokens(client)


def test_without_derivation_the_tokens_are_random() -> None:
    derived = Derived()
    pair = QuicPair().connect()
    tokens = peer_reset_tokens(pair.client.quic)
    assert tokens, "QuicConnection._peer_cid no longer carries the transport parameter's token"
    dcid = _client_dcid(pair)
    assert derived(dcid) not in tokens


def test_derive_reset_tokens_is_for_servers_before_their_first_packet() -> None:
    with pytest.raises(ValueError, match="server"):
        derive_reset_tokens(QuicPair().client.quic, Derived())
    pair = QuicPair().connect()
    with pytest.raises(RuntimeError, match="before the first packet"):
        derive_reset_tokens(pair.server.quic, Derived())


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendto(self, data: bytes, addr: object = None) -> None:
        self.sent.append(data)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def close(self) -> None:
        return None


async def test_server_knows_the_connection_ids_of_its_connections() -> None:
    server = QuicServer(configuration=server_configuration())
    server.connection_made(_Transport())  # type: ignore[arg-type]
    client = QuicConnection(configuration=client_configuration())
    client.connect(SERVER_ADDR, now=time.monotonic())
    initial, _ = client.datagrams_to_send(now=time.monotonic())[0]
    original = pull_quic_header(Buffer(data=initial), host_cid_length=8).destination_cid
    assert not server_knows(server, original)
    server.datagram_received(initial, CLIENT_ADDR)
    assert server_knows(server, original), "QuicServer._protocols no longer maps connection ids"
    assert not server_knows(server, b"\x00" * 8)
    server.close()


def test_an_aioquic_client_still_ignores_a_stateless_reset() -> None:
    """Why tests/h3client.py checks reset tokens itself: aioquic drops a reset as a packet of an
    unknown connection id. If this fails, aioquic learnt RFC 9000 10.3.1 and the client's own
    check can go."""
    derived = Derived()
    pair = QuicPair(server_setup=lambda quic: derive_reset_tokens(quic, derived)).connect()
    pair.client.take_events()
    dcid = _client_dcid(pair)
    reset = build_reset(derived.tokens[dcid], 60, lambda n: b"\x5a" * n)
    assert reset is not None and is_reset(reset, peer_reset_tokens(pair.client.quic))
    pair.client.quic.receive_datagram(reset, SERVER_ADDR, now=pair.now)
    pair.pump()
    assert not any(isinstance(e, ConnectionTerminated) for e in pair.client.take_events())

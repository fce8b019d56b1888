"""Canaries for pylon/server/quic_private.py: each function still does what pylon relies on, on
real in-memory QUIC connections. A failure here after an aioquic upgrade names the private
attribute that changed; fix quic_private.py, nothing else."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from aioquic.quic.events import StreamDataReceived

from pylon.server import quic_private
from pylon.server.quic_private import (
    check_private_surface,
    limit_peer_bidi_streams,
    peer_certificate,
    request_client_certificate,
    send_backlog,
)
from tests.unit.quic_pair import QuicPair, certificate


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

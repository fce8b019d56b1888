"""Every aioquic private attribute pylon touches, in one place.

aioquic (pinned to 1.7 in pyproject.toml) has no public API for these eight needs. Each function
names the private attribute it uses and why; `check_private_surface` runs at import and fails
loudly if an aioquic upgrade removed any of them, and tests/unit/test_private_canaries.py checks
that each still behaves as relied on. Nothing else in pylon may read aioquic private names.
"""

from __future__ import annotations

from collections.abc import Callable

from aioquic import tls
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.stream import QuicStreamSender
from cryptography import x509


def send_backlog(quic: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream that the peer has not acknowledged yet (sent or not): what "the
    peer is not keeping up" means for backpressure. 0 for an unknown, finished or reset stream.

    Touches `quic._streams` (the stream table) and the sender's `_buffer`, which holds every byte
    from the first unacknowledged offset to the last written one (`QuicStreamSender.write` appends,
    `on_data_delivery` trims the acknowledged prefix), and `_reset_error_code`: after a reset the
    buffer is never trimmed again, yet none of it will be sent. aioquic exposes no size.
    """
    stream = quic._streams.get(stream_id)
    if stream is None or stream.sender._reset_error_code is not None:
        return 0
    return len(stream.sender._buffer)


def any_unacked(quic: QuicConnection) -> bool:
    """True while any stream holds bytes the peer has not acknowledged (see `send_backlog`):
    a draining connection waits for this before CONNECTION_CLOSE, which ends retransmission.
    Touches the same `quic._streams` table."""
    return any(send_backlog(quic, stream_id) for stream_id in list(quic._streams))


def limit_peer_bidi_streams(quic: QuicConnection, count: int) -> None:
    """Let the peer open at most `count` bidirectional streams at a time (aioquic hard-codes 128).

    Touches `quic._local_max_streams_bidi`, the `Limit` whose `value` becomes the
    initial_max_streams_bidi transport parameter and which aioquic raises by one as each peer
    stream is discarded (RFC 9000 4.6). `sent` is set too, so no MAX_STREAMS frame repeats it.
    The transport parameters are serialised when the TLS context is created (the client's
    `connect()`, the server's first Initial packet), so call this before either; it works for
    either QUIC role.
    """
    if hasattr(quic, "tls"):
        raise RuntimeError("limit_peer_bidi_streams must be called before the handshake starts")
    limit = quic._local_max_streams_bidi
    limit.value = limit.sent = count


def request_client_certificate(quic: QuicConnection) -> None:
    """Make a QUIC server send a TLS CertificateRequest, so that clients present a certificate.

    aioquic's TLS server has only a private, "test purposes" flag for it:
    `tls.Context._request_client_certificate`. The context is created in the private
    `QuicConnection._initialize` (at the first Initial packet), so that method is wrapped to set
    the flag right after. Call before the first datagram. aioquic does not verify the client's
    chain; check `peer_certificate` on `HandshakeCompleted`.
    """
    if quic.configuration.is_client:
        raise ValueError("only a QUIC server requests client certificates")
    if hasattr(quic, "tls"):
        raise RuntimeError("request_client_certificate must be called before the first packet")
    initialize: Callable[[bytes], None] = quic._initialize

    def initialize_and_request(peer_cid: bytes) -> None:
        initialize(peer_cid)
        quic.tls._request_client_certificate = True

    quic._initialize = initialize_and_request  # type: ignore[method-assign]


def peer_certificate(
    quic: QuicConnection,
) -> tuple[x509.Certificate | None, list[x509.Certificate]]:
    """The peer's leaf certificate and the rest of the chain it sent ((None, []) before the
    handshake or when it sent none).

    Touches `tls.Context._peer_certificate` and `_peer_certificate_chain`, which aioquic fills when
    it parses the peer's Certificate message and never exposes publicly.
    """
    context = getattr(quic, "tls", None)
    if context is None:
        return None, []
    return context._peer_certificate, list(context._peer_certificate_chain)


def closing(quic: QuicConnection) -> bool:
    """True from the moment the connection started to close: the peer's CONNECTION_CLOSE
    received (aioquic's draining state), our own `close()`, or the idle timer.

    aioquic reports `ConnectionTerminated` only when its draining period ends (3 PTO, RFC 9000
    10.2.2; ~0.1 s on loopback), yet no stream can make progress from the moment the peer's
    CONNECTION_CLOSE arrives. Touches `QuicConnection._close_event`, which aioquic sets right then
    (`_handle_connection_close_frame`, `close`, the idle timeout) and reports at the end.
    """
    return quic._close_event is not None


def derive_reset_tokens(quic: QuicConnection, token_of: Callable[[bytes], bytes]) -> None:
    """Give every connection id this server connection issues the stateless reset token
    `token_of(cid)` instead of aioquic's `os.urandom(16)`, so that another process holding the
    same key can reset the connection (RFC 9000 10.3.2).

    Touches `QuicConnection._host_cids` (the ids issued, each a `QuicConnectionId` whose
    `stateless_reset_token` goes out in the transport parameters for the first and in
    NEW_CONNECTION_ID frames for the rest, read when each is sent) and wraps the private
    `_replenish_connection_ids`, which appends the new ids (at the handshake's end and when the
    peer retires one). The transport parameters are serialised at the first Initial packet, so
    call this before the first datagram.
    """
    if quic.configuration.is_client:
        raise ValueError("only a QUIC server derives its stateless reset tokens")
    if hasattr(quic, "tls"):
        raise RuntimeError("derive_reset_tokens must be called before the first packet")

    def derive() -> None:
        for connection_id in quic._host_cids:
            connection_id.stateless_reset_token = token_of(connection_id.cid)

    replenish: Callable[[], None] = quic._replenish_connection_ids

    def replenish_and_derive() -> None:
        replenish()
        derive()

    derive()
    quic._replenish_connection_ids = replenish_and_derive  # type: ignore[method-assign]


def peer_reset_tokens(quic: QuicConnection) -> set[bytes]:
    """The stateless reset tokens the peer announced for the connection ids this end may use:
    what identifies a stateless reset (RFC 9000 10.3.1). aioquic keeps them and never checks
    them (a reset goes unnoticed until the idle timeout), so a client that wants to see one
    compares a datagram's last 16 bytes with these.

    Touches `QuicConnection._peer_cid` (the id in use), `_peer_cid_available` (the spares from
    NEW_CONNECTION_ID) and each `_network_paths` entry's `peer_cid` (ids on probed paths).
    """
    ids = [quic._peer_cid, *quic._peer_cid_available]
    ids += [path.peer_cid for path in quic._network_paths if path.peer_cid is not None]
    return {cid.stateless_reset_token for cid in ids if cid.stateless_reset_token}


def server_knows(server: QuicServer, cid: bytes) -> bool:
    """Whether a connection of this `QuicServer` answers to connection id `cid`.

    Touches `QuicServer._protocols`, the table from every live connection id (the client's
    original destination id and each id issued) to its connection, which aioquic maintains on
    the connections' CID-issued, CID-retired and terminated callbacks and exposes no lookup of.
    """
    return cid in server._protocols


def check_private_surface() -> None:
    """Raise ImportError naming the first private aioquic attribute that is gone."""
    quic = QuicConnection(configuration=QuicConfiguration(is_client=True))
    sender = QuicStreamSender(stream_id=0, writable=True)
    context = tls.Context(is_client=False)
    limit = getattr(quic, "_local_max_streams_bidi", None)
    host_cids = getattr(quic, "_host_cids", None) or [None]
    probes = (
        ("QuicConnection._host_cids", isinstance(getattr(quic, "_host_cids", None), list)),
        (
            "QuicConnectionId.stateless_reset_token",
            hasattr(host_cids[0], "stateless_reset_token"),
        ),
        (
            "QuicConnection._replenish_connection_ids",
            callable(getattr(quic, "_replenish_connection_ids", None)),
        ),
        ("QuicConnection._peer_cid", hasattr(quic, "_peer_cid")),
        ("QuicConnection._peer_cid_available", hasattr(quic, "_peer_cid_available")),
        ("QuicConnection._network_paths", hasattr(quic, "_network_paths")),
        # A QuicServer needs a running loop to be built: look for the table by name in its
        # constructor's compiled code instead.
        ("QuicServer._protocols", "_protocols" in QuicServer.__init__.__code__.co_names),
        ("QuicConnection._streams", isinstance(getattr(quic, "_streams", None), dict)),
        ("QuicConnection._initialize", callable(getattr(quic, "_initialize", None))),
        ("QuicConnection._close_event", hasattr(quic, "_close_event")),
        ("QuicConnection._local_max_streams_bidi.value", hasattr(limit, "value")),
        ("QuicConnection._local_max_streams_bidi.sent", hasattr(limit, "sent")),
        ("QuicStreamSender._buffer", isinstance(getattr(sender, "_buffer", None), bytearray)),
        ("QuicStreamSender._reset_error_code", hasattr(sender, "_reset_error_code")),
        (
            "tls.Context._request_client_certificate",
            hasattr(context, "_request_client_certificate"),
        ),
        ("tls.Context._peer_certificate", hasattr(context, "_peer_certificate")),
        ("tls.Context._peer_certificate_chain", hasattr(context, "_peer_certificate_chain")),
    )
    for name, present in probes:
        if not present:
            raise ImportError(
                f"aioquic {name} is gone: pylon/server/quic_private.py needs review "
                "(pylon is tested with aioquic 1.7)"
            )


check_private_surface()

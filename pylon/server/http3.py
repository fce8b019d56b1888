"""HTTP/3 framing: aioquic's QUIC, pylon's own HTTP/3 request layer, in either QUIC role.

`Http3Server` listens (direct mode: pylon is the QUIC server); a reverse tunnel
(`pylon.gateway.tunnel`) dials the gateway and serves the same `Http3Protocol` on its client
connection (role-reversed HTTP/3: the gateway's server-initiated streams are the requests). The
protocol takes an `Http3Owner` (the intake and its table of connections); what only a QUIC server
does (derived stateless reset tokens, client certificates) comes from the server's keywords.

QUIC + TLS 1.3 come from aioquic (`QuicConnectionProtocol`, ALPN h3, no 0-RTT). Above it,
`pylon.server.h3layer.H3Layer` turns QUIC stream data into request events on aioquic's public
event API only. This module maps each request's header block to a `RequestHead` (the same
`pseudo_head` as HTTP/2), feeds the connection's `StreamTable` (shared intake, tasks, cancel,
stall watcher, rapid-reset guard), and sends responses corked, one transmit per loop iteration.

A malformed request is a stream error (RFC 9114 4.1.2): a 400 problem on that stream only. A
client RESET_STREAM or STOP_SENDING, or the connection going away (on receipt of the client's
CONNECTION_CLOSE, not at the end of aioquic's draining period), cancels that stream's task,
which closes its engine connection. The few aioquic internals pylon needs (send backlog, the
stream cap, the client-certificate request, the peer certificate, the close on receipt, the
reset tokens and the server's connection-id table) sit in `pylon.server.quic_private`, each
with a canary test.

Several processes may share the UDP port (`SO_REUSEPORT`, `start(..., sock=)`): a short-header
packet of a connection this process does not hold gets a stateless reset
(`pylon.server.stateless_reset`), its token derived from the connection id with the node's key
(`QuicOptions.reset_key`), so the client ends the connection at once instead of at its idle
timeout.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import NetworkAddress, QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
)
from mypy_extensions import mypyc_attr

from pylon.core.errors import ContractError, LimitError, PylonError
from pylon.core.errors import ErrorCode as PylonCode
from pylon.core.http import Header
from pylon.core.intake import AdmittedRequest
from pylon.proxy import ResponseSink
from pylon.server.h3layer import (
    DataReceived,
    H3ErrorCode,
    H3Event,
    H3Layer,
    HeadersReceived,
    MessageRejected,
    StreamAborted,
    StreamGone,
    TrailersReceived,
)
from pylon.server.quic_private import (
    any_unacked,
    closing,
    derive_reset_tokens,
    limit_peer_bidi_streams,
    peer_certificate,
    request_client_certificate,
    send_backlog,
    server_knows,
)
from pylon.server.quic_sink import SEND_LOW_WATER, QuicResponder
from pylon.server.stateless_reset import ResetBudget, build_reset, reset_token, short_header_cid
from pylon.server.streams import CLIENT_GONE, SHUTDOWN, Ingress, Stream, StreamTable
from pylon.tls import TlsIdentity

H3_ALPN = ("h3",)
DRAIN_ACK_GRACE = 2.0  # seconds a drained connection waits for its last ACKs before closing
ACK_COALESCE_DELAY = 0.001  # seconds an ACK may wait to share a send with a response
# QUIC CRYPTO_ERROR (0x100) + TLS alert certificate_required (116), RFC 9001 4.8.
_CERTIFICATE_REQUIRED = 0x100 + 116


@dataclass(frozen=True, slots=True)
class QuicOptions:
    """The QUIC listener's transport options (the limits on requests are `IngressLimits`)."""

    idle_timeout: float  # seconds without packets before a connection is closed
    max_data: int  # bytes: the connection's receive window
    max_stream_data: int  # bytes: each stream's receive window
    retry: bool  # validate client addresses with a QUIC Retry before any handshake
    # The key of every connection id's stateless reset token (pylon.server.stateless_reset):
    # the same in every process of a node, so any of them can reset a connection another one
    # holds. None: a random key of this process's own (one process per port).
    reset_key: bytes | None = None

    def __post_init__(self) -> None:
        if self.reset_key is not None and len(self.reset_key) < 16:
            raise ValueError("a stateless reset key is at least 16 bytes (128 bits)")


class Http3Owner(Protocol):
    """What an `Http3Protocol` needs of whoever made it: the `Http3Server` (QUIC server role)
    or a reverse tunnel (`pylon.gateway.tunnel`, QUIC client role)."""

    @property
    def ingress(self) -> Ingress: ...

    @property
    def max_header_block(self) -> int: ...

    def forget(self, protocol: Http3Protocol) -> None:
        """The connection ended: drop it from the owner's tables."""
        ...


@mypyc_attr(allow_interpreted_subclasses=True)  # the reverse tunnel's link is interpreted
class Http3Protocol(QuicConnectionProtocol):
    """One QUIC connection: HTTP/3 request streams to the shared stream table.

    Either QUIC role: the request streams are the peer's bidirectional streams (`H3Layer`).
    What only a QUIC server does comes from the server's keywords: `reset_token` (derived
    stateless reset tokens) and `identity` (client certificates when it has a client CA).
    `follow_lifecycle`: GOAWAY when the process drains (the listener's connections); a reverse
    tunnel drains its own. `serve_on_alpn`: start HTTP/3 when ALPN h3 is negotiated; a reverse
    tunnel calls `start_http` itself once its handshake stream is accepted.
    """

    def __init__(
        self,
        quic: QuicConnection,
        owner: Http3Owner,
        *,
        reset_token: Callable[[bytes], bytes] | None = None,
        identity: TlsIdentity | None = None,
        follow_lifecycle: bool = True,
        serve_on_alpn: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(quic, **kwargs)
        ingress = owner.ingress
        self._owner = owner
        self._lifecycle = ingress.lifecycle
        self._identity = identity
        self._follow_lifecycle = follow_lifecycle
        self._serve_on_alpn = serve_on_alpn
        self._limits = ingress.limits
        self._observer = ingress.proxy.observer
        self._table = StreamTable("h3", self, ingress, self._loop)
        self._http: H3Layer | None = None
        self._receiving: set[int] = set()  # request streams whose client is still sending
        self._responders: dict[int, H3Responder] = {}
        self._dirty: list[H3Responder] = []
        self._flush_handle: asyncio.Handle | None = None
        self._deferred_transmit: asyncio.TimerHandle | None = None
        self._handshake_done = False
        self._refused = False
        self._goaway_sent = False
        self._gone = False  # the connection is closing: its streams are cancelled
        self._abandoned = False  # `Http3Server.abandon`: nothing is sent any more
        self._drain_grace: asyncio.TimerHandle | None = None
        # The last accepted request stream id (for GOAWAY), one below the first the peer may
        # open: request streams are 0 mod 4 from a QUIC client, 1 mod 4 from a QUIC server.
        self._highest_stream = (1 if quic.configuration.is_client else 0) - 4
        limit_peer_bidi_streams(quic, self._limits.max_quic_streams)
        if reset_token is not None:  # server only (`derive_reset_tokens` refuses a client)
            derive_reset_tokens(quic, reset_token)
        if identity is not None and identity.client_ca is not None:
            request_client_certificate(quic)  # server only (refuses a client)

    # --- aioquic ---
    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic answers every datagram at once (mostly a bare ACK), and then the response,
        # a moment later, goes out in a second send. Once the handshake is done, wait up to
        # ACK_COALESCE_DELAY (far below the 25 ms max_ack_delay peers allow) so the ACK rides
        # with the response: half the sends, and aioquic walks every stream on each send.
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        if not self._gone and closing(self._quic):
            # The client's CONNECTION_CLOSE: cancel now, not when aioquic's draining period
            # ends (~0.1 s later), so the engine stops generating for nobody at once.
            self._streams_gone()
        if self._handshake_done and not self._refused:
            if self._deferred_transmit is None:
                self._deferred_transmit = self._loop.call_later(ACK_COALESCE_DELAY, self.transmit)
        else:
            self.transmit()
        if self._responders:
            self._wake_writers()
        if self._goaway_sent:
            self._maybe_close_drained()

    def transmit(self) -> None:
        if self._deferred_transmit is not None:
            self._deferred_transmit.cancel()
            self._deferred_transmit = None
        if not self._abandoned:  # aioquic re-arms its timer here: an abandoned one stops
            super().transmit()

    def abandon(self) -> None:
        """Go silent and gone: cancel every stream, never send again, leave the server's
        tables (see `Http3Server.abandon`)."""
        self._abandoned = True
        self._terminated()

    def quic_event_received(self, event: QuicEvent) -> None:
        if self._refused and not isinstance(event, ConnectionTerminated):
            return
        if isinstance(event, ProtocolNegotiated):
            if self._serve_on_alpn and event.alpn_protocol in H3_ALPN:
                self.start_http()
        elif isinstance(event, HandshakeCompleted):
            self._handshake_done = True
            self._check_client_certificate()
        elif isinstance(event, ConnectionTerminated):
            self._terminated()
            return
        if self._http is not None:
            for h3_event in self._http.handle_event(event):
                self._h3_event(h3_event)

    def start_http(self) -> None:
        """Start serving HTTP/3 on this connection (opens our control stream, once)."""
        if self._http is not None:
            return
        self._http = H3Layer(
            self._quic,
            max_field_section_size=self._limits.max_header_bytes + 32 * self._limits.max_headers,
            max_header_block=self._owner.max_header_block,
        )
        if self._follow_lifecycle:
            self._lifecycle.on_drain(self.drain)

    # --- HTTP/3 events ---
    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, DataReceived):
            if event.stream_ended:
                self._receiving.discard(event.stream_id)
            self._table.data(event.stream_id, event.data, event.stream_ended)
        elif isinstance(event, HeadersReceived):
            self._on_head(event)
        elif isinstance(event, TrailersReceived):
            self._receiving.discard(event.stream_id)
            self._table.trailers(event.stream_id, event.headers)
        elif isinstance(event, MessageRejected):
            self._on_rejected(event)
        elif isinstance(event, StreamAborted):
            self._on_aborted(event)

    def _on_head(self, event: HeadersReceived) -> None:
        sid = event.stream_id
        if self._goaway_sent:
            self._refuse_stream(sid)
            return
        self._highest_stream = max(self._highest_stream, sid)
        if not event.stream_ended:
            self._receiving.add(sid)
        self._table.header_block(sid, event.headers, event.stream_ended)

    def _on_rejected(self, event: MessageRejected) -> None:
        sid = event.stream_id
        # The layer already stopped reading this stream and drops the rest of its input.
        self._receiving.discard(sid)
        if self._table.get(sid) is None:
            if self._http is not None and self._http.head_delivered(sid):
                # Its head was answered already (e.g. refused at once) and the stream left the
                # table before the rest of the batch: one answer, one record per request.
                return
            if self._goaway_sent:
                self._refuse_stream(sid)
                return
            self._highest_stream = max(self._highest_stream, sid)
            self._table.open(sid)
        error: PylonError
        if event.status == 431:
            error = LimitError(event.reason, code=PylonCode.HEADERS_TOO_LARGE)
        else:
            error = ContractError(
                f"malformed request: {event.reason}", code=PylonCode.MALFORMED_REQUEST
            )
        self._observer.transport_event(
            "stream_malformed",
            "h3",
            stream_id=sid,
            request_id=self._table.request_id(sid),
            status=event.status,
            detail=event.reason,
        )
        self._table.malformed(sid, error)

    def _on_aborted(self, event: StreamAborted) -> None:
        sid = event.stream_id
        self._receiving.discard(sid)
        if self._table.peer_reset(sid):
            # Rapid reset (CVE-2023-44487 on QUIC): the abuser loses the connection.
            self._observer.transport_event(
                "h3_flood", "h3", kind="rapid_reset", streams=len(self._table)
            )
            self.close(H3ErrorCode.H3_EXCESSIVE_LOAD, "too many stream resets")
            self._terminated()
            return
        responder = self._responders.pop(sid, None)
        if responder is not None and not responder.closed:
            responder.closed = True
            self._reset(sid, H3ErrorCode.H3_REQUEST_CANCELLED)

    # --- Framing (used by the table) ---
    def response_sink(self, stream: Stream, request: AdmittedRequest) -> ResponseSink:
        responder = self._responders[stream.id] = H3Responder(self, stream.id, stream.is_head)
        return responder

    def reject_sink(self, stream: Stream) -> ResponseSink:
        sid = stream.id
        if sid in self._receiving and self._http is not None:
            # RFC 9114 4.1.1: answer without reading the rest; ask the client to stop sending.
            self._receiving.discard(sid)
            self._http.stop_receiving(sid, H3ErrorCode.H3_NO_ERROR)
        return H3Responder(self, sid, stream.is_head)

    def stream_done(self, stream: Stream, crashed: bool) -> None:
        responder = self._responders.pop(stream.id, None)
        if crashed and responder is not None and not responder.closed:
            responder.closed = True
            self._reset(stream.id, H3ErrorCode.H3_INTERNAL_ERROR)
        self._maybe_close_drained()

    # --- drain ---
    def drain(self) -> None:
        """Stop admitting streams, send GOAWAY, let admitted streams finish, then close."""
        if self._goaway_sent or self._http is None:
            return
        self._goaway_sent = True
        goaway_id = self._highest_stream + 4
        self._http.send_goaway(goaway_id)
        self._observer.transport_event(
            "h3_goaway_sent", "h3", stream_id=goaway_id, in_flight=len(self._table)
        )
        self.transmit()
        self._maybe_close_drained()

    @property
    def in_progress(self) -> int:
        """Requests on this connection that have started and are not answered yet."""
        return len(self._table)

    def close_now(self) -> None:
        """The grace period is over: stop what still runs (outcome `shutdown`) and close."""
        self._table.cancel_all(SHUTDOWN)
        if not self._closed.is_set():
            self.close(H3ErrorCode.H3_NO_ERROR, "shutting down")

    def _refuse_stream(self, sid: int) -> None:
        """Draining: the request was not processed, so the client may retry it elsewhere."""
        if self._http is not None:
            self._http.stop_receiving(sid, H3ErrorCode.H3_REQUEST_REJECTED)
            self._http.reset_stream(sid, H3ErrorCode.H3_REQUEST_REJECTED)
        self.transmit()

    def _maybe_close_drained(self) -> None:
        # Close only once every byte sent (responses, GOAWAY) is acknowledged: CONNECTION_CLOSE
        # ends retransmission, so closing earlier could lose the end of a response.
        if not self._goaway_sent or self._table.busy:
            return
        if not self._unacked_anything():
            self._loop.call_soon(self._close_drained)
        elif self._drain_grace is None:
            # Every admitted stream is done: bound the wait for the peer's last ACKs.
            self._drain_grace = self._loop.call_later(DRAIN_ACK_GRACE, self._close_drained)

    def _close_drained(self) -> None:
        if not self._closed.is_set():
            self.close(H3ErrorCode.H3_NO_ERROR, "drained")

    def _unacked_anything(self) -> bool:
        return any_unacked(self._quic)

    def _terminated(self) -> None:
        self._streams_gone()
        if self._drain_grace is not None:
            self._drain_grace.cancel()
        self._lifecycle.forget(self.drain)
        self._owner.forget(self)

    def _streams_gone(self) -> None:
        """The connection is closing: no stream on it can make progress, so stop their work
        (the connection itself is forgotten when aioquic reports its end)."""
        if self._gone:
            return
        self._gone = True
        self._table.cancel_all(CLIENT_GONE)
        for responder in self._responders.values():
            responder.closed = True
            responder.wake(ConnectionResetError("QUIC connection closed"))
        self._responders.clear()

    # --- client certificates (mTLS) ---
    def _check_client_certificate(self) -> None:
        identity = self._identity
        if identity is None or identity.client_ca is None:
            return
        certificate, chain = peer_certificate(self._quic)
        refusal = identity.verify_client(certificate, chain)
        if refusal is None:
            return
        self._refused = True
        self._observer.transport_event("quic_client_rejected", "h3", reason=refusal)
        self.close(_CERTIFICATE_REQUIRED, refusal)

    # --- used by H3Responder ---
    def schedule(self, responder: H3Responder) -> None:
        # Corked like the HTTP/1.1 framing: what a relay writes in one loop iteration goes out
        # as one DATA frame, and all streams share one transmit.
        self._dirty.append(responder)
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        dirty, self._dirty = self._dirty, []
        http = self._http
        if http is None:
            return
        for responder in dirty:
            responder.flush(http)
        self.transmit()

    def _reset(self, sid: int, code: int) -> None:
        if self._http is not None:
            self._http.reset_stream(sid, code)
        self._transmit_soon()

    def backlog(self, sid: int) -> int:
        """Bytes sent on the stream and not yet acknowledged: "the client is not keeping up"."""
        return send_backlog(self._quic, sid)

    def _wake_writers(self) -> None:
        for responder in list(self._responders.values()):
            if responder.waiter is not None and self.backlog(responder.sid) <= SEND_LOW_WATER:
                responder.wake(None)


class H3Responder(QuicResponder[list[Header]]):
    """`ResponseSink` for one HTTP/3 response stream: a HEADERS frame, DATA frames."""

    ABORT_CODE: ClassVar[int] = H3ErrorCode.H3_INTERNAL_ERROR

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        head: list[Header] = [(b":status", str(status).encode("ascii"))]
        head += headers  # normalised by the sender (`pylon.proxy.sink.ResponseSink.start`)
        if content_length is not None:
            head.append((b"content-length", str(content_length).encode("ascii")))
        self._head = head
        self._queue()

    def flush(self, http: H3Layer) -> None:
        if self.closed:
            self._queued = False
            return
        ended, head, parts = self._take()
        try:
            if head is not None:
                http.send_headers(self.sid, head, end_stream=ended and not parts)
            if parts:
                http.send_data(self.sid, b"".join(parts) if len(parts) > 1 else parts[0], ended)
            elif ended and head is None:
                http.send_data(self.sid, b"", True)
        except StreamGone:
            # The client reset the stream between the write and this flush.
            self.closed = True
            return
        if ended:
            self.closed = True
            http.forget(self.sid)


class _ResettingQuicServer(QuicServer):
    """aioquic's `QuicServer`, plus a stateless reset for a short-header packet of a connection
    this process does not know (aioquic drops it, and the client waits out its idle timeout)."""

    def __init__(self, owner: Http3Server, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._owner = owner
        self._cid_length = owner.configuration.connection_id_length
        self.transport: asyncio.DatagramTransport | None = None
        self.socket_closed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        datagram = cast(bytes, data)
        cid = short_header_cid(datagram, self._cid_length)
        if cid is not None and not server_knows(self, cid):
            self._owner.reset(datagram, cid, addr, self.transport)
            return
        super().datagram_received(datagram, addr)

    def connection_lost(self, exc: Exception | None) -> None:
        self.socket_closed.set()


class Http3Server:
    """The UDP listener: one `Http3Protocol` per QUIC connection."""

    def __init__(self, ingress: Ingress, identity: TlsIdentity, options: QuicOptions) -> None:
        self.ingress = ingress
        self.proxy = ingress.proxy
        self.limits = limits = ingress.limits
        self.lifecycle = ingress.lifecycle
        self.identity = identity
        self.options = options
        # The encoded block is at most the decoded size plus a few bytes per field.
        self.max_header_block = limits.max_header_bytes + 1024
        self._connections: set[Http3Protocol] = set()
        self._quic_server: _ResettingQuicServer | None = None
        self._reset_key = options.reset_key or os.urandom(32)
        self._reset_budget = ResetBudget()
        self._configuration = identity.quic_configuration(
            alpn_protocols=list(H3_ALPN),
            idle_timeout=options.idle_timeout,
            max_data=options.max_data,
            max_stream_data=options.max_stream_data,
        )
        # aioquic copies the pair into each connection at its first packet, so updating the
        # shared configuration switches new handshakes only.
        identity.on_change(lambda _: identity.install_quic(self._configuration))

    @property
    def configuration(self) -> QuicConfiguration:
        return self._configuration

    async def start(
        self, host: str, port: int, sock: socket.socket | None = None
    ) -> tuple[str, int]:
        """Listen on `host:port`, or on `sock`, a UDP socket bound already (the supervisor's,
        one of a `SO_REUSEPORT` group shared by the node's processes; host and port are then
        ignored). Returns the address bound."""
        loop = asyncio.get_running_loop()
        # No session_ticket_fetcher/handler: no resumption, hence no 0-RTT (replayable) requests.
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _ResettingQuicServer(
                self,
                configuration=self._configuration,
                create_protocol=self._create_protocol,
                retry=self.options.retry,
            ),
            **({"sock": sock} if sock is not None else {"local_addr": (host, port)}),
        )
        self._quic_server = protocol
        bound = transport.get_extra_info("sockname")
        return str(bound[0]), int(bound[1])

    def reset_token(self, cid: bytes) -> bytes:
        """The stateless reset token of connection id `cid` (the node's key)."""
        return reset_token(self._reset_key, cid)

    def reset(
        self,
        datagram: bytes,
        cid: bytes,
        addr: NetworkAddress,
        transport: asyncio.DatagramTransport | None,
    ) -> None:
        """Answer a packet of an unknown connection with a stateless reset, within the budget:
        counted (`quic_stateless_reset`, or `quic_stateless_reset_limited` for one dropped
        under a flood), its log line rate-limited like every connection-level event."""
        if transport is None:
            return
        if not self._reset_budget.take(asyncio.get_running_loop().time()):
            self.proxy.observer.transport_event("quic_stateless_reset_limited", "h3")
            return
        packet = build_reset(self.reset_token(cid), len(datagram), os.urandom)
        if packet is None:
            return
        transport.sendto(packet, addr)
        self.proxy.observer.transport_event("quic_stateless_reset", "h3", size=len(datagram))

    def _create_protocol(self, quic: QuicConnection, **kwargs: Any) -> Http3Protocol:
        protocol = Http3Protocol(
            quic, self, reset_token=self.reset_token, identity=self.identity, **kwargs
        )
        self._connections.add(protocol)
        return protocol

    def forget(self, protocol: Http3Protocol) -> None:
        self._connections.discard(protocol)

    def close_connections(self) -> None:
        """End every connection now (after the drain's grace period)."""
        for protocol in list(self._connections):
            protocol.close_now()

    @property
    def connections(self) -> int:
        return len(self._connections)

    @property
    def in_progress(self) -> int:
        """Requests started on every connection and not answered yet."""
        return sum(protocol.in_progress for protocol in list(self._connections))

    def close(self) -> None:
        if self._quic_server is not None:
            self._quic_server.close()
            self._quic_server = None

    async def abandon(self) -> None:
        """Drop every connection and close the UDP socket, telling no client (no
        CONNECTION_CLOSE): what a process killed with SIGKILL looks like from the network, for
        tests of what its clients see. Returns once the socket is closed."""
        server = self._quic_server
        if server is None or server.transport is None:
            return
        for protocol in list(self._connections):
            protocol.abandon()
        server.transport.close()
        async with asyncio.timeout(5):  # closed on the loop's next turn
            await server.socket_closed.wait()

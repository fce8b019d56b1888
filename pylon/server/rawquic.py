"""The reverse tunnel's raw-QUIC request streams: Stargate's framing, sans-I/O, and the connection
that serves it through pylon's shared stream table.

On a raw-QUIC reverse tunnel pylon is the QUIC *client* and the gateway opens one bidirectional
stream per request (server-initiated, id = 1 mod 4; pylon's own streams, the handshake's
included, are left to aioquic's stream readers). Each direction carries Cap'n Proto
standard-framed `Message`s (`pylon.gateway.wire`): a headers map first (a request's with the
pseudo entries `x-method` and `x-path`, a response's with `x-status`), then body chunks, then at
most one trailers map; the stream's FIN ends the message. See docs/gateway-raw-quic.md.

`RawQuicLayer` turns QUIC events into request events and queues response messages on the
`QuicConnection`, like `pylon.server.h3layer.H3Layer` for HTTP/3. Memory per stream is bounded by
the message caps (a message announced over its cap is refused before any of it is buffered), and
the cost is proportional to the bytes received, however the peer splits them.

`RawQuicTunnelProtocol` is an aioquic `QuicConnectionProtocol` (the `create_protocol` of
`aioquic.asyncio.client.connect`) that serves those streams with a `StreamTable`: intake,
contract, strip, limits, cancellation and the rapid-reset guard are the ones HTTP/1.1, HTTP/2 and
HTTP/3 use. A request's head maps to a `RequestHead` through `pseudo_head`, the HTTP/2 and HTTP/3
normaliser: `x-method` becomes `:method`, `x-path` `:path`.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from aioquic.asyncio.protocol import QuicConnectionProtocol, QuicStreamHandler
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StopSendingReceived,
    StreamDataReceived,
    StreamReset,
)

from pylon.core.errors import ContractError, LimitError, PylonError
from pylon.core.errors import ErrorCode as PylonCode
from pylon.core.head import malformed
from pylon.core.http import Header
from pylon.core.intake import AdmittedRequest
from pylon.gateway.wire import RawBody, RawHeaders, WireError, decode_raw, encode_raw, framed_size
from pylon.proxy import ResponseSink
from pylon.server.quic_private import any_unacked, closing, limit_peer_bidi_streams, send_backlog
from pylon.server.quic_sink import SEND_LOW_WATER, QuicResponder, StreamGone
from pylon.server.streams import CLIENT_GONE, SHUTDOWN, Ingress, Stream, StreamTable

PROTOCOL = "raw-quic"  # the `protocol` of pylon's transport events and exchanges

# Stargate's map limit, on both sides (more entries is a protocol violation there too).
MAX_MAP_ENTRIES = 4096
# What a Cap'n Proto map message costs beyond its text: the segment table, the root struct, the
# map struct and the list tag (a few words), and per entry its two pointers (16 bytes) plus each
# text's NUL and padding to a word (at most 8 each).
MAP_MESSAGE_OVERHEAD = 64
MAP_ENTRY_OVERHEAD = 32
# A body message: the segment table (8), four words (root pointer, union tag, Body pointer, the
# Data pointer) and the content padded to a word.
BODY_MESSAGE_OVERHEAD = 8 + 32 + 7
DEFAULT_MAX_BODY_CHUNK = 1024 * 1024

# RESET_STREAM / STOP_SENDING codes, Stargate's `StreamStopCode`.
STOP_OK = 0
STOP_CANCELLED = 1
STOP_UNKNOWN = 2
STOP_GOAWAY = 3

ACK_COALESCE_DELAY = 0.001  # seconds an ACK may wait to share a send with a response


# --- events ---


class RawEvent:
    """Base class of the events `RawQuicLayer.handle_event` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class HeadReceived(RawEvent):
    """A request's headers map: names lower-cased, values as sent, in order (`x-method` and
    `x-path` included, not validated)."""

    stream_id: int
    fields: list[tuple[bytes, bytes]]
    stream_ended: bool


@dataclass(frozen=True, slots=True)
class DataReceived(RawEvent):
    """Body content as it arrives; `DataReceived(sid, b"", True)` is a bare end of stream."""

    stream_id: int
    data: bytes
    stream_ended: bool


@dataclass(frozen=True, slots=True)
class TrailersReceived(RawEvent):
    """The trailers map, once the stream has ended after it (so it also ends the request)."""

    stream_id: int
    fields: list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class MessageRejected(RawEvent):
    """The request is malformed (400), its headers too large (431) or a body message over the
    cap (413). The layer has asked the peer to stop sending and drops the rest of the stream's
    input; the application answers `status` on the stream."""

    stream_id: int
    status: int
    reason: str


@dataclass(frozen=True, slots=True)
class StreamAborted(RawEvent):
    """The peer aborted a request stream: `by_reset` for RESET_STREAM (the request will not be
    completed), else STOP_SENDING (no response can be delivered any more)."""

    stream_id: int
    error_code: int
    by_reset: bool


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


# --- the sans-I/O layer ---

_AWAIT_HEAD = 0
_BODY = 1
_AFTER_TRAILERS = 2  # trailers read, waiting for the FIN
_ENDED = 3  # the whole request was handed on
_DROPPING = 4  # rejected, aborted or forgotten: the rest of the input is discarded unparsed

_ANY_SIZE = sys.maxsize
_MAX_TABLE = 4 + 4 * 64 + 4  # the largest segment table `framed_size` reads


class _RequestStream:
    __slots__ = ("buffer", "forgotten", "need", "phase", "receiving_ended", "released", "trailers")

    def __init__(self) -> None:
        self.phase = _AWAIT_HEAD
        self.buffer = bytearray()  # the start of a message not yet complete
        self.need = -1  # that message's whole size once its segment table is read
        self.trailers: list[tuple[bytes, bytes]] | None = None
        self.receiving_ended = False
        self.forgotten = False
        self.released = False  # the application stopped reading it (stop, reset or forget)

    def drop(self) -> None:
        self.phase = _DROPPING
        self.buffer = bytearray()
        self.need = -1
        self.trailers = None


class RawQuicLayer:
    """Raw-QUIC request streams on one `QuicConnection` (see the module docstring).

    :param max_header_message: the largest headers or trailers message read (framed bytes); a
        larger one is refused unread with `MessageRejected(status=431)`.
    :param max_body_message: the largest body message read; a larger one is refused with
        `MessageRejected(status=413)`. (After the head a message may be a body chunk or the
        trailers, told apart only once read: one announced over both caps is refused unread, one
        within the other cap is read, then refused.)
    :param max_entries: the most entries a map may carry (Stargate's 4096).
    """

    def __init__(
        self,
        quic: QuicConnection,
        *,
        max_header_message: int,
        max_body_message: int,
        max_entries: int = MAX_MAP_ENTRIES,
    ) -> None:
        self._quic = quic
        self._max_header = max_header_message
        self._max_body = max_body_message
        self._max_entries = max_entries
        # Request streams are bidirectional (bit 0x2 clear) and opened by the peer (bit 0x1: 0 for
        # a QUIC client's streams, RFC 9000 2.1); on a reverse tunnel that is the gateway.
        self._request_bits = 1 if quic.configuration.is_client else 0
        self._requests: dict[int, _RequestStream] = {}

    def is_request_stream(self, stream_id: int) -> bool:
        return stream_id & 0x3 == self._request_bits

    # --- input ---

    def handle_event(self, event: QuicEvent) -> list[RawEvent]:
        """Turn one QUIC event into request events (none for streams that are not requests)."""
        if isinstance(event, StreamDataReceived | StreamReset | StopSendingReceived):
            stream_id = event.stream_id
            if not self.is_request_stream(stream_id):
                return []
            if isinstance(event, StreamDataReceived):
                return self._receive(stream_id, event.data, event.end_stream)
            return self._aborted(stream_id, event.error_code, isinstance(event, StreamReset))
        return []

    def _receive(self, stream_id: int, data: bytes, fin: bool) -> list[RawEvent]:
        stream = self._requests.get(stream_id)
        if stream is None:
            stream = self._requests[stream_id] = _RequestStream()
        events: list[RawEvent] = []
        if stream.phase != _DROPPING:
            body: list[bytes] = []
            try:
                self._parse(stream_id, stream, data, fin, events, body)
                if fin:
                    self._ended(stream_id, stream, events, body)
                elif body:
                    events.append(DataReceived(stream_id, _join(body), False))
            except _Refused as error:
                if body:
                    events.append(DataReceived(stream_id, _join(body), False))
                self._reject(stream_id, stream, error, fin, events)
                return events
        if fin:
            stream.receiving_ended = True
            if stream.forgotten:
                del self._requests[stream_id]
        return events

    def _parse(
        self,
        stream_id: int,
        stream: _RequestStream,
        data: bytes,
        fin: bool,
        events: list[RawEvent],
        body: list[bytes],
    ) -> None:
        buffer = stream.buffer
        buffer += data
        pos = 0
        end = len(buffer)
        while pos < end:
            if stream.need < 0:
                head = buffer if pos == 0 else buffer[pos : pos + _MAX_TABLE]
                try:
                    size = framed_size(head, _ANY_SIZE)
                except WireError as exc:
                    raise _Refused(400, str(exc)) from None
                if size is None:
                    break
                self._check_size(stream.phase, size)
                stream.need = size
            if end - pos < stream.need:
                break
            message = bytes(buffer[pos : pos + stream.need])
            pos += stream.need
            stream.need = -1
            self._message(stream_id, stream, message, fin and pos == end, events, body)
        if pos:
            del buffer[:pos]

    def _check_size(self, phase: int, size: int) -> None:
        if phase in (_AWAIT_HEAD, _AFTER_TRAILERS):
            if size > self._max_header:
                raise _Refused(431, f"a headers message of {size} bytes exceeds the limit")
        elif size > max(self._max_body, self._max_header):
            # A body message, or trailers: each within its own cap (checked again once decoded).
            raise _Refused(413, f"a message of {size} bytes exceeds the raw-QUIC cap")

    def _message(
        self,
        stream_id: int,
        stream: _RequestStream,
        data: bytes,
        at_end: bool,
        events: list[RawEvent],
        body: list[bytes],
    ) -> None:
        try:
            message = decode_raw(data)
        except WireError as exc:
            raise _Refused(400, str(exc)) from None
        phase = stream.phase
        if isinstance(message, RawBody):
            if phase != _BODY:
                raise _Refused(400, "a body message before the headers or after the trailers")
            if len(data) > self._max_body:
                raise _Refused(413, f"a body message of {len(data)} bytes exceeds the cap")
            if message.content:
                body.append(message.content)
            return
        if len(data) > self._max_header:
            raise _Refused(431, f"a trailers message of {len(data)} bytes exceeds the limit")
        fields = self._fields(message)
        if phase == _AWAIT_HEAD:
            if message.trailers:
                raise _Refused(400, "a trailers message before the headers")
            stream.phase = _ENDED if at_end else _BODY
            events.append(HeadReceived(stream_id, fields, at_end))
        elif phase == _BODY and message.trailers:
            if body:
                events.append(DataReceived(stream_id, _join(body), False))
                body.clear()
            stream.phase = _AFTER_TRAILERS
            stream.trailers = fields
        else:
            raise _Refused(400, "a second headers message, or a message after the trailers")

    def _fields(self, message: RawHeaders) -> list[tuple[bytes, bytes]]:
        if len(message.fields) > self._max_entries:
            raise _Refused(431, f"more than {self._max_entries} map entries")
        try:
            return [
                (name.encode("utf-8").lower(), value.encode("utf-8"))
                for name, value in message.fields
            ]
        except UnicodeEncodeError:  # a lone surrogate pycapnp let through
            raise _Refused(400, "a map entry is not valid UTF-8") from None

    def _ended(
        self, stream_id: int, stream: _RequestStream, events: list[RawEvent], body: list[bytes]
    ) -> None:
        if stream.buffer:
            raise _Refused(400, "a message truncated by the end of the stream")
        phase = stream.phase
        if phase == _AWAIT_HEAD:
            raise _Refused(400, "the stream ended before its headers")
        if phase == _BODY:
            events.append(DataReceived(stream_id, _join(body), True))
            stream.phase = _ENDED
        elif phase == _AFTER_TRAILERS:
            assert stream.trailers is not None
            events.append(TrailersReceived(stream_id, stream.trailers))
            stream.trailers = None
            stream.phase = _ENDED

    def _reject(
        self,
        stream_id: int,
        stream: _RequestStream,
        error: _Refused,
        fin: bool,
        events: list[RawEvent],
    ) -> None:
        stream.drop()
        if not fin:
            self._stop(stream_id, STOP_OK)
        else:
            stream.receiving_ended = True
        events.append(MessageRejected(stream_id, error.status, error.reason))

    def _aborted(self, stream_id: int, code: int, by_reset: bool) -> list[RawEvent]:
        stream = self._requests.get(stream_id)
        if stream is None:
            if not by_reset:
                return []  # STOP_SENDING on a stream we never heard of: nothing to answer
            stream = self._requests[stream_id] = _RequestStream()
        if by_reset:
            stream.receiving_ended = True
            was_dropping = stream.phase == _DROPPING
            stream.drop()
            if stream.forgotten:
                del self._requests[stream_id]
            if was_dropping:
                return []
        elif stream.forgotten:
            return []
        return [StreamAborted(stream_id, code, by_reset)]

    # --- output ---

    def send_head(self, stream_id: int, status: int, headers: Sequence[Header]) -> None:
        """Queue the response's headers map: `x-status` first, then `headers` in order.

        Raises `StreamGone` if the stream can no longer send.
        """
        self._send(stream_id, encode_head(status, headers), False)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        """Queue `data` as one body message; empty `data` with `end_stream` sends only the FIN."""
        if data:
            prefix, padding = body_frame(len(data))
            self._send(stream_id, prefix, False)
            self._send(stream_id, data + padding if padding else data, end_stream)
        elif end_stream:
            self._send(stream_id, b"", True)

    def send_trailers(self, stream_id: int, fields: Sequence[Header]) -> None:
        """Queue a trailers map and the FIN."""
        self._send(stream_id, encode_map(fields, trailers=True), True)

    def end(self, stream_id: int) -> None:
        """Send the FIN: the response is complete."""
        self._send(stream_id, b"", True)

    def _send(self, stream_id: int, payload: bytes, end_stream: bool) -> None:
        try:
            self._quic.send_stream_data(stream_id, payload, end_stream)
        except (RuntimeError, ValueError) as exc:
            # aioquic: RuntimeError after a reset or the FIN, ValueError for a discarded stream.
            raise StreamGone(stream_id, str(exc)) from exc

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        """Abort sending (RESET_STREAM) and reading (STOP_SENDING), dropping what still comes."""
        with contextlib.suppress(RuntimeError, ValueError):  # ended or discarded already
            self._quic.reset_stream(stream_id, error_code)
        self.stop_receiving(stream_id, error_code)

    def stop_receiving(self, stream_id: int, error_code: int) -> None:
        """Ask the peer to stop sending (STOP_SENDING) and ignore what still comes."""
        stream = self._requests.get(stream_id)
        if stream is None:
            stream = self._requests[stream_id] = _RequestStream()
        if not stream.receiving_ended:
            self._stop(stream_id, error_code)
        stream.drop()
        stream.released = True

    def forget(self, stream_id: int) -> None:
        """Drop the state of a stream the application is done with (a marker stays until the
        peer's FIN or reset, so late input is discarded instead of read as a new request)."""
        stream = self._requests.get(stream_id)
        if stream is None:
            return
        if stream.receiving_ended:
            del self._requests[stream_id]
        else:
            stream.forgotten = stream.released = True
            stream.drop()

    def released(self, stream_id: int) -> bool:
        """The application has stopped reading the stream (`stop_receiving`, `reset_stream` or
        `forget`): events of it still in a batch `handle_event` returned are stale."""
        stream = self._requests.get(stream_id)
        return stream is not None and stream.released

    def _stop(self, stream_id: int, error_code: int) -> None:
        with contextlib.suppress(RuntimeError, ValueError):  # discarded already: nothing to stop
            self._quic.stop_stream(stream_id, error_code)

    @property
    def open_streams(self) -> int:
        """Request streams the layer holds state for (for tests and metrics)."""
        return len(self._requests)

    def buffered(self, stream_id: int) -> int:
        """Bytes held of a stream's incomplete message (for tests)."""
        stream = self._requests.get(stream_id)
        return 0 if stream is None else len(stream.buffer)


def _join(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


# --- encoding ---

_BODY_ROOT = struct.pack("<QQQ", 1 << 32 | 1 << 48, 1, 1 << 48)  # root, union tag 1, Body ptr


def body_frame(size: int) -> tuple[bytes, bytes]:
    """The bytes around `size` bytes of content in a standard-framed body `Message`: the prefix
    (segment table, root struct, Body struct, Data pointer) and the padding to a word."""
    words = (size + 7) // 8
    prefix = (
        struct.pack("<II", 0, 4 + words) + _BODY_ROOT + struct.pack("<Q", 1 | 2 << 32 | size << 35)
    )
    return prefix, bytes(words * 8 - size)


def encode_map(fields: Sequence[Header], *, trailers: bool = False) -> bytes:
    entries = tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in fields)
    return encode_raw(RawHeaders(entries, trailers=trailers))


def encode_head(status: int, headers: Sequence[Header]) -> bytes:
    return encode_map([(b"x-status", str(status).encode("ascii")), *headers])


# --- the request head ---

# The raw-QUIC request's pseudo entries and what the HTTP/2 and HTTP/3 normaliser calls them.
_RAW_PSEUDO = {b"x-method": b":method", b"x-path": b":path", b"x-status": b":status"}


def request_fields(fields: Sequence[tuple[bytes, bytes]], authority: bytes) -> list[Header]:
    """A raw-QUIC request's map as an HTTP/3 header block, for `pseudo_head`: `x-method` and
    `x-path` become `:method` and `:path` (first, in that order; a missing one is left out, so
    the normaliser refuses the block), `:scheme` is https, `authority` stands in for a Host the
    gateway did not forward. Raises `ContractError` (400) for a name with a colon (the raw
    protocol has no pseudo-headers).

    The gateway writes its own `x-method` and `x-path` first and then appends the client's
    headers unfiltered, so a client's own `X-Method` or `X-Path` arrives as a later entry of the
    same name: the first is the gateway's and wins (as the reference reads them); later ones are
    the client's, which pylon's sanitizer strips on every transport alike (tunnel framing), so
    they are left out here. An `x-status` in a request is the client's too (the gateway sets it
    on answers only): an ordinary header, as it is on HTTP/1.1, HTTP/2 and HTTP/3."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[Header] = []
    has_host = False
    for name, value in fields:
        mapped = _RAW_PSEUDO.get(name)
        if mapped == b":status":
            regular.append((name, value))
        elif mapped is not None:
            if mapped not in pseudo:
                pseudo[mapped] = value
        elif name[:1] == b":" or b":" in name:
            raise malformed("a raw-QUIC field name with a colon")
        else:
            has_host = has_host or name == b"host"
            regular.append((name, value))
    block: list[Header] = [(mapped, pseudo[mapped]) for mapped in (b":method",) if mapped in pseudo]
    block.append((b":scheme", b"https"))
    if b":path" in pseudo:
        block.append((b":path", pseudo[b":path"]))
    if not has_host:
        block.append((b":authority", authority))
    block += regular
    return block


# --- the connection ---


@dataclass(frozen=True, slots=True)
class RawQuicOptions:
    """A raw-QUIC tunnel connection's own options (request limits are the Ingress's)."""

    # The host a request stands for when the gateway forwards none (pylon writes the engine's
    # own Host upstream, so this only satisfies the normaliser and shows in nothing forwarded).
    authority: str = "localhost"
    # The largest body message read (content bytes); the request body's own limit still holds.
    max_body_chunk: int = DEFAULT_MAX_BODY_CHUNK
    drain_ack_grace: float = 2.0  # seconds a drained connection waits for its last ACKs

    def __post_init__(self) -> None:
        if self.max_body_chunk < 1:
            raise ValueError("max_body_chunk must be positive")
        if not self.authority:
            raise ValueError("authority must not be empty")


class RawQuicTunnelProtocol(QuicConnectionProtocol):
    """One reverse-tunnel QUIC connection serving raw-QUIC request streams.

    Give it to aioquic's `connect` as `create_protocol` (`functools.partial` with `ingress` and
    `options`). Request streams are served from the first packet; streams pylon opens itself
    (`create_stream()`, e.g. the handshake on stream 0) stay aioquic's, through the base
    class's stream readers. The owner drives the end: `drain()` (no new streams, finish the
    rest, then close), `close_now()`; `in_progress` counts unanswered requests.
    """

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: QuicStreamHandler | None = None,
        *,
        ingress: Ingress,
        options: RawQuicOptions | None = None,
    ) -> None:
        super().__init__(quic, stream_handler)
        self._options = options = options or RawQuicOptions()
        limits = ingress.limits
        self._observer = ingress.proxy.observer
        self._authority = options.authority.encode("ascii")
        self._table = StreamTable(PROTOCOL, self, ingress, self._loop)
        entries = min(MAX_MAP_ENTRIES, limits.max_headers + 4)
        self._layer = RawQuicLayer(
            quic,
            max_header_message=limits.max_header_bytes
            + MAP_ENTRY_OVERHEAD * entries
            + MAP_MESSAGE_OVERHEAD,
            max_body_message=min(limits.max_body_bytes, options.max_body_chunk)
            + BODY_MESSAGE_OVERHEAD,
        )
        self._receiving: set[int] = set()  # request streams whose gateway is still sending
        self._responders: dict[int, RawResponder] = {}
        self._dirty: list[RawResponder] = []
        self._flush_handle: asyncio.Handle | None = None
        self._deferred_transmit: asyncio.TimerHandle | None = None
        self._draining = False
        self._grace: asyncio.TimerHandle | None = None
        self._gone = False  # the connection is closing: its streams are cancelled
        self._handshake_done = False
        # Streams pylon opens itself are client-initiated (low bits 00 and 10) on a reverse
        # tunnel; the base class's readers serve them (the handshake).
        self._own_bits = 0 if quic.configuration.is_client else 1
        self._own_bits_uni = self._own_bits | 0x2
        with contextlib.suppress(RuntimeError):  # handed a connection already started: as is
            limit_peer_bidi_streams(quic, limits.max_quic_streams)

    # --- aioquic ---
    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # As in pylon's HTTP/3: let an ACK wait up to ACK_COALESCE_DELAY to ride with the
        # response rather than going out alone.
        self._quic.receive_datagram(cast(bytes, data), addr, now=self._loop.time())
        self._process_events()
        if not self._gone and closing(self._quic):
            self._streams_gone()  # the gateway's CONNECTION_CLOSE: cancel now
        if self._handshake_done:
            if self._deferred_transmit is None:
                self._deferred_transmit = self._loop.call_later(ACK_COALESCE_DELAY, self.transmit)
        else:
            self.transmit()
        if self._responders:
            self._wake_writers()
        if self._draining:
            self._maybe_close_drained()

    def transmit(self) -> None:
        if self._deferred_transmit is not None:
            self._deferred_transmit.cancel()
            self._deferred_transmit = None
        super().transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self._handshake_done = True
        elif isinstance(event, ConnectionTerminated):
            self._streams_gone()
        stream_id = getattr(event, "stream_id", None)
        if stream_id is None or stream_id & 0x3 in (self._own_bits, self._own_bits_uni):
            super().quic_event_received(event)  # pylon's own streams: aioquic's readers
            return
        if not self._layer.is_request_stream(stream_id):
            # A unidirectional stream from the gateway: raw QUIC has none, and aioquic's
            # readers would buffer it without bound. Its data is dropped; the gateway is asked
            # to stop sending on it.
            if isinstance(event, StreamDataReceived) and not event.end_stream:
                with contextlib.suppress(RuntimeError, ValueError):
                    self._quic.stop_stream(stream_id, STOP_UNKNOWN)
            return
        if self._gone:
            return
        for raw_event in self._layer.handle_event(event):
            if isinstance(raw_event, MessageRejected) and self._layer.released(stream_id):
                continue  # answered already by an event before it in this batch
            self._raw_event(raw_event)

    # --- request events ---
    def _raw_event(self, event: RawEvent) -> None:
        if isinstance(event, DataReceived):
            if event.stream_ended:
                self._receiving.discard(event.stream_id)
            self._table.data(event.stream_id, event.data, event.stream_ended)
        elif isinstance(event, HeadReceived):
            self._on_head(event)
        elif isinstance(event, TrailersReceived):
            self._receiving.discard(event.stream_id)
            self._table.trailers(event.stream_id, event.fields)
        elif isinstance(event, MessageRejected):
            self._on_rejected(event)
        elif isinstance(event, StreamAborted):
            self._on_aborted(event)

    def _on_head(self, event: HeadReceived) -> None:
        sid = event.stream_id
        if self._draining:
            self._refuse_stream(sid)
            return
        if not event.stream_ended:
            self._receiving.add(sid)
        try:
            block = request_fields(event.fields, self._authority)
        except ContractError as error:
            self._table.open(sid)
            self._malformed(sid, error, str(error))
            self._table.malformed(sid, error, event.fields)
            return
        self._table.header_block(sid, block, event.stream_ended)

    def _on_rejected(self, event: MessageRejected) -> None:
        sid = event.stream_id
        self._receiving.discard(sid)  # the layer stopped reading it already
        if self._table.get(sid) is None:
            if self._draining:
                self._refuse_stream(sid)
                return
            self._table.open(sid)
        error: PylonError
        if event.status == 431:
            error = LimitError(event.reason, code=PylonCode.HEADERS_TOO_LARGE)
        elif event.status == 413:
            error = LimitError(event.reason, code=PylonCode.BODY_TOO_LARGE)
        else:
            error = ContractError(
                f"malformed request: {event.reason}", code=PylonCode.MALFORMED_REQUEST
            )
        self._malformed(sid, error, event.reason)
        self._table.malformed(sid, error)

    def _malformed(self, sid: int, error: PylonError, detail: str) -> None:
        self._observer.transport_event(
            "stream_malformed",
            PROTOCOL,
            stream_id=sid,
            request_id=self._table.request_id(sid),
            status=error.status,
            detail=detail,
        )

    def _on_aborted(self, event: StreamAborted) -> None:
        sid = event.stream_id
        self._receiving.discard(sid)
        if self._table.peer_reset(sid):
            # Rapid reset (CVE-2023-44487): the abuser loses the connection.
            self._observer.transport_event(
                "raw_quic_flood", PROTOCOL, kind="rapid_reset", streams=len(self._table)
            )
            self.close_now("too many stream resets")
            return
        responder = self._responders.pop(sid, None)
        if responder is not None and not responder.closed:
            responder.closed = True
            responder.wake(ConnectionResetError("stream reset by the gateway"))
        # Either half aborted ends the request: stop the other half too, and forget it.
        self._reset(sid, STOP_CANCELLED)

    # --- Framing (used by the table) ---
    def response_sink(self, stream: Stream, request: AdmittedRequest) -> ResponseSink:
        responder = self._responders[stream.id] = RawResponder(self, stream.id, stream.is_head)
        return responder

    def reject_sink(self, stream: Stream) -> ResponseSink:
        sid = stream.id
        if sid in self._receiving:
            # Answer without reading the rest; ask the gateway to stop sending.
            self._receiving.discard(sid)
            self._layer.stop_receiving(sid, STOP_OK)
        return RawResponder(self, sid, stream.is_head)

    def stream_done(self, stream: Stream, crashed: bool) -> None:
        responder = self._responders.pop(stream.id, None)
        if crashed and responder is not None and not responder.closed:
            responder.closed = True
            self._reset(stream.id, STOP_UNKNOWN)
        self._maybe_close_drained()

    # --- the owner's controls ---
    @property
    def in_progress(self) -> int:
        """Requests on this connection that have started and are not answered yet."""
        return len(self._table)

    @property
    def tracked_streams(self) -> int:
        """Request streams the framing still holds state for (answered ones whose gateway side
        has not ended yet included): for tests and metrics."""
        return self._layer.open_streams

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self) -> None:
        """Refuse new request streams (reset with Stargate's GoAway code, so the gateway may
        retry them elsewhere), let admitted ones finish, then close the connection once every
        byte sent is acknowledged (at most `drain_ack_grace` after the last answer)."""
        if self._draining or self._gone:
            return
        self._draining = True
        self._observer.transport_event("raw_quic_draining", PROTOCOL, in_flight=len(self._table))
        self._maybe_close_drained()

    def close_now(self, reason: str = "shutting down") -> None:
        """Stop what still runs (outcome `shutdown`) and close the connection."""
        self._table.cancel_all(SHUTDOWN)
        self._streams_gone()
        if not self._closed.is_set():
            self.close(error_code=0, reason_phrase=reason)

    def _refuse_stream(self, sid: int) -> None:
        self._receiving.discard(sid)
        self._layer.reset_stream(sid, STOP_GOAWAY)
        self._layer.forget(sid)
        self._transmit_soon()

    def _maybe_close_drained(self) -> None:
        # Close only once every byte sent is acknowledged: CONNECTION_CLOSE ends
        # retransmission, so closing earlier could lose the end of a response.
        if not self._draining or self._gone or self._table.busy or len(self._table):
            return
        if not any_unacked(self._quic):
            self._loop.call_soon(self._close_drained)
        elif self._grace is None:
            self._grace = self._loop.call_later(self._options.drain_ack_grace, self._close_drained)

    def _close_drained(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        if not self._closed.is_set() and not self._gone:
            self._streams_gone()
            self.close(error_code=0, reason_phrase="drained")

    def _streams_gone(self) -> None:
        """The connection is closing: no stream on it can make progress, so stop their work."""
        if self._gone:
            return
        self._gone = True
        self._table.cancel_all(CLIENT_GONE)
        for responder in self._responders.values():
            responder.closed = True
            responder.wake(ConnectionResetError("QUIC connection closed"))
        self._responders.clear()

    # --- used by RawResponder ---
    def schedule(self, responder: RawResponder) -> None:
        # Corked: what a relay writes in one loop iteration goes out as one body message, and
        # every stream shares one transmit.
        self._dirty.append(responder)
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        dirty, self._dirty = self._dirty, []
        for responder in dirty:
            responder.flush(self._layer)
        self.transmit()

    def _reset(self, sid: int, code: int) -> None:
        self._layer.reset_stream(sid, code)
        self._layer.forget(sid)
        self._transmit_soon()

    def _transmit_soon(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def backlog(self, sid: int) -> int:
        """Bytes sent on the stream and not yet acknowledged: "the gateway is not keeping up"."""
        return send_backlog(self._quic, sid)

    def forget_stream(self, sid: int) -> None:
        self._layer.forget(sid)

    def _wake_writers(self) -> None:
        for responder in list(self._responders.values()):
            if responder.waiter is not None and self.backlog(responder.sid) <= SEND_LOW_WATER:
                responder.wake(None)


class RawResponder(QuicResponder[tuple[int, list[Header]]]):
    """`ResponseSink` for one raw-QUIC response stream: a headers message (`x-status` first),
    body messages."""

    __slots__ = ()
    ABORT_CODE = STOP_UNKNOWN

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        head = list(headers)  # normalised by the sender (`pylon.proxy.sink.ResponseSink.start`)
        if content_length is not None:
            head.append((b"content-length", str(content_length).encode("ascii")))
        self._head = (status, head)
        self._queue()

    def flush(self, layer: RawQuicLayer) -> None:
        if self.closed:
            self._queued = False
            return
        ended, head, parts = self._take()
        conn = cast("RawQuicTunnelProtocol", self._conn)
        try:
            if head is not None:
                layer.send_head(self.sid, head[0], head[1])
            if parts:
                layer.send_data(self.sid, _join(parts), ended)
            elif ended:
                layer.end(self.sid)
        except StreamGone:
            self.closed = True  # the gateway reset the stream between the write and this flush
            conn.forget_stream(self.sid)
            return
        if ended:
            self.closed = True
            conn.forget_stream(self.sid)


def raw_quic_protocol(
    ingress: Ingress, options: RawQuicOptions | None = None
) -> Callable[..., RawQuicTunnelProtocol]:
    """The `create_protocol` for `aioquic.asyncio.client.connect` of a raw-QUIC reverse tunnel."""

    def create(
        quic: QuicConnection, stream_handler: QuicStreamHandler | None = None
    ) -> RawQuicTunnelProtocol:
        return RawQuicTunnelProtocol(quic, stream_handler, ingress=ingress, options=options)

    return create

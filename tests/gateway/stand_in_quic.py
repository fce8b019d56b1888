"""The stand-in gateway's QUIC side: the reverse-tunnel listener pylon dials.

An aioquic QUIC server on 127.0.0.1, port 0, with a leaf certificate for `stargate` (the SNI
pylon sends for an IP target) signed by a CA of its own (`ca_path`, what a test passes as
`--gateway-ca`). Each connection's first client bidirectional stream carries pylon's Cap'n Proto
`Handshake`; the stand-in checks the id and token against `tokens`, answers the gateway's NACK
reasons (`nack_next` forces the next answers; `refuse_duplicates` refuses a second live
connection of the same id with `duplicate connection`), and once it accepted, acts as the
HTTP/3 *client* on its server side of QUIC: requests go out on server-initiated bidirectional
streams (id 1 mod 4), as Stargate's `build_h3_client_connection` does.

With `protocol="raw-quic"` the same connection carries raw-QUIC request streams instead. The
Stargate contract facts this side relies on (docs/gateway-raw-quic.md, reference/stargate-
contract.md B2):
- the reverse tunnel negotiates no ALPN for raw-quic (the reference's protocol crate lists no
  ALPN for its raw-QUIC transport, `h3` for HTTP/3 and WebTransport; its `stargate-quic/1`
  constant is not what the reverse dial offers): the stand-in's listener offers none;
- the handshake on pylon's first bidirectional stream is the same as with HTTP/3;
- one gateway-opened (server-initiated, id 1 mod 4) bidirectional stream per request; each
  direction is a sequence of Cap'n Proto standard-framed `Message`s: one headers map first
  (a request's carrying `x-method` and `x-path`, path with query, by name; a response's carrying
  `x-status`, the decimal status, at any position), then body chunks as `Body` messages, then at
  most one trailers map; the FIN ends the message;
- names are compared lower-cased; each value of a multi-valued header is its own entry;
- stream abort codes are `StreamStopCode`: 0 ok, 1 cancelled, 2 unknown, 3 go-away.
The Cap'n Proto layer itself is pylon's (`pylon.gateway.wire`: pycapnp encoding and decoding
from pylon's `tunnel.capnp`), so a mistake in that schema file would be shared by both sides and
not caught here; what is independent of it is the stand-in's own framing and sequencing (and
tests/unit/test_rawquic.py checks pylon's hand-built Body frames against pycapnp's).

The HTTP/3 client is a small one of its own on pylsqpack (static table only, as pylon's layer
advertises), not aioquic's `H3Connection`, whose role follows `configuration.is_client` and whose
request-stream test hard-codes client-initiated ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pylsqpack
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StreamDataReceived,
    StreamReset,
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pylon.gateway import wire
from pylon.gateway.tunnel import TunnelProtocol
from tests.certs import make_ca, make_leaf, write_pair

H3_REQUEST_CANCELLED = 0x10C
_DATA, _HEADERS, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x4, 0x7
MAX_FRAME = 1 << 20  # a frame larger than this is a broken test, not a response
# Raw QUIC: Stargate's `StreamStopCode` values the stand-in sends or expects.
RAW_STOP_CANCELLED = 1
RAW_STOP_GOAWAY = 3
RAW_BODY_CHUNK = 16 * 1024  # the request body goes out in Body messages of at most this
RAW_MAX_MESSAGE = 8 << 20  # a response message larger than this is a broken test


def varint(value: int) -> bytes:
    if value < 0x40:
        return bytes((value,))
    if value < 0x4000:
        return (value | 0x4000).to_bytes(2, "big")
    if value < 0x4000_0000:
        return (value | 0x8000_0000).to_bytes(4, "big")
    return (value | 0xC000_0000_0000_0000).to_bytes(8, "big")


def read_varint(data: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    if pos >= len(data):
        return None
    size = 1 << (data[pos] >> 6)
    if pos + size > len(data):
        return None
    value = int.from_bytes(data[pos : pos + size], "big") & ((1 << (8 * size - 2)) - 1)
    return value, pos + size


def frame(kind: int, payload: bytes) -> bytes:
    return varint(kind) + varint(len(payload)) + payload


def frames(buffer: bytearray) -> list[tuple[int, bytes]]:
    """Cut whole frames off the front of `buffer`."""
    out: list[tuple[int, bytes]] = []
    while True:
        head = read_varint(buffer, 0)
        if head is None:
            return out
        length = read_varint(buffer, head[1])
        if length is None:
            return out
        if length[0] > MAX_FRAME:
            raise ValueError(f"a {length[0]}-byte frame")
        end = length[1] + length[0]
        if len(buffer) < end:
            return out
        out.append((head[0], bytes(buffer[length[1] : end])))
        del buffer[:end]


@dataclass
class GatewayResponse:
    """One request the stand-in sent toward pylon, and what came back."""

    stream_id: int
    connection: GatewayConnection
    status: int | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    trailers: list[tuple[str, str]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    reset_code: int | None = None
    ended: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    buffer: bytearray = field(default_factory=bytearray)
    # raw-quic: the response's message reader (None on HTTP/3)
    reader: wire.FrameReader | None = None

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key == name), None)

    async def wait(self, timeout: float = 10.0) -> GatewayResponse:
        async with asyncio.timeout(timeout):
            await self.done.wait()
        return self

    async def stream(self, timeout: float = 10.0) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive, until the stream ends (or is reset)."""
        seen = 0
        async with asyncio.timeout(timeout):
            while True:
                while seen < len(self.chunks):
                    seen += 1
                    yield self.chunks[seen - 1]
                if self.done.is_set():
                    return
                self.progress.clear()
                await self.progress.wait()

    def _changed(self) -> None:
        self.progress.set()


class GatewayConnection(QuicConnectionProtocol):
    """One tunnel connection, from pylon's dial to its end."""

    def __init__(self, quic: QuicConnection, gateway: StandInGateway, **kwargs: Any) -> None:
        super().__init__(quic, **kwargs)
        self.gateway = gateway
        self.handshake: wire.Handshake | None = None
        self.accepted = False
        self.terminated: ConnectionTerminated | None = None
        self.silent = False  # `vanish`: every datagram dropped, nothing sent
        self.datagrams = 0  # received (keepalive PINGs included)
        self.goaways: list[int] = []
        self._reader = wire.FrameReader(wire.MAX_HANDSHAKE_BYTES)
        self._responses: dict[int, GatewayResponse] = {}
        self._uni: dict[int, bytearray] = {}
        self._uni_kind: dict[int, int] = {}
        self._encoder = pylsqpack.Encoder()
        self._decoder = pylsqpack.Decoder(0, 0)
        self.progress = asyncio.Event()
        self.protocol: TunnelProtocol = gateway.protocol

    # --- aioquic ---
    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if not self.silent:
            self.datagrams += 1
            super().datagram_received(data, addr)
            self.gateway._changed()

    def transmit(self) -> None:
        if not self.silent:
            super().transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            pass
        elif isinstance(event, StreamDataReceived):
            self._data(event)
        elif isinstance(event, StreamReset):
            response = self._responses.get(event.stream_id)
            if response is not None:
                response.reset_code = event.error_code
                response.done.set()
                response._changed()
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event
            for response in self._responses.values():
                response.done.set()
                response._changed()
            self.gateway._gone(self)
        self.progress.set()
        self.gateway._changed()

    def _data(self, event: StreamDataReceived) -> None:
        sid = event.stream_id
        if sid == 0:
            self._handshake_data(event.data)
        elif sid & 0x3 == 0x1:
            self._response_data(sid, event.data, event.end_stream)
        elif sid & 0x3 == 0x2:
            self._uni_data(sid, event.data)

    # --- the handshake ---
    def _handshake_data(self, data: bytes) -> None:
        if self.handshake is not None:
            return
        messages = self._reader.feed(data)
        if not messages:
            return
        self.handshake = handshake = wire.decode_handshake(messages[0])
        reason = self.gateway._judge(self, handshake)
        ack = wire.HandshakeAck(reason is None, reason or "")
        self._quic.send_stream_data(0, wire.encode_handshake_ack(ack), end_stream=True)
        if reason is None:
            self.accepted = True
            if self.protocol == "http3":
                self._start_h3()
        self.transmit()
        if reason is not None:
            # Stargate waits for the NACK to be read; then the connection is closed.
            asyncio.get_running_loop().call_later(0.5, self._close_refused)
        self.gateway._handshook(self, reason)

    def _close_refused(self) -> None:
        if self.terminated is None:
            self.close(error_code=0, reason_phrase="handshake refused")

    # --- HTTP/3, client role on the QUIC server side ---
    def _start_h3(self) -> None:
        control = self._quic.get_next_available_stream_id(is_unidirectional=True)
        settings = varint(0x1) + varint(0) + varint(0x7) + varint(0)
        self._quic.send_stream_data(control, varint(0x0) + frame(_SETTINGS, settings))

    def send_request(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes = b"",
        end: bool = True,
    ) -> GatewayResponse:
        if self.protocol == "raw-quic":
            return self._send_raw_request(method, path, headers, body, end)
        sid = self._quic.get_next_available_stream_id()
        response = self._responses[sid] = GatewayResponse(sid, self)
        fields = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", self.gateway.authority.encode()),
            (b":path", path.encode()),
            *[(name.encode(), value.encode()) for name, value in headers],
        ]
        _, block = self._encoder.encode(sid, fields)
        self._quic.send_stream_data(sid, frame(_HEADERS, block), end_stream=end and not body)
        if body:
            self._quic.send_stream_data(sid, frame(_DATA, body), end_stream=end)
        self.transmit()
        return response

    def send_body(self, response: GatewayResponse, data: bytes, end: bool) -> None:
        if self.protocol == "raw-quic":
            payload = _raw_body(data)
        else:
            payload = frame(_DATA, data) if data else b""
        self._quic.send_stream_data(response.stream_id, payload, end)
        self.transmit()

    def reset(self, response: GatewayResponse, code: int | None = None) -> None:
        """RESET_STREAM and STOP_SENDING: the caller went away (`code`: the protocol's own
        "cancelled" by default)."""
        if code is None:
            code = RAW_STOP_CANCELLED if self.protocol == "raw-quic" else H3_REQUEST_CANCELLED
        sid = response.stream_id
        with contextlib.suppress(ValueError, RuntimeError):
            self._quic.reset_stream(sid, code)
        with contextlib.suppress(ValueError, RuntimeError):
            self._quic.stop_stream(sid, code)
        self.transmit()

    def _response_data(self, sid: int, data: bytes, ended: bool) -> None:
        response = self._responses.get(sid)
        if response is None:
            return
        if self.protocol == "raw-quic":
            self._raw_response_data(response, data)
            if ended:
                response.ended = True
                response.done.set()
            response._changed()
            return
        response.buffer += data
        for kind, payload in frames(response.buffer):
            if kind == _HEADERS:
                _, decoded = self._decoder.feed_header(sid, payload)
                pairs = [(n.decode(), v.decode()) for n, v in decoded]
                if response.status is None:
                    response.status = int(dict(pairs)[":status"])
                    response.headers = [(n, v) for n, v in pairs if not n.startswith(":")]
                else:
                    response.trailers = pairs
            elif kind == _DATA and payload:
                response.chunks.append(payload)
        if ended:
            response.ended = True
            response.done.set()
        response._changed()

    # --- raw QUIC, the gateway's side ---
    def _send_raw_request(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, end: bool
    ) -> GatewayResponse:
        sid = self._quic.get_next_available_stream_id()  # server-initiated bidi: 1 mod 4
        response = self._responses[sid] = GatewayResponse(
            sid, self, reader=wire.FrameReader(RAW_MAX_MESSAGE)
        )
        # The request head: x-method and x-path (read by name), then the forwarded headers.
        head = wire.RawHeaders((("x-method", method), ("x-path", path), *headers))
        payload = wire.encode_raw(head) + _raw_body(body)
        self._quic.send_stream_data(sid, payload, end_stream=end)
        self.transmit()
        return response

    def _raw_response_data(self, response: GatewayResponse, data: bytes) -> None:
        assert response.reader is not None
        for message in response.reader.feed(data):
            decoded = wire.decode_raw(message)
            if isinstance(decoded, wire.RawBody):
                if decoded.content:
                    response.chunks.append(decoded.content)
                continue
            pairs = [(name.lower(), value) for name, value in decoded.fields]
            if decoded.trailers:
                response.trailers = pairs
            elif response.status is None:
                # x-status by name: the reference puts it last, pylon first.
                response.status = int(dict(pairs)["x-status"])
                response.headers = [(n, v) for n, v in pairs if n != "x-status"]
            else:
                raise AssertionError("a second headers message on a raw-QUIC response")

    def _uni_data(self, sid: int, data: bytes) -> None:
        buffer = self._uni.setdefault(sid, bytearray())
        buffer += data
        if sid not in self._uni_kind:
            kind = read_varint(buffer, 0)
            if kind is None:
                return
            self._uni_kind[sid] = kind[0]
            del buffer[: kind[1]]
        if self._uni_kind[sid] != 0x0:
            buffer.clear()  # QPACK streams: nothing to read with a zero-capacity table
            return
        for kind, payload in frames(buffer):
            if kind == _GOAWAY:
                parsed = read_varint(payload, 0)
                if parsed is not None:
                    self.goaways.append(parsed[0])

    # --- faults ---
    def drop(self) -> None:
        """Close the connection now (CONNECTION_CLOSE): pylon sees it at once."""
        self.close(error_code=0, reason_phrase="dropped by the stand-in")

    def vanish(self) -> None:
        """Go silent without a word: pylon notices only by its idle timeout."""
        self.silent = True


def _raw_body(body: bytes) -> bytes:
    """`body` as raw-QUIC Body messages of at most RAW_BODY_CHUNK content bytes each."""
    return b"".join(
        wire.encode_raw(wire.RawBody(body[at : at + RAW_BODY_CHUNK]))
        for at in range(0, len(body), RAW_BODY_CHUNK)
    )


class StandInGateway:
    """The reverse-tunnel listener (see the module docstring). `protocol` is the stream layer
    its accepted connections carry: "http3" (role-reversed HTTP/3, ALPN h3) or "raw-quic" (Cap'n
    Proto messages per stream, no ALPN)."""

    def __init__(
        self,
        folder: Path,
        tokens: dict[str, str | None] | None = None,
        *,
        refuse_duplicates: bool = False,
        authority: str = "stargate",
        ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
        protocol: TunnelProtocol = "http3",
    ) -> None:
        if protocol not in ("http3", "raw-quic"):
            raise ValueError(f"unknown tunnel protocol {protocol!r}")
        self.folder = folder
        self.protocol: TunnelProtocol = protocol
        # inference server id -> the token it must present (None: none)
        self.tokens: dict[str, str | None] = dict(tokens or {"node-1": None})
        self.refuse_duplicates = refuse_duplicates
        self.authority = authority
        self.nack_next: list[str] = []  # the next handshakes' answers, whatever they carry
        self.handshakes: list[tuple[wire.Handshake, str | None]] = []  # (handshake, NACK)
        self.refused: Counter[str] = Counter()
        self.live: list[GatewayConnection] = []  # accepted and not ended
        # `keep_gone`: an ended connection still counts for the duplicate check (a gateway
        # that has not noticed a broken path yet) until `release_gone`.
        self.keep_gone = False
        self.gone: list[GatewayConnection] = []
        self.accepted = 0
        self.dialled = 0  # QUIC connections pylon opened
        self._server: QuicServer | None = None
        self._round_robin = itertools.count()
        self._change = asyncio.Event()
        self.ca = ca = ca or make_ca("stand-in gateway CA")  # another stand-in may share it
        self.ca_path = folder / "gateway-ca.pem"
        self.ca_path.write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
        self.cert_path, self.key_path = write_pair(folder, make_leaf(ca, "stargate"), "gateway")
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> StandInGateway:
        # As pylon's dialer (`TunnelOptions.protocol`): h3 for HTTP/3, no ALPN for raw QUIC.
        alpn = ["h3"] if self.protocol == "http3" else None
        configuration = QuicConfiguration(is_client=False, alpn_protocols=alpn)
        configuration.load_cert_chain(self.cert_path, self.key_path)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: QuicServer(configuration=configuration, create_protocol=self._create),
            local_addr=("127.0.0.1", 0),
        )
        assert isinstance(protocol, QuicServer)
        self._server = protocol
        self.port = int(transport.get_extra_info("sockname")[1])
        return self

    def close(self) -> None:
        for connection in list(self.live):
            connection.drop()
        if self._server is not None:
            self._server.close()
            self._server = None

    def _create(self, quic: QuicConnection, **kwargs: Any) -> GatewayConnection:
        self.dialled += 1
        return GatewayConnection(quic, self, **kwargs)

    # --- the handshake's verdict ---
    def _judge(self, connection: GatewayConnection, handshake: wire.Handshake) -> str | None:
        if self.nack_next:
            return self.nack_next.pop(0)
        server_id = handshake.inference_server_id
        if not server_id:
            return wire.NACK_EMPTY_ID
        if server_id not in self.tokens:
            return wire.NACK_UNAUTHORIZED_ID
        if self.tokens[server_id] != handshake.auth_token:
            return wire.NACK_AUTHENTICATION
        if self.refuse_duplicates and any(
            c.handshake is not None and c.handshake.inference_server_id == server_id
            for c in [*self.live, *self.gone]
        ):
            return wire.NACK_DUPLICATE
        return None

    def _handshook(self, connection: GatewayConnection, reason: str | None) -> None:
        assert connection.handshake is not None
        self.handshakes.append((connection.handshake, reason))
        if reason is None:
            self.accepted += 1
            self.live.append(connection)
        else:
            self.refused[reason] += 1

    def _gone(self, connection: GatewayConnection) -> None:
        if connection in self.live:
            self.live.remove(connection)
            if self.keep_gone:
                self.gone.append(connection)

    def release_gone(self) -> None:
        """The gateway finally notices its old connections are dead."""
        self.gone.clear()
        self.keep_gone = False

    def _changed(self) -> None:
        self._change.set()

    async def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "it"
    ) -> None:
        """Return once `predicate()` holds, checked after every event on any connection."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._change.clear()
                    await self._change.wait()
        except TimeoutError:
            raise AssertionError(f"{what} did not happen within {timeout:g} s") from None

    async def wait_live(self, count: int, timeout: float = 10.0) -> None:
        await self.wait_until(lambda: len(self.live) >= count, timeout, f"{count} live tunnels")

    # --- requests toward pylon ---
    def connection(self) -> GatewayConnection:
        live = [c for c in self.live if not c.silent]
        assert live, "no live tunnel connection"
        return live[next(self._round_robin) % len(live)]

    def send(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes = b"",
        *,
        end: bool = True,
        connection: GatewayConnection | None = None,
    ) -> GatewayResponse:
        return (connection or self.connection()).send_request(method, path, headers, body, end)

    async def request(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes = b"",
        *,
        timeout: float = 10.0,
        connection: GatewayConnection | None = None,
    ) -> GatewayResponse:
        return await self.send(method, path, headers, body, connection=connection).wait(timeout)

    def reset(self, response: GatewayResponse, code: int | None = None) -> None:
        """Abort the request's stream (`code`: the protocol's "cancelled" by default)."""
        response.connection.reset(response, code)

    def drop(self, connection: GatewayConnection | None = None) -> None:
        """Kill one live connection (the first, by default)."""
        (connection or self.live[0]).drop()

"""A low-level HTTP/3 test client on aioquic: sends what a well-behaved client would, and what
one never would (malformed headers, resets, partial bodies), and records every response event."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aioquic._buffer import Buffer, BufferReadError
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import FrameType, H3Connection, H3Stream, StreamType
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset
from cryptography.hazmat.primitives import hashes

from pylon.server.quic_private import peer_reset_tokens
from pylon.server.stateless_reset import is_reset

MODEL = "mock-model"
CHAT = "/v1/chat/completions"
Headers = list[tuple[bytes, bytes]]


@dataclass
class H3Response:
    stream_id: int
    status: int | None = None
    headers: Headers = field(default_factory=list)
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival time, data)
    reset_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    def json(self) -> Any:
        return orjson.loads(self.body)

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)

    async def wait(self, timeout: float = 5.0) -> H3Response:
        async with asyncio.timeout(timeout):
            await self.done.wait()
        return self


class _RecordingH3(H3Connection):
    """Client-side H3Connection that keeps the peer's control stream bytes, so tests can see
    GOAWAY frames (aioquic discards their payload)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.control_bytes = b""
        super().__init__(*args, **kwargs)

    def _receive_stream_data_uni(
        self, stream: H3Stream, data: bytes, stream_ended: bool
    ) -> list[H3Event]:
        is_control = stream.stream_type == StreamType.CONTROL or (
            stream.stream_type is None and data[:1] == bytes([StreamType.CONTROL])
        )
        if is_control:
            self.control_bytes += data
        return super()._receive_stream_data_uni(stream, data, stream_ended)

    @property
    def goaways(self) -> list[int]:
        """Stream ids of the GOAWAY frames received so far."""
        buf = Buffer(data=self.control_bytes)
        buf.pull_uint_var()  # stream type
        found = []
        while not buf.eof():
            try:
                frame_type, length = buf.pull_uint_var(), buf.pull_uint_var()
                payload = buf.pull_bytes(length)
            except BufferReadError:
                break
            if frame_type == FrameType.GOAWAY:
                found.append(Buffer(data=payload).pull_uint_var())
        return found


class H3Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = _RecordingH3(self._quic)
        self.responses: dict[int, H3Response] = {}
        self.terminated: ConnectionTerminated | None = None
        self.stateless_reset = False  # the connection ended by a stateless reset
        self._progress = asyncio.Event()  # set after every QUIC event the client handles

    @property
    def goaways(self) -> list[int]:
        return self.http.goaways

    @property
    def peer_fingerprint(self) -> str:
        certificate = self._quic.tls._peer_certificate
        assert certificate is not None
        return certificate.fingerprint(hashes.SHA256()).hex()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        # aioquic never checks stateless reset tokens (the connection would wait out its idle
        # timeout); a client that does sees one at once (RFC 9000 10.3.1) and stops there.
        datagram = bytes(data) if isinstance(data, bytes) else data.encode()
        if self.stateless_reset:
            return
        if self.terminated is None and is_reset(datagram, peer_reset_tokens(self._quic)):
            self.stateless_reset = True
            self.quic_event_received(
                ConnectionTerminated(error_code=0, frame_type=None, reason_phrase="stateless reset")
            )
            self._closed.set()
            return
        super().datagram_received(data, addr)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamReset) and event.stream_id in self.responses:
            response = self.responses[event.stream_id]
            response.reset_code = event.error_code
            response.done.set()
        if isinstance(event, ConnectionTerminated):
            self.terminated = event
            for response in self.responses.values():
                response.done.set()
        for h3_event in self.http.handle_event(event):
            self._h3_event(h3_event)
        self._progress.set()

    async def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "the condition"
    ) -> None:
        """Return once `predicate()` holds, checked again after each event from the server
        (response bytes, resets, GOAWAY, connection close), never on a clock."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            raise AssertionError(f"{what} did not happen within {timeout:g} s") from None

    def _h3_event(self, event: H3Event) -> None:
        if not isinstance(event, HeadersReceived | DataReceived):
            return
        response = self.responses.get(event.stream_id)
        if response is None:
            return
        if isinstance(event, HeadersReceived) and response.status is None:
            response.headers = list(event.headers)
            response.status = int(dict(event.headers)[b":status"])
        elif isinstance(event, DataReceived) and event.data:
            response.chunks.append((time.monotonic(), event.data))
        if event.stream_ended:
            response.done.set()

    def send(self, headers: Headers, body: bytes | None = b"", end: bool = True) -> H3Response:
        """Open a request stream; `headers` go out exactly as given (no client-side checks)."""
        sid = self._quic.get_next_available_stream_id()
        self.responses[sid] = H3Response(sid)
        self.http.send_headers(sid, headers, end_stream=end and not body)
        if body:
            self.http.send_data(sid, body, end_stream=end)
        self.transmit()
        return self.responses[sid]

    def send_data(self, sid: int, data: bytes, end: bool) -> None:
        self.http.send_data(sid, data, end_stream=end)
        self.transmit()

    def reset(self, sid: int, code: int = 0x10C) -> None:
        self._quic.reset_stream(sid, code)
        self._quic.stop_stream(sid, code)
        self.transmit()

    @property
    def peer_max_streams(self) -> int:
        return int(self._quic._remote_max_streams_bidi)

    async def request(
        self,
        path: str = CHAT,
        body: Any = None,
        headers: list[tuple[str, str]] | None = None,
        method: str = "POST",
        timeout: float = 5.0,
    ) -> H3Response:
        data = json.dumps(body).encode() if body is not None else b""
        return await self.send(request_headers(method, path, headers, data), data).wait(timeout)


def request_headers(
    method: str = "POST",
    path: str = CHAT,
    extra: list[tuple[str, str]] | None = None,
    body: bytes = b"",
) -> Headers:
    headers: Headers = [
        (b":method", method.encode()),
        (b":scheme", b"https"),
        (b":authority", b"localhost"),
        (b":path", path.encode()),
    ]
    if extra is None:
        extra = [("x-request-id", "req-1"), ("x-model", MODEL)]
    headers += [(name.encode(), value.encode()) for name, value in extra]
    if body:
        headers += [(b"content-type", b"application/json")]
    return headers


def chat(stream: bool = False, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 4,
        **extra,
    }


def client_configuration(
    cert: Path | None = None, key: Path | None = None, **options: Any
) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=["h3"], server_name="localhost", **options
    )
    configuration.verify_mode = 0  # ssl.CERT_NONE: tests compare fingerprints instead
    if cert is not None:
        configuration.load_cert_chain(cert, key)
    return configuration


def sse_payloads(body: bytes) -> list[bytes]:
    return [
        line[5:].strip()
        for line in body.split(b"\n")
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
    ]

"""HTTP/3 test helpers: pylon's QUIC listener in front of mock_dynamo, and a low-level aioquic
client that can also send what a well-behaved client never would (malformed headers, resets).

Not a conftest.py (the name only groups it with the transport fixtures): test modules import
`h3_stack` from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aioquic._buffer import Buffer, BufferReadError
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import FrameType, H3Connection, H3Stream, StreamType
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamReset
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from mock_dynamo.server import MockConfig, MockServer, start_mock
from pylon.app import upstream_target
from pylon.logs import configure_logging
from pylon.proxy import Proxy
from pylon.server.http3 import Http3Server
from pylon.settings import Settings, load_settings
from pylon.tls import TlsIdentity
from pylon.upstream.pool import UpstreamPool

FLAVOR = {"dynamo": "dynamo", "passthrough": "dynamo", "vllm": "vllm", "sglang": "sglang"}
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

    @property
    def goaways(self) -> list[int]:
        return self.http.goaways

    @property
    def peer_fingerprint(self) -> str:
        certificate = self._quic.tls._peer_certificate
        assert certificate is not None
        return certificate.fingerprint(hashes.SHA256()).hex()

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


@dataclass
class H3Stack:
    mock: MockServer
    server: Http3Server
    identity: TlsIdentity
    settings: Settings
    host: str
    port: int
    http: httpx.AsyncClient

    @contextlib.asynccontextmanager
    async def connect(
        self, configuration: QuicConfiguration | None = None
    ) -> AsyncIterator[H3Client]:
        async with asyncio.timeout(10):
            async with connect(
                self.host,
                self.port,
                configuration=configuration or client_configuration(),
                create_protocol=H3Client,
                wait_connected=True,
            ) as client:
                assert isinstance(client, H3Client)
                yield client

    async def control(self) -> dict[str, Any]:
        reply = await self.http.get(f"{self.mock.base_url}/test-control")
        reply.raise_for_status()
        data: dict[str, Any] = reply.json()
        return data

    async def last_request(self) -> dict[str, Any]:
        requests = (await self.control())["requests"]
        assert requests, "nothing reached the engine"
        last: dict[str, Any] = requests[-1]
        return last


H3StackFactory = Callable[..., Awaitable[H3Stack]]


@pytest.fixture
async def h3_stack() -> AsyncIterator[H3StackFactory]:
    """mock_dynamo + pylon's proxy core + the HTTP/3 listener, all on 127.0.0.1."""
    configure_logging("json", "warning")
    cleanups: list[Callable[[], Any]] = []

    async def factory(
        backend: str = "dynamo", mock: dict[str, Any] | None = None, **overrides: Any
    ) -> H3Stack:
        engine = await start_mock(
            MockConfig(flavor=FLAVOR[backend], models=(MODEL,), **(mock or {})),  # type: ignore[arg-type]
            host="127.0.0.1",
            port=0,
        )
        cleanups.append(engine.stop)
        settings = load_settings(
            {
                "upstream": engine.base_url,
                "backend": backend,
                "log_level": "warning",
                "quic_listen": "127.0.0.1:0",
                **overrides,
            }
        )
        pool = UpstreamPool(
            upstream_target(str(settings.upstream)), connect_timeout=2, idle_timeout=4, max_idle=16
        )
        cleanups.append(pool.close)
        identity = TlsIdentity.from_paths(
            settings.tls_cert, settings.tls_key, settings.tls_client_ca
        )
        server = Http3Server(settings, Proxy(settings, pool), identity)
        host, port = await server.start("127.0.0.1", 0)
        cleanups.append(server.close)
        http = httpx.AsyncClient(timeout=5)
        cleanups.append(http.aclose)
        return H3Stack(engine, server, identity, settings, host, port, http)

    yield factory
    for cleanup in reversed(cleanups):
        result = cleanup()
        if asyncio.iscoroutine(result):
            await result


def sse_payloads(body: bytes) -> list[bytes]:
    return [
        line[5:].strip()
        for line in body.split(b"\n")
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
    ]


# --- certificates for the TLS tests ---
def make_ca(name: str = "pylon test CA") -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def make_leaf(
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    name: str = "localhost",
    days: float = 30,
    start_days: float = -1,
) -> tuple[bytes, bytes]:
    """(cert PEM, key PEM) for `name`, signed by `issuer` (self-signed when None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now + datetime.timedelta(days=start_days))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(issuer_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_pair(folder: Path, pair: tuple[bytes, bytes], stem: str = "server") -> tuple[Path, Path]:
    cert, key = folder / f"{stem}.crt", folder / f"{stem}.key"
    # Replace atomically, as a cert manager would, so the poller never reads half a file.
    for path, data in ((cert, pair[0]), (key, pair[1])):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return cert, key


def fingerprint(cert_pem: bytes) -> str:
    return x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256()).hex()

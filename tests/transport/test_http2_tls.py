"""The TCP listener with a certificate: TLS, ALPN h2 / http/1.1, mTLS, certificate hot reload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from tests.certs import fingerprint, make_ca, make_leaf, write_pair
from tests.integration.conftest import MODEL, StackFactory

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HEADERS = {"x-request-id": "tls-1", "x-model": MODEL}


def https(url: str) -> str:
    return url.replace("http://", "https://", 1)


def client_context(ca: Path, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


@pytest.mark.parametrize(("http2", "version"), [(True, "HTTP/2"), (False, "HTTP/1.1")])
async def test_alpn_selects_the_protocol(
    make_stack: StackFactory, tmp_path: Path, http2: bool, version: str
) -> None:
    ca = make_ca()
    cert, key = write_pair(tmp_path, make_leaf(ca))
    (tmp_path / "ca.pem").write_bytes(ca[0].public_bytes(encoding=Encoding.PEM))
    stack = await make_stack("dynamo", tls_cert=str(cert), tls_key=str(key))
    context = client_context(tmp_path / "ca.pem")
    url = https(stack.pylon_url).replace("127.0.0.1", "localhost")
    async with httpx.AsyncClient(verify=context, http2=http2, timeout=10) as client:
        reply = await client.post(f"{url}{CHAT}", json=BODY, headers=HEADERS)
    assert reply.status_code == 200
    assert reply.http_version == version
    assert (await stack.last_request())["body"]["messages"]


async def test_cleartext_is_refused_on_the_tls_port(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    cert, key = write_pair(tmp_path, make_leaf(make_ca()))
    stack = await make_stack("dynamo", tls_cert=str(cert), tls_key=str(key))
    async with httpx.AsyncClient(timeout=5) as client:
        with pytest.raises(httpx.HTTPError):
            await client.get(f"{stack.pylon_url}/health")
    assert (await stack.control())["requests"] == []


async def test_mtls_requires_a_client_certificate_from_the_ca(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(encoding=Encoding.PEM))
    cert, key = write_pair(tmp_path, make_leaf(ca))
    stack = await make_stack(
        "dynamo", tls_cert=str(cert), tls_key=str(key), tls_client_ca=str(ca_file)
    )
    url = https(stack.pylon_url).replace("127.0.0.1", "localhost")
    good = write_pair(tmp_path, make_leaf(ca, name="gateway"), stem="client")
    stranger = write_pair(tmp_path, make_leaf(make_ca("other CA"), name="x"), stem="stranger")
    for http2 in (True, False):
        async with httpx.AsyncClient(
            verify=client_context(ca_file, good), http2=http2, timeout=5
        ) as client:
            reply = await client.post(f"{url}{CHAT}", json=BODY, headers=HEADERS)
            assert reply.status_code == 200
        for bad in (None, stranger):
            async with httpx.AsyncClient(
                verify=client_context(ca_file, bad), http2=http2, timeout=5
            ) as client:
                with pytest.raises(httpx.HTTPError):
                    await client.post(f"{url}{CHAT}", json=BODY, headers=HEADERS)
    assert len((await stack.control())["requests"]) == 2


async def test_reloaded_certificate_serves_new_connections(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(encoding=Encoding.PEM))
    first = make_leaf(ca)
    cert, key = write_pair(tmp_path, first)
    stack = await make_stack(
        "dynamo", tls_cert=str(cert), tls_key=str(key), tls_reload_interval=0.05
    )
    host, port = stack.pylon_address
    assert await _served_fingerprint(host, port, ca_file) == fingerprint(first[0])
    # One identity serves every TLS listener; its reload callback says the new pair is in use.
    reloaded = asyncio.Event()
    stack.identity.on_change(lambda _material: reloaded.set())
    second = make_leaf(ca)
    write_pair(tmp_path, second)
    async with asyncio.timeout(5):
        await reloaded.wait()
    assert stack.identity.current.fingerprint == fingerprint(second[0])
    assert await _served_fingerprint(host, port, ca_file) == fingerprint(second[0])


async def _served_fingerprint(host: str, port: int, ca_file: Path) -> str:
    context = client_context(ca_file)
    context.set_alpn_protocols(["h2"])
    _reader, writer = await asyncio.open_connection(
        host, port, ssl=context, server_hostname="localhost"
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        assert ssl_object.selected_alpn_protocol() == "h2"
        der = ssl_object.getpeercert(binary_form=True)
        return fingerprint(ssl.DER_cert_to_PEM_cert(der).encode())
    finally:
        writer.close()


async def test_tls_without_alpn_still_sniffs_the_preface(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(encoding=Encoding.PEM))
    cert, key = write_pair(tmp_path, make_leaf(ca))
    stack = await make_stack("dynamo", tls_cert=str(cert), tls_key=str(key))
    reader, writer = await asyncio.open_connection(
        *stack.pylon_address, ssl=client_context(ca_file), server_hostname="localhost"
    )
    body = json.dumps(BODY).encode()
    writer.write(
        (
            f"POST {CHAT} HTTP/1.1\r\nhost: localhost\r\nx-request-id: n\r\nx-model: {MODEL}\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    async with asyncio.timeout(5):
        reply = await reader.read()
    writer.close()
    assert reply.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("alpn", ["http/1.1", "h2"])
async def test_silent_tls_client_is_closed_after_the_header_timeout(
    make_stack: StackFactory, tmp_path: Path, alpn: str
) -> None:
    """With ALPN the protocol is chosen at the handshake, before any byte (no sniffing timer):
    the chosen protocol's own clock must end a client that then says nothing."""
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(encoding=Encoding.PEM))
    cert, key = write_pair(tmp_path, make_leaf(ca))
    stack = await make_stack(
        "dynamo", tls_cert=str(cert), tls_key=str(key), header_timeout=0.3, client_idle_timeout=60
    )
    context = client_context(ca_file)
    context.set_alpn_protocols([alpn])
    reader, writer = await asyncio.open_connection(
        *stack.pylon_address, ssl=context, server_hostname="localhost"
    )
    try:
        assert writer.get_extra_info("ssl_object").selected_alpn_protocol() == alpn
        async with asyncio.timeout(3):  # 10x the header timeout; the idle timeout is 60 s
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while await reader.read(65536):
                    pass  # HTTP/2: pylon's SETTINGS, then its GOAWAY
    finally:
        writer.close()

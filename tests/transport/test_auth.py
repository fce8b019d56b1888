"""Tunnel bearer token (`--tunnel-token-file`), checked in the proxy core for every transport."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pylon import auth
from pylon.auth import TokenAuth, TokenFileError
from pylon.logs import configure_logging
from pylon.run import serve
from pylon.settings import load_settings
from pylon.startup import StartupError
from tests.integration.conftest import MODEL, Stack, StackFactory, header_values
from tests.stack import PROTOCOLS

CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOKEN = "s3cret-token-Aa1"


@pytest.fixture(params=["http1", "h2"])
async def client(request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    proto = request.param
    async with httpx.AsyncClient(http1=proto == "http1", http2=proto == "h2", timeout=10) as c:
        yield c


@pytest.fixture
def token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(auth, "RECHECK_SECONDS", 0.0)  # rotation visible at once
    path = tmp_path / "tunnel.token"
    path.write_text(f"  {TOKEN}\n")  # trimmed
    return path


async def post(
    client: httpx.AsyncClient, stack: Stack, authorization: str | None
) -> httpx.Response:
    headers = {"x-request-id": "auth-1", "x-model": MODEL}
    if authorization is not None:
        headers["authorization"] = authorization
    return await client.post(f"{stack.pylon_url}{CHAT}", json=BODY, headers=headers)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer", f"Bearer {TOKEN}x", f"{TOKEN}"],
)
async def test_missing_or_wrong_token_is_401_and_never_forwarded(
    make_stack: StackFactory, client: httpx.AsyncClient, token_file: Path, authorization: str | None
) -> None:
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    reply = await post(client, stack, authorization)
    assert reply.status_code == 401
    assert reply.headers["content-type"] == "application/problem+json"
    problem = reply.json()
    assert problem["code"] == "unauthorized"
    assert problem["request_id"] == "auth-1"
    assert TOKEN not in reply.text
    assert (await stack.control())["requests"] == []


async def test_right_token_passes_and_is_not_forwarded(
    make_stack: StackFactory, client: httpx.AsyncClient, token_file: Path
) -> None:
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    for spelling in (f"Bearer {TOKEN}", f"bearer  {TOKEN}"):
        reply = await post(client, stack, spelling)
        assert reply.status_code == 200, reply.text
        assert header_values(await stack.last_request(), "authorization") == []


async def test_two_authorization_headers_are_refused(
    make_stack: StackFactory, client: httpx.AsyncClient, token_file: Path
) -> None:
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    headers = [
        ("x-request-id", "two"),
        ("x-model", MODEL),
        ("authorization", f"Bearer {TOKEN}"),
        ("authorization", "Bearer engine-key"),
    ]
    reply = await client.post(f"{stack.pylon_url}{CHAT}", json=BODY, headers=headers)
    assert reply.status_code == 401


async def test_rotated_token_file_is_picked_up(
    make_stack: StackFactory, client: httpx.AsyncClient, token_file: Path
) -> None:
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    assert (await post(client, stack, f"Bearer {TOKEN}")).status_code == 200
    # Rotate the way a secret manager does: write a new file, rename it over the old one.
    fresh = token_file.with_suffix(".new")
    fresh.write_text("rotated-token-2\n")
    os.replace(fresh, token_file)
    assert (await post(client, stack, "Bearer rotated-token-2")).status_code == 200
    assert (await post(client, stack, f"Bearer {TOKEN}")).status_code == 401
    # And an in-place rewrite.
    token_file.write_text("rotated-token-3")
    assert (await post(client, stack, "Bearer rotated-token-3")).status_code == 200
    assert (await post(client, stack, "Bearer rotated-token-2")).status_code == 401


async def test_health_needs_no_token(
    make_stack: StackFactory, client: httpx.AsyncClient, token_file: Path
) -> None:
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    reply = await client.get(f"{stack.pylon_url}/health", headers={"authorization": "Bearer x"})
    assert reply.status_code == 200
    assert header_values(await stack.last_request(), "authorization") == []


async def test_without_token_auth_authorization_reaches_the_engine(
    make_stack: StackFactory, client: httpx.AsyncClient
) -> None:
    stack = await make_stack("dynamo")
    reply = await post(client, stack, "Bearer engine-api-key")
    assert reply.status_code == 200
    assert header_values(await stack.last_request(), "authorization") == ["Bearer engine-api-key"]


# --- TokenAuth itself ---


def test_a_broken_rotation_keeps_the_last_good_token(token_file: Path) -> None:
    checker = TokenAuth(token_file)
    good = [(b"authorization", f"Bearer {TOKEN}".encode())]
    token_file.write_text("")  # truncated mid-rotation
    assert checker.allows(good)
    token_file.unlink()
    assert checker.allows(good)
    token_file.write_text("next")
    assert not checker.allows(good)
    assert checker.allows([(b"Authorization", b"Bearer next")])


@pytest.mark.parametrize("content", [None, "", "   \n", "two\nlines"])
def test_unusable_token_file_fails_at_start(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenFileError):
        TokenAuth(path)


def test_token_never_logged_nor_shown_by_config(
    token_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("json", "debug")
    checker = TokenAuth(token_file)
    token_file.write_text("another-secret")
    checker.allows([(b"authorization", b"Bearer nope")])
    token_file.write_text("")
    checker.allows([(b"authorization", b"Bearer nope")])
    logged = capsys.readouterr().err
    assert "tunnel_token_rotated" in logged
    assert TOKEN not in logged and "another-secret" not in logged
    shown: dict[str, Any] = load_settings({"tunnel_token_file": str(token_file)}).redacted()
    assert shown["tunnel_token_file"] == str(token_file)
    assert TOKEN not in orjson.dumps(shown).decode()
    configure_logging("json", "warning")


async def test_serve_refuses_to_start_without_a_usable_token_file(tmp_path: Path) -> None:
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "upstream": "http://127.0.0.1:9",
            "tunnel_token_file": str(tmp_path / "missing"),
        }
    )
    with pytest.raises(StartupError, match=r"--tunnel-token-file .*missing: no such file"):
        await asyncio.wait_for(serve(settings, handle_signals=False), 5)


async def test_unauthenticated_request_is_refused_before_its_body(
    make_stack: StackFactory, token_file: Path
) -> None:
    """A client without the token cannot make pylon read (and buffer) a large body."""
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            (
                f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: big-anon\r\nx-model: {MODEL}\r\n"
                "content-type: application/json\r\ncontent-length: 50000000\r\n\r\n"
            ).encode()
        )
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 ")
    finally:
        writer.close()
    assert (await stack.control())["requests"] == []


@pytest.mark.parametrize(
    "authorization",
    # Seven characters before the token, like "Bearer ": only the scheme tells them apart.
    [f"Basic  {TOKEN}", f"Digest {TOKEN}", f"Bearer:{TOKEN}", f"xxxxxxx{TOKEN}"],
)
def test_token_under_another_scheme_is_refused(token_file: Path, authorization: str) -> None:
    checker = TokenAuth(token_file)
    assert checker.allows([(b"authorization", f"Bearer {TOKEN}".encode())])
    assert not checker.allows([(b"authorization", authorization.encode())])


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_only_get_and_head_of_exactly_health_skip_the_token(
    make_stack: StackFactory, token_file: Path, protocol: str
) -> None:
    """`/health` is the one unauthenticated route: another method or a longer path is a tunnel
    request like any other, and needs the token."""
    stack = await make_stack("dynamo", tunnel_token_file=str(token_file))
    headers = [("x-request-id", "health-1"), ("x-model", MODEL)]
    # (aioquic's HTTP/3 client reads a HEAD response's content-length as a body it must get.)
    probes = ("GET", "HEAD") if protocol != "h3" else ("GET",)
    for method in probes:
        reply = await stack.send(protocol, "/health?probe=1", headers, b"", method=method)
        assert reply.status == 200, (method, reply.status)
    body = orjson.dumps(BODY)
    for method, path in [
        ("POST", "/health"),
        ("PUT", "/health"),
        ("GET", "/healthz"),
        ("GET", "/health/"),
    ]:
        reply = await stack.send(protocol, path, headers, body if method != "GET" else b"", method)
        assert reply.status == 401, (method, path, reply.status)
        assert reply.json()["code"] == "unauthorized"
    assert [record["path"] for record in await stack.records()] == ["/health"] * len(probes)


def test_a_broken_token_file_is_told_once_not_at_every_check(
    token_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file is checked at most every RECHECK_SECONDS (0 here: at every request): a file
    left empty writes one `tunnel_token_unusable` line, not one per check (3,600 an hour)."""
    configure_logging("json", "warning")
    checker = TokenAuth(token_file)
    good = [(b"authorization", f"Bearer {TOKEN}".encode())]
    token_file.write_text("")
    for _ in range(1_000):
        assert checker.allows(good)
    assert capsys.readouterr().err.count("tunnel_token_unusable") == 1
    token_file.write_text("two\nlines")  # broken another way: a change, told again
    assert checker.allows(good)
    assert capsys.readouterr().err.count("tunnel_token_unusable") == 1
    token_file.write_text("next")
    assert checker.allows([(b"authorization", b"Bearer next")])

"""One contract suite, the same cases over HTTP/1.1, HTTP/2 (h2c) and HTTP/3, through one pylon.

A single pylon process-in-the-loop serves TCP (HTTP/1.1 and h2c on one port) and QUIC; every case
below runs once per protocol and asserts on what reached mock_dynamo's /test-control.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aioquic.asyncio.client import connect

from mock_dynamo.config import MockConfig
from mock_dynamo.server import MockServer, start_mock
from pylon.app import serve
from pylon.core.sanitize import DENIED_BODY_FIELDS, DENIED_REQUEST_HEADERS
from pylon.logs import configure_logging
from pylon.settings import load_settings
from tests.integration.conftest import FLAVOR, MODEL
from tests.integration.test_forwarding import spoofed_body, spoofed_headers
from tests.transport.conftest_h3 import H3Client, client_configuration, request_headers

CHAT = "/v1/chat/completions"
PROTOCOLS = ["http1", "h2", "h3"]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Pylon:
    tcp: str
    quic: tuple[str, int]
    mock: MockServer
    http: httpx.AsyncClient

    async def send(
        self,
        protocol: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        method: str = "POST",
    ) -> Reply:
        if protocol == "h3":
            return await self._send_h3(path, headers, body, method)
        async with httpx.AsyncClient(
            http1=protocol == "http1", http2=protocol == "h2", timeout=10
        ) as client:
            reply = await client.request(
                method, f"http://{self.tcp}{path}", headers=headers, content=body
            )
            assert reply.http_version == {"http1": "HTTP/1.1", "h2": "HTTP/2"}[protocol]
            return Reply(reply.status_code, dict(reply.headers), reply.content)

    async def _send_h3(
        self, path: str, headers: list[tuple[str, str]], body: bytes, method: str
    ) -> Reply:
        async with (
            asyncio.timeout(10),
            connect(
                *self.quic,
                configuration=client_configuration(),
                create_protocol=H3Client,
                wait_connected=True,
            ) as client,
        ):
            assert isinstance(client, H3Client)
            wire = request_headers(method, path, [(n.lower(), v) for n, v in headers], body)
            response = await client.send(wire, body).wait(10)
            names = {
                name.decode(): value.decode()
                for name, value in response.headers
                if not name.startswith(b":")
            }
            return Reply(response.status, names, response.body)

    async def records(self) -> list[dict[str, Any]]:
        reply = await self.http.get(f"{self.mock.base_url}/test-control")
        requests: list[dict[str, Any]] = reply.json()["requests"]
        return requests


PylonFactory = Callable[..., Any]


@pytest.fixture
async def pylon() -> AsyncIterator[PylonFactory]:
    configure_logging("json", "warning")
    cleanups: list[Any] = []

    async def factory(backend: str = "dynamo", **settings: Any) -> Pylon:
        engine = await start_mock(MockConfig(flavor=FLAVOR[backend], models=(MODEL,)))  # type: ignore[arg-type]
        cleanups.append(engine.stop)
        config = load_settings(
            {
                "listen": "127.0.0.1:0",
                "quic_listen": "127.0.0.1:0",
                "upstream": engine.base_url,
                "backend": backend,
                "log_level": "warning",
                **settings,
            }
        )
        loop = asyncio.get_running_loop()
        tcp: asyncio.Future[str] = loop.create_future()
        quic: asyncio.Future[str] = loop.create_future()
        stop = asyncio.Event()
        task = asyncio.create_task(
            serve(
                config,
                on_ready=tcp.set_result,
                on_quic_ready=quic.set_result,
                stop=stop,
                handle_signals=False,
            )
        )

        async def stop_pylon() -> None:
            stop.set()
            await asyncio.wait_for(task, 10)

        cleanups.append(stop_pylon)
        tcp_address = await asyncio.wait_for(tcp, 10)
        quic_host, quic_port = (await asyncio.wait_for(quic, 10)).rsplit(":", 1)
        http = httpx.AsyncClient(timeout=5)
        cleanups.append(http.aclose)
        return Pylon(tcp_address, (quic_host, int(quic_port)), engine, http)

    yield factory
    for cleanup in reversed(cleanups):
        await cleanup()


def chat(**extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return json.dumps({**body, **extra}).encode()


def tunnel(**extra: str) -> list[tuple[str, str]]:
    return [("x-request-id", "req-1"), ("x-model", MODEL), *extra.items()]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
async def test_spoofed_controls_never_reach_the_engine(
    pylon: PylonFactory, protocol: str, backend: str
) -> None:
    stack = await pylon(backend)
    # HTTP/2 and HTTP/3 forbid upper-case names on the wire; case variety is HTTP/1.1's.
    headers = [(n.lower() if protocol != "http1" else n, v) for n, v in spoofed_headers()]
    reply = await stack.send(protocol, CHAT, headers, json.dumps(spoofed_body(backend)).encode())
    assert reply.status == 200, reply.body
    record = (await stack.records())[-1]
    names = [name.lower() for name, _ in record["headers"]]
    assert not {n.decode() for n in DENIED_REQUEST_HEADERS} & set(names)
    assert not [n for n in names if n.startswith(("x-stargate-", "x-smg-", "x-override-"))]
    dynamo = sorted(n for n in names if n.startswith("x-dynamo-"))
    body = record["body"]
    assert not (set(DENIED_BODY_FIELDS) - {"priority"}) & set(body)
    assert body["seed"] == 2**70
    if backend == "dynamo":
        assert dynamo == ["x-dynamo-request-priority", "x-dynamo-request-strict-priority"]
        priority = [v for n, v in record["headers"] if n.lower() == "x-dynamo-request-priority"]
        assert priority == ["3593"]
    else:
        assert dynamo == []
    expected_body_priority = {"vllm": 7, "sglang": 3593}.get(backend)
    assert body.get("priority") == expected_body_priority


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ([("x-model", MODEL)], chat(), 400, "missing_request_id"),
        ([("x-request-id", "r")], chat(), 400, "missing_model"),
        (tunnel(**{"x-priority": "-1"}), chat(), 400, "invalid_priority"),
        (tunnel(**{"x-priority": "4294967296"}), chat(), 400, "invalid_priority"),
        (tunnel(**{"x-input-tokens": "x"}), chat(), 400, "invalid_input_tokens"),
        (tunnel(), b"[1]", 400, "body_not_json_object"),
        (tunnel(), b"{", 400, "body_not_json_object"),
        (tunnel(), b'{"nvext": []}', 400, "body_not_json_object"),
    ],
)
async def test_bad_input_gets_a_problem_and_never_reaches_the_engine(
    pylon: PylonFactory,
    protocol: str,
    headers: list[tuple[str, str]],
    body: bytes,
    status: int,
    code: str,
) -> None:
    stack = await pylon()
    reply = await stack.send(protocol, CHAT, headers, body)
    assert reply.status == status
    assert reply.headers["content-type"] == "application/problem+json"
    problem = reply.json()
    assert (problem["status"], problem["code"]) == (status, code)
    assert await stack.records() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_body_limit_is_413(pylon: PylonFactory, protocol: str) -> None:
    stack = await pylon(max_body_bytes=1000)
    reply = await stack.send(protocol, CHAT, tunnel(), chat(pad="x" * 2000))
    assert reply.status == 413
    assert reply.json()["code"] == "body_too_large"
    assert await stack.records() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_sse_reaches_the_client_whole(pylon: PylonFactory, protocol: str) -> None:
    stack = await pylon()
    reply = await stack.send(protocol, CHAT, tunnel(), chat(stream=True, max_tokens=6))
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert all(e.startswith(b"data: ") for e in events)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_health_bypasses_the_contract(pylon: PylonFactory, protocol: str) -> None:
    stack = await pylon()
    reply = await stack.send(protocol, "/health", [], b"", method="GET")
    assert reply.status == 200
    assert (await stack.records())[-1]["path"] == "/health"

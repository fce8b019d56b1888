"""The one test stack: a real mock_dynamo and a real pylon, started through `pylon.run.start`
(the same wiring `pylon serve` runs), on 127.0.0.1 ephemeral ports, in the test's event loop.

Every stack listens on TCP (HTTP/1.1 and HTTP/2) and, unless `quic_listen=None` is passed, on
QUIC (HTTP/3), so one fixture serves every transport test.

Bring-up (`pylon.bringup`) runs as in production: the health gate probes the mock's `/health`,
discovery polls its `/v1/models` once (then hourly, unless the test sets
`model_discovery_interval`, so no poll lands in the middle of a test). By default the factory
returns once pylon is ready and the mock's records of those probes are reset, so a test sees
only its own requests; `wait_ready=False` returns at once (bring-up still running), and
`engine_controls` (`{"health": {...}, "models": {...}, "faults": [...]}`) are PUT to the mock's
`/test-control/<name>` before pylon starts (its records are then kept: they show the probes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from aioquic.asyncio.client import connect
from aioquic.quic.configuration import QuicConfiguration

from mock_dynamo.server import MockConfig, MockServer, start_mock
from pylon.logs import configure_logging
from pylon.observe import Observer
from pylon.routing import Router
from pylon.run import Running, start
from pylon.server.http3 import Http3Server
from pylon.settings import Settings, load_settings
from pylon.tls import TlsIdentity
from tests.cancellation import wait_for_record
from tests.h3client import H3Client, client_configuration, request_headers

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

FLAVOR = {"dynamo": "dynamo", "passthrough": "dynamo", "vllm": "vllm", "sglang": "sglang"}
MODEL = "mock-model"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    fields: list[tuple[str, str]] = field(default_factory=list)  # every header, in order

    def json(self) -> Any:
        return json.loads(self.body)

    def values(self, name: str) -> list[str]:
        """Every value of header `name` (lower-case), duplicates kept."""
        return [value for key, value in self.fields if key.lower() == name]


PROTOCOLS = ("http1", "h2", "h3")
# For an engine that serves neither a health path nor a model list (a scripted engine, a dead
# port): no health gate, and the one model the tests ask for, published statically.
NO_BRINGUP: dict[str, Any] = {"upstream_health_gate": False, "model": [MODEL]}


@dataclass
class Stack:
    running: Running
    mock: MockServer
    client: httpx.AsyncClient  # HTTP/1.1, for pylon and for mock_dynamo's /test-control
    settings: Settings

    # --- TCP (HTTP/1.1, HTTP/2) ---
    @property
    def pylon_url(self) -> str:
        return self.running.url

    @property
    def pylon_address(self) -> tuple[str, int]:
        host, port = self.running.address.rsplit(":", 1)
        return host, int(port)

    async def post(self, path: str, body: Any, headers: Any = None, **kw: Any) -> httpx.Response:
        merged = {"x-request-id": "req-1", "x-model": MODEL}
        if headers is not None:
            merged = headers if isinstance(headers, list) else {**merged, **headers}
        return await self.client.post(f"{self.pylon_url}{path}", json=body, headers=merged, **kw)

    # --- QUIC (HTTP/3) ---
    @property
    def server(self) -> Http3Server:
        assert self.running.listeners.h3 is not None, "this stack has no QUIC listener"
        return self.running.listeners.h3

    @property
    def identity(self) -> TlsIdentity:
        return self.server.identity

    @property
    def host(self) -> str:
        assert self.running.quic_address is not None
        return self.running.quic_address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        assert self.running.quic_address is not None
        return int(self.running.quic_address.rsplit(":", 1)[1])

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

    # --- any transport ---
    async def send(
        self,
        protocol: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        method: str = "POST",
    ) -> Reply:
        """One request over `protocol` ("http1", "h2" or "h3"), on a fresh connection."""
        if protocol == "h3":
            return await self._send_h3(path, headers, body, method)
        async with httpx.AsyncClient(
            http1=protocol == "http1", http2=protocol == "h2", timeout=10
        ) as client:
            reply = await client.request(
                method, f"{self.pylon_url}{path}", headers=headers, content=body
            )
            assert reply.http_version == {"http1": "HTTP/1.1", "h2": "HTTP/2"}[protocol]
            fields = list(reply.headers.multi_items())
            return Reply(reply.status_code, dict(reply.headers), reply.content, fields)

    async def _send_h3(
        self, path: str, headers: list[tuple[str, str]], body: bytes, method: str
    ) -> Reply:
        async with self.connect() as client:
            wire = request_headers(method, path, [(n.lower(), v) for n, v in headers], body)
            response = await client.send(wire, body).wait(10)
            fields = [
                (name.decode(), value.decode())
                for name, value in response.headers
                if not name.startswith(b":")
            ]
            return Reply(response.status or 0, dict(fields), response.body, fields)

    async def records(self) -> list[dict[str, Any]]:
        requests: list[dict[str, Any]] = (await self.control())["requests"]
        return requests

    # --- the process ---
    def drain(self) -> None:
        """Start the graceful stop (what SIGTERM does): GOAWAY, no new requests."""
        self.running.core.lifecycle.drain()

    # --- mock_dynamo's /test-control ---
    @property
    def http(self) -> httpx.AsyncClient:
        return self.client

    async def control(self) -> dict[str, Any]:
        reply = await self.client.get(f"{self.mock.base_url}/test-control")
        reply.raise_for_status()
        data: dict[str, Any] = reply.json()
        return data

    async def last_request(self) -> dict[str, Any]:
        requests = (await self.control())["requests"]
        assert requests, "nothing reached the engine"
        last: dict[str, Any] = requests[-1]
        return last

    async def wait_record(
        self, request_id: str, event: str = "finished", timeout: float = 5.0
    ) -> dict[str, Any]:
        """The engine's record of `request_id` once `event` happened (a long-poll, no polling)."""
        return await wait_for_record(self.client, self.mock.base_url, request_id, event, timeout)

    async def faults(self, faults: list[dict[str, Any]]) -> None:
        reply = await self.client.put(f"{self.mock.base_url}/test-control/faults", json=faults)
        reply.raise_for_status()

    async def knobs(self, **knobs: Any) -> None:
        reply = await self.client.put(f"{self.mock.base_url}/test-control/knobs", json=knobs)
        reply.raise_for_status()


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    """Start mock_dynamo and pylon with the given settings; everything stops at teardown.

    `span_exporter`: trace every engine exchange into it (see `pylon.assemble.build_core`)."""
    configure_logging("json", "warning")
    async with contextlib.AsyncExitStack() as exits:

        async def factory(
            backend: str = "dynamo",
            mock: dict[str, Any] | None = None,
            observer: Observer | None = None,
            router: Router | None = None,
            span_exporter: SpanExporter | None = None,
            wait_ready: bool = True,
            engine_controls: dict[str, Any] | None = None,
            **settings: Any,
        ) -> Stack:
            engine = await start_mock(
                MockConfig(flavor=FLAVOR[backend], models=(MODEL,), **(mock or {})),  # type: ignore[arg-type]
                host="127.0.0.1",
                port=0,
            )
            exits.push_async_callback(engine.stop)
            client = httpx.AsyncClient(timeout=10)
            exits.push_async_callback(client.aclose)
            for name, value in (engine_controls or {}).items():
                reply = await client.put(f"{engine.base_url}/test-control/{name}", json=value)
                reply.raise_for_status()
            defaults: dict[str, Any] = {
                "listen": "127.0.0.1:0",
                "quic_listen": "127.0.0.1:0",
                "admin_listen": "127.0.0.1:0",  # never the fixed default port in tests
                "upstream": engine.base_url,
                "backend": backend,
                "log_level": "warning",
            }
            if "model" not in settings:
                defaults["model_discovery_interval"] = 3600.0
            if (
                settings.get("upstream_health_gate", True)
                and settings.get("routing", "off") == "off"
            ):
                # The engine's health checks after start-up are pylon's, not the test's: none
                # unless a test asks (records that list what reached the engine stay exact).
                defaults["upstream_health_check_interval"] = 3600.0
            config = load_settings({**defaults, **settings})
            running = await exits.enter_async_context(
                start(config, observer, router, span_exporter, wait_ready=wait_ready)
            )
            if wait_ready and engine_controls is None:
                # The gate's and discovery's requests are pylon's, not the test's.
                reply = await client.post(f"{engine.base_url}/test-control/reset")
                reply.raise_for_status()
            return Stack(running, engine, client, config)

        yield factory

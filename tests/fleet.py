"""Several real mock_dynamo workers behind one real pylon with `--routing` on (`make_fleet`).

Like `tests/stack.py` (`make_stack`): everything on 127.0.0.1 ephemeral ports, started through
`pylon.run.start`, in the test's event loop. Each worker is a mock_dynamo of its own, given to
pylon as `--worker url=<its URL>` (with `kv=True`: its KV-event socket as `kv-events=`, a
prefix cache and the block size), or, with `instance_ids`, one mock plays the Dynamo frontend
and the workers are `instance-id=` workers behind it.

Health checks run at start (bring-up waits for them); afterwards only every hour unless the
test sets `worker_health_interval`, so no probe lands in the middle of a test by surprise. The
mocks' records of bring-up are reset before the test gets the fleet. `FleetStack.observer`
keeps every process event and counts finished requests, so a test waits on events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from mock_dynamo.server import MockConfig, MockServer, start_mock
from mock_dynamo.tokens import WordTokenizer, prompts
from pylon.assemble import routing_options
from pylon.core.record import RequestRecord
from pylon.logs import configure_logging
from pylon.routing.build import Routing, RoutingOptions, build_routing
from pylon.run import Running, start
from pylon.settings import Settings, load_settings
from router_ffi._native import NativeFactory
from tests.cancellation import wait_for_record
from tests.observers import EventObserver
from tests.stack import MODEL

INFERENCE_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"}
)


class WordPrompts:
    """The fake `Tokenizer` for routing tests: mock_dynamo's own word tokenizer (each word one
    token, `crc32` ids), so pylon's block hashes match the mock's KV events exactly."""

    def __init__(self) -> None:
        self.calls = 0
        self._endpoints = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        self.calls += 1
        endpoint = self._endpoints.get(path)
        if endpoint is None:
            return None
        try:
            found = prompts(WordTokenizer(), endpoint, json.loads(body))
        except ValueError:
            return None
        return found[0] if len(found) == 1 else None


class RoutingObserver(EventObserver):
    """Process events (`wait_for`) and the finished requests, by request id (`wait_done`)."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: dict[str | None, RequestRecord] = {}
        self._done = asyncio.Event()

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.finished[record.request_id] = record
        self._done.set()

    async def wait_done(self, count: int, timeout: float = 10.0) -> None:
        """Until `count` requests have finished in pylon (bookings released, engine
        connection returned or closed)."""
        async with asyncio.timeout(timeout):
            while len(self.finished) < count:
                self._done.clear()
                await self._done.wait()


def workers_toml(specs: Sequence[str]) -> str:
    """`--worker` SPECs as the `[[worker]]` tables of a workers file."""
    tables = []
    for spec in specs:
        lines = ["[[worker]]"]
        events = []
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key == "kv-events":
                events.append(value)
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        if events:
            lines.append(f"kv-events = {json.dumps(events)}")
        tables.append("\n".join(lines))
    return "\n\n".join(tables) + "\n"


@dataclass
class FleetStack:
    running: Running
    mocks: list[MockServer]
    client: httpx.AsyncClient
    settings: Settings
    observer: RoutingObserver
    specs: list[str] = field(default_factory=list)  # each mock's SPEC, in mock order
    workers_file: Path | None = None

    def write_workers(self, indices: Sequence[int], text: str | None = None) -> None:
        """Rewrite the workers file: the specs of mocks `indices` (or `text` as it is)."""
        assert self.workers_file is not None, "make_fleet(workers_file=...) was not given"
        if text is None:
            text = workers_toml([self.specs[index] for index in indices])
        staged = self.workers_file.with_suffix(".new")
        staged.write_text(text)
        staged.replace(self.workers_file)  # as a deployment does: never a half-written file

    @property
    def routing(self) -> Routing:
        assert self.running.routing is not None
        return self.running.routing

    @property
    def url(self) -> str:
        return self.running.url

    def label(self, index: int) -> str:
        return self.routing.fleet.workers[index].label

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None, **kw: Any
    ) -> httpx.Response:
        merged = {"x-request-id": "req-1", "x-model": MODEL, **(headers or {})}
        return await self.client.post(f"{self.url}{path}", json=body, headers=merged, **kw)

    async def control(self, index: int, name: str, value: Any) -> None:
        """PUT mock `index`'s `/test-control/<name>` (faults, knobs, health, models)."""
        reply = await self.client.put(
            f"{self.mocks[index].base_url}/test-control/{name}", json=value
        )
        reply.raise_for_status()

    async def inference_records(self, index: int) -> list[dict[str, Any]]:
        """What reached mock `index` on the inference routes (health probes left out)."""
        reply = await self.client.get(f"{self.mocks[index].base_url}/test-control")
        reply.raise_for_status()
        return [r for r in reply.json()["requests"] if r["path"] in INFERENCE_PATHS]

    async def served_by(self, request_id: str) -> int:
        """Which mock received `request_id` (exactly one must have)."""
        found = [
            index
            for index in range(len(self.mocks))
            if any(
                value == request_id
                for record in await self.inference_records(index)
                for name, value in record["headers"]
                if name.lower() == "x-request-id"
            )
        ]
        assert len(found) == 1, f"{request_id} reached mocks {found}"
        return found[0]

    async def wait_record(self, index: int, request_id: str, event: str) -> dict[str, Any]:
        return await wait_for_record(self.client, self.mocks[index].base_url, request_id, event)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The admin listener's /metrics: {(sample name, sorted labels): value}."""
        from prometheus_client.parser import text_string_to_metric_families

        assert self.running.admin_url is not None, "the admin listener is off"
        reply = await self.client.get(f"{self.running.admin_url}/metrics")
        reply.raise_for_status()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(reply.text)
            for sample in family.samples
        }

    def connections_in_use(self) -> dict[str, int]:
        """Engine connections open and not idle in pylon's pool, per worker target."""
        pool = self.running.core.pool
        return {
            worker.label: pool.open_connections(worker.upstream)
            - pool.idle_connections(worker.upstream)
            for worker in self.routing.fleet.workers
        }


FleetFactory = Callable[..., Awaitable[FleetStack]]


@pytest.fixture
async def make_fleet() -> AsyncIterator[FleetFactory]:
    configure_logging("json", "warning")
    async with contextlib.AsyncExitStack() as exits:

        async def factory(
            workers: int = 3,
            routing: str = "round-robin",
            mock: dict[str, Any] | None = None,
            kv_block_size: int | None = None,
            instance_ids: list[int] | None = None,
            tokenizer: WordPrompts | None = None,
            wait_ready: bool = True,
            engine_controls: dict[int, dict[str, Any]] | None = None,
            native: NativeFactory | None = None,
            workers_file: Path | None = None,
            in_catalogue: Sequence[int] | None = None,
            authority: Callable[[RoutingOptions], Awaitable[Path]] | None = None,
            **settings: Any,
        ) -> FleetStack:
            """`engine_controls`: {mock index: {name: value}} PUT to the mock's
            `/test-control/<name>` before pylon starts (its records are then kept).
            `native`: for `kv`, a stand-in for Dynamo's native selection service (without
            it, the real one: the test needs the `dynamo` marker); the workers then get a
            placeholder `kv-events=` each unless `kv_block_size` gives them real ones.
            `workers_file`: the catalogue goes there (`--workers-file`) instead of `--worker`,
            holding the mocks `in_catalogue` (default all); `FleetStack.write_workers`
            rewrites it.
            `authority`: starts a booking authority for the fleet's routing options and returns
            its socket; pylon's router then books there (`build_routing(..., authority=)`)."""
            config: dict[str, Any] = {"models": (MODEL,), **(mock or {})}
            if kv_block_size is not None:
                config.update(
                    kv_block_size=kv_block_size,
                    kv_cache_blocks=config.get("kv_cache_blocks", 1024),
                    kv_events_port=0,
                    kv_events_encoding=config.get("kv_events_encoding", "array"),
                )
            count = 1 if instance_ids is not None else workers
            mocks = []
            for _ in range(count):
                engine = await start_mock(MockConfig(**config), host="127.0.0.1", port=0)
                exits.push_async_callback(engine.stop)
                mocks.append(engine)
            client = httpx.AsyncClient(timeout=10)
            exits.push_async_callback(client.aclose)
            for index, controls in (engine_controls or {}).items():
                for name, value in controls.items():
                    reply = await client.put(
                        f"{mocks[index].base_url}/test-control/{name}", json=value
                    )
                    reply.raise_for_status()
            if instance_ids is not None:
                specs = [f"instance-id={wid}" for wid in instance_ids]
                if routing == "kv":
                    specs = [f"{spec},kv-events=tcp://127.0.0.1:9" for spec in specs]
                upstream: str | None = mocks[0].base_url
            else:
                specs = []
                for engine in mocks:
                    spec = f"url={engine.base_url}"
                    if kv_block_size is not None:
                        spec += f",kv-events={engine.kv_events_endpoint},block-size={kv_block_size}"
                    elif routing == "kv":
                        spec += ",kv-events=tcp://127.0.0.1:9"  # read by the stand-in: no one
                    specs.append(spec)
                upstream = None
            catalogue: dict[str, Any] = {"worker": specs}
            if workers_file is not None:
                chosen = range(len(specs)) if in_catalogue is None else in_catalogue
                workers_file.write_text(workers_toml([specs[index] for index in chosen]))
                catalogue = {"workers_file": workers_file}
            defaults: dict[str, Any] = {
                "listen": "127.0.0.1:0",
                "upstream": upstream,
                "routing": routing,
                **catalogue,
                "log_level": "warning",
                "worker_health_interval": 3600.0,
                "worker_health_timeout": 2.0,
            }
            if "model" not in settings:
                defaults["model_discovery_interval"] = 3600.0
            if routing == "kv" and "tokenizer" not in settings:
                defaults["tokenizer"] = "/"  # loaded by no one: the fake is injected
            built = load_settings({**defaults, **settings})
            observer = RoutingObserver()
            options = routing_options(built)
            parts = await build_routing(
                options,
                observer,
                tokenizer=tokenizer or (WordPrompts() if routing == "kv" else None),
                native=native,
                authority=await authority(options) if authority is not None else None,
            )
            running = await exits.enter_async_context(
                start(built, observer, wait_ready=wait_ready, routing=parts)
            )
            if wait_ready and engine_controls is None:
                for engine in mocks:  # bring-up's probes are pylon's, not the test's
                    reply = await client.post(f"{engine.base_url}/test-control/reset")
                    reply.raise_for_status()
            if routing == "kv" and kv_block_size is not None:
                # Every SUB hears every event from now on: pylon's sequence watch, and the real
                # selection core's own (a stand-in subscribes to nothing).
                subscribers = "1" if native is not None else "2"
                for index, engine in enumerate(mocks):
                    if workers_file is not None and index not in (in_catalogue or range(count)):
                        continue  # not followed (yet)
                    reply = await client.get(
                        f"{engine.base_url}/test-control/kv",
                        params={"wait_subscribers": subscribers, "timeout": "10"},
                        timeout=15,
                    )
                    reply.raise_for_status()
            return FleetStack(running, mocks, client, built, observer, specs, workers_file)

        yield factory


async def mixed_load(fleet: FleetStack, path: str = "/v1/chat/completions") -> int:
    """A mixed load over the fleet's workers (at least 3) with every way an exchange can end
    early; returns how many requests were sent (each ends in pylon: wait for them).

    Phase 1, 24 concurrent streams: worker 0 drops 3 streams mid-way, worker 1 holds 2 back
    before any output (pylon's first-output timeout; keep it short), worker 2 sends 2 malformed
    events; every 6th client leaves after its first bytes. Phase 2, 12 concurrent whole
    answers: worker 0 answers 503 twice, worker 1 cuts 2 bodies in half, worker 2 holds one
    back until the client's own timeout (1 s) makes it leave.
    """
    await fleet.control(0, "faults", [{"drop_after_events": 2, "times": 3}])
    await fleet.control(1, "faults", [{"stall_after_events": 0, "times": 2}])
    await fleet.control(2, "faults", [{"malformed_event": True, "times": 2}])

    def body(n: int, stream: bool) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"prompt {n % 4} with some words"}],
            "max_tokens": 200,
            "stream": stream,
        }

    async def stream(n: int) -> None:
        headers = {"x-request-id": f"load-{n}", "x-model": MODEL}
        async with fleet.client.stream(
            "POST", f"{fleet.url}{path}", json=body(n, True), headers=headers
        ) as reply:
            async for _ in reply.aiter_bytes():
                if n % 6 == 5:
                    break  # the client leaves

    async def whole(n: int) -> None:
        headers = {"x-request-id": f"load-{n}", "x-model": MODEL}
        try:
            reply = await fleet.client.post(
                f"{fleet.url}{path}", json=body(n, False), headers=headers, timeout=1.0
            )
        except (httpx.RemoteProtocolError, httpx.ReadTimeout):
            return  # cut after its head (pylon can only close), or the client gave up
        assert reply.status_code in (200, 503)

    await asyncio.gather(*(stream(n) for n in range(24)))
    await fleet.control(0, "faults", [{"status": 503, "times": 2}])
    await fleet.control(1, "faults", [{"drop_after_events": 1, "times": 2}])
    await fleet.control(2, "faults", [{"stall_after_events": 0, "times": 1}])
    await asyncio.gather(*(whole(n) for n in range(24, 36)))
    return 36

"""The worker catalogue changes while pylon serves (`--workers-file`): real mock workers behind a
real pylon; the file is rewritten as a deployment does, and pylon follows (its watch, or the
SIGHUP reload `Running.reload`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pylon.assemble import routing_options
from pylon.routing.build import build_routing
from pylon.routing.spec import catalogue_digest, parse_worker_spec
from pylon.settings import SettingsError, load_settings
from pylon.startup import StartupError
from tests.fleet import FleetFactory, FleetStack, RoutingObserver
from tests.router_ffi.fake_native import FakeNative
from tests.stack import MODEL


def chat(n: int, stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"prompt number {n}"}],
        "max_tokens": 8,
        "stream": stream,
    }


async def workers_listing(fleet: FleetStack) -> dict[str, object]:
    assert fleet.running.admin_url is not None
    reply = await fleet.client.get(f"{fleet.running.admin_url}/workers")
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/json"
    listing: dict[str, object] = reply.json()
    return listing


async def served(fleet: FleetStack, count: int, tag: str) -> list[int]:
    """Send `count` whole requests one after another; which mock served each."""
    served = []
    for n in range(count):
        request_id = f"{tag}-{n}"
        reply = await fleet.post("/v1/chat/completions", chat(n), {"x-request-id": request_id})
        assert reply.status_code == 200, reply.text
        served.append(await fleet.served_by(request_id))
    return served


async def test_a_rewritten_file_adds_and_removes_workers_while_a_stream_finishes(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    fleet = await make_fleet(
        workers=3,
        routing="least-loaded",
        workers_file=tmp_path / "workers.toml",
        in_catalogue=[0, 1],
        mock={"num_tokens": 30, "token_delay_ms": 5},
        admin_listen="127.0.0.1:0",
    )
    routing = fleet.routing
    assert [w.label for w in routing.fleet.workers] == [
        fleet.mocks[0].base_url,
        fleet.mocks[1].base_url,
    ]
    before = await workers_listing(fleet)
    assert before["catalogue_source"] == f"file {fleet.workers_file}"
    assert before["catalogue_digest"] == routing.fleet.digest

    headers = {"x-request-id": "long", "x-model": MODEL}
    async with fleet.client.stream(
        "POST", f"{fleet.url}/v1/chat/completions", json=chat(0, True), headers=headers
    ) as stream:
        chunks = stream.aiter_bytes()
        first = await anext(chunks)
        assert first
        gone = await fleet.served_by("long")  # the mock carrying the stream leaves
        stays = 1 - gone
        assert routing.fleet.active == 1
        mark = fleet.observer.mark()
        fleet.write_workers([stays, 2])
        assert fleet.running.reload() == {}  # what SIGHUP does
        reloaded = await fleet.observer.wait_for("workers_reloaded", after=mark)
        assert reloaded["removed"] == [fleet.mocks[gone].base_url]
        assert reloaded["added"] == [fleet.mocks[2].base_url]
        assert reloaded["kept"] == 1
        new_specs = [parse_worker_spec(fleet.specs[i]) for i in (stays, 2)]
        assert reloaded["catalogue_digest"] == catalogue_digest(new_specs)
        line = fleet.observer.of("reloaded", after=mark)[-1]
        assert "workers" in line["reloaded"] and line["workers"] == "changed"
        assert routing.fleet.active == 0  # the removed worker's booking left the load view
        # The added worker enters rotation once its health check passes (checked at once).
        await fleet.observer.wait_for("worker_admitted", after=mark, worker=fleet.mocks[2].base_url)
        listing = await workers_listing(fleet)
        workers = listing["workers"]
        assert isinstance(workers, list)
        assert [w["label"] for w in workers] == [fleet.mocks[i].base_url for i in (stays, 2)]
        assert all(w["in_rotation"] and w["active"] == 0 for w in workers)
        assert workers[1]["health"]["passing"] and workers[1]["health"]["last_result"] == "ok"
        assert workers[1]["spec"] == parse_worker_spec(fleet.specs[2]).text()
        assert listing["catalogue_digest"] == reloaded["catalogue_digest"]
        # New requests go to the two in the catalogue, never to the removed one.
        assert sorted(set(await served(fleet, 6, "after"))) == sorted([stays, 2])
        metrics = await fleet.metrics()
        labels = {dict(labels).get("worker") for (name, labels) in metrics if "worker" in name}
        assert fleet.mocks[gone].base_url not in labels
        reloads = "pylon_router_catalogue_reloads_total"
        assert metrics[(reloads, (("result", "changed"),))] == 1
        assert metrics[(reloads, (("result", "refused"),))] == 0
        rest = b"".join([chunk async for chunk in chunks])
    assert stream.status_code == 200
    assert (first + rest).rstrip().endswith(b"data: [DONE]")  # the stream in flight finished
    await fleet.observer.wait_done(7)
    assert routing.fleet.active == 0


async def test_the_watch_follows_the_file_and_a_broken_file_keeps_the_catalogue(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    fleet = await make_fleet(
        workers=2,
        routing="round-robin",
        workers_file=tmp_path / "workers.toml",
        in_catalogue=[0],
        workers_file_interval=0.05,
    )
    fleet_view = fleet.routing.fleet
    mark = fleet.observer.mark()
    fleet.write_workers([], text="[[worker]]\nurl = 'http://127.0.0.1:1\n")  # a typo
    failed = await fleet.observer.wait_for("reload_failed", after=mark)
    assert str(fleet.workers_file) in failed["failed"]["workers"]
    assert "not valid TOML" in failed["failed"]["workers"]
    mark = fleet.observer.mark()
    fleet.write_workers([], text="")  # an empty list: refused the same way
    failed = await fleet.observer.wait_for("reload_failed", after=mark)
    assert "no [[worker]] table" in failed["failed"]["workers"]
    assert [w.label for w in fleet_view.workers] == [fleet.mocks[0].base_url]
    assert await served(fleet, 2, "kept") == [0, 0]
    # SIGHUP says it again, in its one line, and keeps the catalogue.
    failures = fleet.running.reload()
    assert "no [[worker]] table" in failures["workers"]

    mark = fleet.observer.mark()
    fleet.write_workers([1])  # the whole fleet replaced
    await fleet.observer.wait_for("workers_reloaded", after=mark, trigger="watch")
    await fleet.observer.wait_for("worker_admitted", after=mark, worker=fleet.mocks[1].base_url)
    assert await served(fleet, 2, "swapped") == [1, 1]


async def test_kv_a_catalogue_change_reaches_the_selection_core_and_the_event_watch(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    native = FakeNative()
    fleet = await make_fleet(
        workers=3,
        routing="kv",
        native=lambda: native,
        kv_block_size=16,
        workers_file=tmp_path / "workers.toml",
        in_catalogue=[0, 1],
    )
    kv = fleet.routing.kv
    assert kv is not None
    ids = [parse_worker_spec(spec).worker_id for spec in fleet.specs]
    endpoints = [fleet.mocks[i].kv_events_endpoint for i in range(3)]
    assert sorted(native.workers) == sorted(ids[:2])
    assert sorted(kv.watch.endpoints) == sorted(endpoints[:2])
    mark = fleet.observer.mark()
    fleet.write_workers([1, 2])
    assert fleet.running.reload() == {}
    await fleet.observer.wait_for("worker_admitted", after=mark, worker=fleet.mocks[2].base_url)
    async with asyncio.timeout(5):
        while sorted(native.workers) != sorted(ids[1:]):
            await asyncio.sleep(0.01)  # the core's calls land on its owner thread
    assert ("delete_worker", ids[0]) in native.calls
    assert native.calls.count(("upsert_worker", ids[2])) == 1
    assert sorted(kv.watch.endpoints) == sorted(endpoints[1:])
    # The new worker's KV-event socket hears pylon's watch.
    reply = await fleet.client.get(
        f"{fleet.mocks[2].base_url}/test-control/kv",
        params={"wait_subscribers": "1", "timeout": "10"},
        timeout=15,
    )
    reply.raise_for_status()
    assert set(await served(fleet, 4, "kv")) <= {1, 2}


async def test_a_removed_kv_workers_late_free_is_a_no_op(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    native = FakeNative()
    fleet = await make_fleet(
        workers=2,
        routing="kv",
        native=lambda: native,
        kv_block_size=16,
        workers_file=tmp_path / "workers.toml",
        mock={"num_tokens": 30, "token_delay_ms": 5},
    )
    kv = fleet.routing.kv
    assert kv is not None
    headers = {"x-request-id": "long", "x-model": MODEL}
    async with fleet.client.stream(
        "POST", f"{fleet.url}/v1/chat/completions", json=chat(0, True), headers=headers
    ) as stream:
        chunks = stream.aiter_bytes()
        first = await anext(chunks)
        gone = await fleet.served_by("long")
        fleet.write_workers([1 - gone])
        assert fleet.running.reload() == {}
        rest = b"".join([chunk async for chunk in chunks])
    assert (first + rest).rstrip().endswith(b"data: [DONE]")
    await fleet.observer.wait_done(1)
    assert await asyncio.to_thread(kv.core.quiesce, 5.0)
    assert kv.core.failed_ops == 0  # the free of a removed worker's booking: a no-op
    assert not fleet.observer.of("kv_router_error")


# --- the start -----------------------------------------------------------------------------


def test_workers_file_and_worker_are_one_or_the_other(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    with pytest.raises(SettingsError, match="--workers-file and --worker"):
        load_settings(
            {"routing": "round-robin", "workers_file": path, "worker": ["url=http://a:1"]}
        )
    with pytest.raises(SettingsError, match="--workers-file needs --routing"):
        load_settings({"workers_file": path})


@pytest.fixture
def observer() -> Iterator[RoutingObserver]:
    yield RoutingObserver()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "no such file"),
        ("", "no [[worker]] table"),
        (
            "[[worker]]\nurl = 'http://127.0.0.1:1'\n[[worker]]\nurl = 'http://127.0.0.1:1'\n",
            "twice",
        ),
        ("[[worker]]\ninstance-id = 3\n", "needs --backend dynamo and --upstream"),
    ],
)
async def test_a_workers_file_pylon_cannot_route_by_refuses_the_start(
    tmp_path: Path, observer: RoutingObserver, text: str | None, reason: str
) -> None:
    path = tmp_path / "w.toml"
    if text is not None:
        path.write_text(text)
    settings = load_settings({"routing": "least-loaded", "workers_file": path})
    with pytest.raises(StartupError) as caught:
        await build_routing(routing_options(settings), observer)
    assert str(caught.value).startswith(f"--workers-file {path}: ")
    assert reason in str(caught.value)


async def test_workers_is_not_found_without_routing(tmp_path: Path) -> None:
    from pylon.run import start

    settings = load_settings({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"})
    async with start(settings) as running, httpx.AsyncClient() as client:
        reply = await client.get(f"{running.admin_url}/workers")
    assert reply.status_code == 404
    assert json.loads(reply.text)["code"] == "not_found"


# --- Dynamo instances discovered from the frontend -----------------------------------------


async def test_discovered_instances_follow_the_frontends_health_list() -> None:
    from mock_dynamo.server import MockConfig, start_mock
    from pylon.run import start

    mock = await start_mock(MockConfig(models=(MODEL,)), host="127.0.0.1", port=0)
    observer = RoutingObserver()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            control = f"{mock.base_url}/test-control"
            (await client.put(f"{control}/health", json={"instances": [7, 5]})).raise_for_status()
            settings = load_settings(
                {
                    "listen": "127.0.0.1:0",
                    "upstream": mock.base_url,
                    "routing": "round-robin",
                    "discover_instances": True,
                    "workers_file_interval": 0.05,
                    "worker_health_interval": 3600.0,
                    "model_discovery_interval": 3600.0,
                    "admin_listen": "127.0.0.1:0",
                }
            )
            async with start(settings, observer) as running:
                assert running.routing is not None
                fleet = running.routing.fleet
                assert [w.label for w in fleet.workers] == ["instance-id=5", "instance-id=7"]
                listing = (await client.get(f"{running.admin_url}/workers")).json()
                assert listing["catalogue_source"] == f"discovery {mock.base_url}/health"

                async def pins(tag: str) -> set[str]:
                    """The instance pins of 4 requests (a reset would forget `instances`)."""
                    for n in range(4):
                        reply = await client.post(
                            f"{running.url}/v1/chat/completions",
                            json=chat(n),
                            headers={"x-model": MODEL, "x-request-id": f"{tag}-{n}"},
                        )
                        assert reply.status_code == 200, reply.text
                    records = (await client.get(control)).json()["requests"]
                    found = set()
                    for record in records:
                        headers = {name.lower(): value for name, value in record["headers"]}
                        if headers.get("x-request-id", "").startswith(f"{tag}-"):
                            found.add(headers["x-dynamo-worker-instance-id"])
                    return found

                assert await pins("first") == {"5", "7"}
                mark = observer.mark()
                put = await client.put(f"{control}/health", json={"instances": [7, 9]})
                put.raise_for_status()
                reloaded = await observer.wait_for("workers_reloaded", after=mark)
                assert reloaded["added"] == ["instance-id=9"]
                assert reloaded["removed"] == ["instance-id=5"]
                await observer.wait_for("worker_admitted", after=mark, worker="instance-id=9")
                assert await pins("then") == {"7", "9"}
                # An empty list (every instance restarting) keeps the catalogue.
                mark = observer.mark()
                put = await client.put(f"{control}/health", json={"instances": []})
                put.raise_for_status()
                failed = await observer.wait_for("reload_failed", after=mark)
                assert "lists no generate instance" in failed["failed"]["workers"]
                assert [w.label for w in fleet.workers] == ["instance-id=7", "instance-id=9"]
    finally:
        await mock.stop()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"routing": "kv", "tokenizer": "/"}, "cannot serve --routing kv"),
        ({"backend": "vllm"}, "needs --backend dynamo and --upstream"),
        ({"upstream": None}, "needs --backend dynamo and --upstream"),
        ({"worker": ["instance-id=1"]}, "--discover-instances and --worker"),
        ({"routing": "off"}, "--discover-instances needs --routing"),
    ],
)
def test_discovery_refuses_what_it_cannot_do(overrides: dict[str, object], reason: str) -> None:
    base: dict[str, object] = {
        "routing": "round-robin",
        "upstream": "http://127.0.0.1:8000",
        "discover_instances": True,
    }
    with pytest.raises(SettingsError, match=reason):
        load_settings({**base, **overrides})


def test_sighup_reloads_the_workers_file_of_a_real_pylon(tmp_path: Path) -> None:
    """`pylon serve --workers-file` as a process: SIGHUP applies the rewritten file (the watch
    never runs here), and a broken file is one `reload_failed` line that keeps the catalogue."""
    import re
    import signal
    import subprocess

    from tests.integration.test_cli import ENGINE, log_lines, start_pylon

    def engine() -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [*ENGINE, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert proc.stdout is not None
        match = re.search(r"listening on (http://\S+)", proc.stdout.readline())
        assert match
        return proc, match.group(1).rstrip("/")

    engines = [engine(), engine()]
    path = tmp_path / "workers.toml"
    path.write_text(f'[[worker]]\nurl = "{engines[0][1]}"\n')
    args = ["--listen", "127.0.0.1:0", "--routing", "round-robin", "--workers-file", str(path)]
    args += ["--workers-file-interval", "3600", "--worker-health-interval", "3600"]
    try:
        with start_pylon(*args) as proc:
            try:
                lines = log_lines(proc, "ready")
                listening = next(line for line in lines if line["event"] == "listening")
                assert listening["catalogue"] == f"file {path}"
                assert listening["workers"] == [engines[0][1]]
                path.write_text(
                    "".join(f'[[worker]]\nurl = "{url}"\n' for _, url in reversed(engines))
                )
                proc.send_signal(signal.SIGHUP)
                lines = log_lines(proc, "reloaded")
                (reloaded,) = [line for line in lines if line["event"] == "workers_reloaded"]
                assert reloaded["added"] == [engines[1][1]] and reloaded["kept"] == 1
                assert reloaded["trigger"] == "signal"
                assert lines[-1]["reloaded"] == ["workers"] and lines[-1]["workers"] == "changed"
                assert lines[-1]["catalogue_digest"] == reloaded["catalogue_digest"]
                path.write_text("[[worker]]\nurl = \n")
                proc.send_signal(signal.SIGHUP)
                failed = log_lines(proc, "reload_failed")[-1]
                assert failed["level"] == "error" and str(path) in failed["failed"]["workers"]
                assert failed["catalogue_digest"] == reloaded["catalogue_digest"]
                proc.send_signal(signal.SIGTERM)
                log_lines(proc, "drained")
                assert proc.wait(timeout=10) == 0
            finally:
                proc.kill()
                proc.wait()
    finally:
        for process, _ in engines:
            process.terminate()
            process.wait(timeout=10)
            assert process.stdout is not None
            process.stdout.close()


@pytest.mark.dynamo
@pytest.mark.timeout(120)
async def test_kv_real_core_forgets_a_removed_worker_and_routes_to_an_added_one(
    make_fleet: FleetFactory, tmp_path: Path
) -> None:
    """Dynamo 1.6.1's SelectionService: a removed worker's booking in flight leaves the core's
    loads at once and its late free fails nothing; the added worker is chosen."""
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime 1.6.1 is not installed")
    fleet = await make_fleet(
        workers=3,
        routing="kv",
        kv_block_size=4,
        workers_file=tmp_path / "workers.toml",
        in_catalogue=[0, 1],
        mock={"num_tokens": 30, "token_delay_ms": 5},
    )
    kv = fleet.routing.kv
    assert kv is not None
    core = kv.core
    ids = [parse_worker_spec(spec).worker_id for spec in fleet.specs]
    headers = {"x-request-id": "long", "x-model": MODEL}
    async with fleet.client.stream(
        "POST", f"{fleet.url}/v1/chat/completions", json=chat(0, True), headers=headers
    ) as stream:
        chunks = stream.aiter_bytes()
        first = await anext(chunks)
        gone = await fleet.served_by("long")
        stays = 1 - gone
        loads = {w.worker_id: w.active_requests for g in core.loads() for w in g.workers}
        assert loads[ids[gone]] == 1
        mark = fleet.observer.mark()
        fleet.write_workers([stays, 2])
        assert fleet.running.reload() == {}
        await fleet.observer.wait_for("worker_admitted", after=mark, worker=fleet.mocks[2].base_url)
        async with asyncio.timeout(10):
            while sorted(r.worker_id for r in core.workers()) != sorted([ids[stays], ids[2]]):
                await asyncio.sleep(0.01)
        loads = {w.worker_id: w.active_requests for g in core.loads() for w in g.workers}
        assert ids[gone] not in loads  # its booking's load left with it
        rest = b"".join([chunk async for chunk in chunks])
    assert (first + rest).rstrip().endswith(b"data: [DONE]")
    chosen = await served(fleet, 6, "kv-after")
    assert set(chosen) <= {stays, 2} and 2 in chosen
    await fleet.observer.wait_done(7)
    assert core.quiesce()
    assert core.failed_ops == 0
    assert all(w.active_requests == 0 for group in core.loads() for w in group.workers)

"""`pylon serve --processes 2 --routing least-loaded` on real processes (127.0.0.1, kernel-picked
ports, mock engines streaming slowly so bookings are held): the supervisor runs the node's
booking authority as its "router" process, and every serving process books there.

- Streams arriving over both processes spread one per worker: booking alone, each process
  would put its first stream on the same (least-loaded, first) worker.
  SIGTERM stops the router last, after both serving processes drained; all exit 0.
- A serving process killed with SIGKILL: the authority's view (the node's /metrics,
  `process="router"`) drops to the survivor's bookings at once; after the streams end none is left.
- A workers file rewritten: the authority reloads it, both processes' mirrors follow, and the
  removed worker gets no new request from either.
- The router killed with SIGKILL: serving goes on (each process books alone), the router is
  restarted, and the bookings are exact again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet import workers_toml
from tests.integration.test_cli import ENGINE, PYLON, clean_env
from tests.integration.test_supervisor import TOKENS, NodeLog, Streams, _h1, _kill_children

WORKERS = 4


class RoutedNode:
    """A running `--processes 2` node with routing: its address, admin and log."""

    def __init__(self, proc: subprocess.Popen[str], log: NodeLog) -> None:
        self.proc = proc
        self.log = log
        started = log.event("supervisor_started")
        assert started["router"], started
        self.admin = f"http://{started['admin']}"
        self.url = f"http://{started['address']}"
        for process in (0, 1):
            log.event("ready", timeout=60, process=process)
        log.event("booking_authority_listening", timeout=60, process="router")

    def pid(self, process: int | str) -> int:
        started = [
            line for line in self.log.events("process_started") if line["process"] == process
        ]
        return int(started[-1]["pid"])

    def bookings(self, process: str) -> dict[str, float]:
        """`pylon_router_active_bookings` of one process of the node's scrape, per worker."""
        text = httpx.get(f"{self.admin}/metrics", timeout=10).text
        found: dict[str, float] = {}
        pattern = re.compile(
            r'^pylon_router_active_bookings\{process="([^"]+)",worker="([^"]+)"\} (\S+)$', re.M
        )
        for where, worker, value in pattern.findall(text):
            if where == process:
                found[worker] = float(value)
        return found

    def held(self, process: str) -> float:
        return sum(self.bookings(process).values())


def _until(check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll `check` until it returns something true, within a deadline."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"not {what} within {timeout} s (last: {last})")


@pytest.fixture
def engines() -> Iterator[list[str]]:
    procs = [
        subprocess.Popen(
            [*ENGINE, "--port", "0", "--token-delay-ms", "20", "--num-tokens", str(TOKENS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(WORKERS)
    ]
    try:
        urls = []
        for proc in procs:
            assert proc.stdout is not None
            match = re.search(r"listening on (http://\S+)", proc.stdout.readline())
            assert match
            urls.append(match.group(1).rstrip("/"))
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.fixture
def workers_file(tmp_path: Path, engines: list[str]) -> Path:
    path = tmp_path / "workers.toml"
    path.write_text(workers_toml([f"url={url}" for url in engines]))
    return path


@pytest.fixture
def node(workers_file: Path) -> Iterator[RoutedNode]:
    args = [
        *PYLON,
        "serve",
        "--processes",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--routing",
        "least-loaded",
        "--workers-file",
        str(workers_file),
        "--workers-file-interval",
        "3600",  # reloaded by SIGHUP only: the test says when
        "--worker-health-interval",
        "0.2",
        "--shutdown-grace",
        "5",
    ]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=clean_env())
    log = NodeLog(proc)
    try:
        yield RoutedNode(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        _kill_children(proc.pid)
        log.close(proc)


def _both_connected(node: RoutedNode) -> None:
    for process in (0, 1):
        node.log.event("booking_authority_connected", process=process)


def _streams_over_both(node: RoutedNode, streams: Streams, count: int) -> None:
    """`count` streams held, at least one through each serving process (new connections go
    where the kernel's hash sends them: more are opened, and the extra ones ended, until both
    served some); `count` bookings are held in all."""
    opened = 0
    while True:
        streams.open(f"s-{opened}")
        opened += 1
        by_process = {p: node.held(p) for p in ("0", "1")}
        if opened >= count and by_process["0"] >= 1 and by_process["1"] >= 1:
            return
        assert opened < 24, f"after {opened} streams, not both processes: {by_process}"


def test_bookings_from_both_processes_are_exact(node: RoutedNode, engines: list[str]) -> None:
    _both_connected(node)
    streams = Streams(node)  # type: ignore[arg-type]  # it reads `url` only
    for i in range(WORKERS):
        streams.open(f"s-{i}")
    # Four streams, one per worker, whichever process each came through.
    spread = node.bookings("router")
    assert sorted(spread.values()) == [1.0] * WORKERS, spread
    assert node.held("0") + node.held("1") == WORKERS
    # Booking alone, a process's first stream goes to the first worker: both processes took
    # some (else the test proves nothing about exactness across them).
    if node.held("0") == 0 or node.held("1") == 0:
        _streams_over_both(node, streams, WORKERS + 1)
        per_worker = node.bookings("router").values()
        assert max(per_worker) - min(per_worker) <= 1, node.bookings("router")
    streams.join()
    _until(lambda: node.held("router") == 0, "every booking released")
    # The node's stop: the router last, once the serving processes drained; all exit 0.
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=30) == 0
    stopped = [line["process"] for line in node.log.events("process_stopped")]
    assert sorted(stopped[:2]) == [0, 1] and stopped[2:] == ["router"], stopped
    assert node.log.event("booking_authority_stopped", process="router")


def test_a_killed_process_bookings_leave_the_authority_at_once(node: RoutedNode) -> None:
    _both_connected(node)
    streams = Streams(node)  # type: ignore[arg-type]
    _streams_over_both(node, streams, 3)
    survivor = node.held("1")
    os.kill(node.pid(0), signal.SIGKILL)
    lost = node.log.event("booking_client_lost", process="router")
    assert lost["released"] >= 1
    assert node.held("router") == survivor
    node.log.event("process_started", process=0, restarts=1)
    streams.join()
    # A mixed run after it: streams cut by their clients, and whole ones.
    node.log.event("booking_authority_connected", timeout=60, process=0, reannounced=0)
    for i in range(6):
        _h1(node, i)  # type: ignore[arg-type]
    _cut_streams(node, 4)
    _until(lambda: node.held("router") == 0, "every booking released")
    assert node.held("0") == 0 and node.held("1") == 0


def _cut_streams(node: RoutedNode, count: int) -> None:
    """Streams whose client goes away after the first event (an abort)."""
    for i in range(count):
        with (
            httpx.Client(timeout=10) as client,
            client.stream(
                "POST",
                node.url + "/v1/chat/completions",
                content=b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}],'
                b'"stream":true,"max_tokens":150}',
                headers={
                    "x-model": "mock-model",
                    "content-type": "application/json",
                    "x-request-id": f"cut-{i}",
                },
            ) as reply,
        ):
            assert reply.status_code == 200
            next(reply.iter_lines())


def test_a_rewritten_workers_file_reaches_both_processes(
    node: RoutedNode, engines: list[str], workers_file: Path
) -> None:
    _both_connected(node)
    removed = engines[0]
    workers_file.write_text(workers_toml([f"url={url}" for url in engines[1:]]))
    node.proc.send_signal(signal.SIGHUP)
    reloaded = node.log.event("workers_reloaded", process="router")
    assert reloaded["removed"] == [removed] and reloaded["trigger"] == "signal"
    said = node.log.event("reloaded", process="router")
    assert said["workers"] == "changed" and said["catalogue_digest"] == reloaded["catalogue_digest"]
    for process in (0, 1):
        mirror = node.log.event("workers_reloaded", process=process)
        assert mirror["trigger"] == "authority" and mirror["removed"] == [removed]
        assert mirror["catalogue_digest"] == reloaded["catalogue_digest"]
    before = httpx.get(f"{removed}/test-control", timeout=10).json()["counters"]["total"]
    served: dict[int, int] = {}
    for i in range(16):
        _h1(node, i)  # type: ignore[arg-type]
    for line in node.log.events("request_done"):
        served[line["process"]] = served.get(line["process"], 0) + 1
    assert set(served) == {0, 1}, served
    after = httpx.get(f"{removed}/test-control", timeout=10).json()["counters"]["total"]
    assert after == before
    assert set(node.bookings("router")) == set(engines[1:])
    node.proc.send_signal(signal.SIGUSR1)
    report = node.log.event("status_report", role="router")
    assert report["clients"] == 2 and report["workers"] == WORKERS - 1
    # Back in the file: a new worker at the authority (booked from once its checks pass) and
    # in both mirrors.
    workers_file.write_text(workers_toml([f"url={url}" for url in engines]))
    node.proc.send_signal(signal.SIGHUP)
    for process in ("router", 0, 1):
        node.log.event("workers_reloaded", process=process, added=[removed])
    _until(lambda: node.bookings("router").keys() == set(engines), "the worker back at the router")
    node.log.wait_for(
        lambda line: (
            line.get("event") == "worker_admitted"
            and line.get("worker") == removed
            and line.get("process") == "router"
            and node.log.lines.index(line) > node.log.lines.index(reloaded)
        ),
        what="the worker back in rotation",
    )
    for i in range(16, 32):
        _h1(node, i)  # type: ignore[arg-type]
    back = httpx.get(f"{removed}/test-control", timeout=10).json()["counters"]["total"]
    assert back > after


def test_the_router_killed_is_restarted_and_serving_goes_on(
    node: RoutedNode, engines: list[str]
) -> None:
    _both_connected(node)
    # The held stream outlives the router's restart and the links' reconnect backoff (up to
    # 2 s): 150 tokens 50 ms apart.
    for url in engines:
        knobs = httpx.put(f"{url}/test-control/knobs", json={"token_delay_ms": 50}, timeout=10)
        assert knobs.status_code == 200, knobs.text
    streams = Streams(node)  # type: ignore[arg-type]
    streams.open("held-0")
    os.kill(node.pid("router"), signal.SIGKILL)
    exited = node.log.event("process_exited", process="router")
    assert exited["signal"] == "SIGKILL"
    lost = node.log.event("booking_authority_lost")
    assert lost["level"] == "warning" and lost["process"] in (0, 1)
    for i in range(4):
        _h1(node, i)  # type: ignore[arg-type]  # served meanwhile, booked alone
    node.log.event("process_started", process="router", restarts=1)
    for process in (0, 1):
        node.log.wait_for(
            lambda line, p=process: (
                line.get("event") == "booking_authority_connected"
                and line.get("process") == p
                and node.log.lines.index(line) > node.log.lines.index(exited)
            ),
            what=f"process {process} connected again",
        )
    # The held stream was re-announced: the new authority counts it.
    _until(lambda: node.held("router") == 1, "the held stream counted again")
    restarts = httpx.get(f"{node.admin}/metrics", timeout=10).text
    assert 'pylon_process_restarts_total{reason="router_signal"} 1' in restarts
    streams.open("held-1")
    streams.open("held-2")
    assert sorted(node.bookings("router").values()) == [0.0, 1.0, 1.0, 1.0]
    streams.join()
    _until(lambda: node.held("router") == 0, "every booking released")

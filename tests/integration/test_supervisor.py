"""`pylon serve --processes 2` on real processes (127.0.0.1, kernel-picked ports, one shared
mock engine): one port pair serves HTTP/1.1, HTTP/2 (h2c) and HTTP/3, both processes take
traffic (the node's merged /metrics says so per process), every QUIC handshake gets the one
self-signed certificate, SIGTERM drains both with streams in flight and exits 0, and a process
killed with SIGKILL mid-stream cuts only its own streams, is restarted with backoff, and
/ready says 503 until it is back."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aioquic.asyncio import connect
from prometheus_client.parser import text_string_to_metric_families

from tests.h3client import H3Client, chat, client_configuration
from tests.integration.test_cli import ENGINE, PYLON, clean_env

TOKENS = 150  # a stream: 150 tokens, 20 ms apart (3 s)
CHAT = "/v1/chat/completions"
HEADERS = {"x-model": "mock-model", "content-type": "application/json"}


class NodeLog:
    """Every line the node writes on stderr (the supervisor's and its processes'), read on a
    thread, parsed; `wait_for` returns the first line a predicate accepts, within a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                line = {"text": raw.rstrip("\n")}
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(
        self, accept: Callable[[dict[str, Any]], bool], timeout: float = 30.0, what: str = ""
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if accept(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self._ended:
                    tail = self.lines[-30:]
                    raise AssertionError(f"no line for {what or accept} within {timeout} s: {tail}")
                self._changed.wait(left)

    def event(self, event: str, timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        return self.wait_for(
            lambda line: (
                line.get("event") == event and all(line.get(k) == v for k, v in fields.items())
            ),
            timeout,
            f"{event} {fields}",
        )

    def close(self, proc: subprocess.Popen[str]) -> None:
        """Once the node exited: the last lines read, the pipe closed."""
        self._thread.join(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()

    def events(self, event: str) -> list[dict[str, Any]]:
        with self._changed:
            return [line for line in self.lines if line.get("event") == event]


class Node:
    def __init__(self, proc: subprocess.Popen[str], log: NodeLog, cert: Path) -> None:
        self.proc = proc
        self.log = log
        self.cert = cert
        started = log.event("supervisor_started")
        self.address = str(started["address"])
        self.quic_port = int(started["quic_port"])
        self.admin = f"http://{started['admin']}"
        self.url = f"http://{self.address}"
        for process in (0, 1):
            log.event("ready", timeout=60, process=process)

    def pid(self, process: int) -> int:
        """The pid of the process now in slot `process`."""
        started = [
            line for line in self.log.events("process_started") if line["process"] == process
        ]
        return int(started[-1]["pid"])

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{self.admin}/metrics", timeout=10).text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def per_process(self, name: str, **labels: str) -> dict[str, float]:
        """A family's samples summed per process, over those with `labels`."""
        sums: dict[str, float] = {}
        for (sample, sample_labels), value in self.metrics().items():
            found = dict(sample_labels)
            if sample == name and all(found.get(k) == v for k, v in labels.items()):
                sums[found["process"]] = sums.get(found["process"], 0.0) + value
        return sums


@pytest.fixture
def engine() -> Iterator[str]:
    with subprocess.Popen(
        [*ENGINE, "--port", "0", "--token-delay-ms", "20", "--num-tokens", str(TOKENS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            match = re.search(r"listening on (http://\S+)", proc.stdout.readline())
            assert match
            yield match.group(1)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def node(engine: str, tmp_path: Path) -> Iterator[Node]:
    cert = tmp_path / "node.pem"
    args = [
        *PYLON,
        "serve",
        "--processes",
        "2",
        "--listen",
        "127.0.0.1:0",
        "--quic-listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--upstream",
        engine,
        "--tls-self-signed-cert-file",
        str(cert),
        "--shutdown-grace",
        "20",
    ]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=clean_env())
    log = NodeLog(proc)
    try:
        yield Node(proc, log, cert)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        _kill_children(proc.pid)
        log.close(proc)


def _kill_children(supervisor: int) -> None:
    """A test that failed half-way may leave processes whose supervisor is gone: they drain
    and exit by themselves (their control socket's EOF); wait for that, within a deadline."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = subprocess.run(
            ["pgrep", "-P", str(supervisor)], capture_output=True, text=True, check=False
        )
        if not result.stdout.strip():
            return
        time.sleep(0.1)


def _body(stream: bool, tokens: int = 4) -> bytes:
    return json.dumps(
        {
            "model": "mock-model",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
            "max_tokens": tokens,
        }
    ).encode()


def _until_both(
    count: Callable[[], dict[str, float]], send: Callable[[int], None], limit: int
) -> dict[str, float]:
    """Send requests on new connections until both processes counted some (the kernel
    spreads new connections by a hash of their addresses): bounded by `limit` requests."""
    counts: dict[str, float] = {}
    for i in range(limit):
        send(i)
        counts = count()
        if counts.get("0", 0) > 0 and counts.get("1", 0) > 0:
            return counts
    raise AssertionError(f"after {limit} new connections, not both processes: {counts}")


def _h1(node: Node, i: int) -> None:
    with httpx.Client(timeout=10) as client:  # a new connection each time
        reply = client.post(
            node.url + CHAT, content=_body(False), headers={**HEADERS, "x-request-id": f"h1-{i}"}
        )
    assert reply.status_code == 200, reply.text


def _h2(node: Node, i: int) -> None:
    with httpx.Client(http1=False, http2=True, timeout=10) as client:  # h2c, prior knowledge
        reply = client.post(
            node.url + CHAT, content=_body(False), headers={**HEADERS, "x-request-id": f"h2-{i}"}
        )
    assert reply.status_code == 200 and reply.http_version == "HTTP/2", reply.text


async def _h3(node: Node, i: int) -> str:
    """One request on a new QUIC connection; returns the certificate's SHA-256."""
    async with asyncio.timeout(10):
        async with connect(
            "127.0.0.1",
            node.quic_port,
            configuration=client_configuration(),
            create_protocol=H3Client,
        ) as client:
            assert isinstance(client, H3Client)
            response = await client.request(
                body=chat(), headers=[("x-request-id", f"h3-{i}"), ("x-model", "mock-model")]
            )
            assert response.status == 200
            return client.peer_fingerprint


def test_two_processes_serve_every_transport_on_one_port_pair_with_one_certificate(
    node: Node,
) -> None:
    # Every process listens on the supervisor's ports.
    listening = {line["process"]: line for line in node.log.events("listening")}
    assert {line["address"] for line in listening.values()} == {node.address}
    quic = {line["address"] for line in node.log.events("listening_quic")}
    assert quic == {f"127.0.0.1:{node.quic_port}"}

    def requests(transport: str) -> Callable[[], dict[str, float]]:
        return lambda: node.per_process(
            "pylon_requests_total", transport=transport, status_class="2xx"
        )

    _until_both(requests("http1"), lambda i: _h1(node, i), limit=64)
    _until_both(requests("h2"), lambda i: _h2(node, i), limit=64)
    fingerprints: set[str] = set()

    def h3(i: int) -> None:
        fingerprints.add(asyncio.run(_h3(node, i)))

    _until_both(requests("h3"), h3, limit=64)
    for i in range(8):  # and a few more handshakes: always the same certificate
        h3(100 + i)
    published = node.log.event("tls_self_signed")
    assert fingerprints == {published["fingerprint_sha256"]}
    assert node.cert.read_text().startswith("-----BEGIN CERTIFICATE-----")
    # Every process loaded the supervisor's one pair; only the supervisor published it.
    loaded = [line for line in node.log.events("tls_identity_loaded") if "process" in line]
    assert {line["fingerprint_sha256"] for line in loaded} == fingerprints
    assert {line["process"] for line in loaded} == {0, 1}
    assert len(node.log.events("tls_self_signed")) == 1
    # The node's own families ride along.
    metrics = node.metrics()
    assert metrics[("pylon_supervisor_processes", ())] == 2
    assert metrics[("pylon_supervisor_processes_up", ())] == 2
    assert metrics[("pylon_ready", (("process", "0"),))] == 1
    for process in ("0", "1"):
        assert metrics[("pylon_supervisor_process_scraped", (("process", process),))] == 1
    assert httpx.get(f"{node.admin}/live", timeout=10).status_code == 200
    ready = httpx.get(f"{node.admin}/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["not_ready"] == []


def test_sighup_and_sigusr1_reach_every_process(node: Node) -> None:
    node.proc.send_signal(signal.SIGHUP)
    assert node.log.event("reload_forwarded")["processes"] == [0, 1]
    for process in (0, 1):
        node.log.event("reloaded", process=process)
    node.proc.send_signal(signal.SIGUSR1)
    report = node.log.event("status_report", role="supervisor")
    assert report["up"] == 2 and report["pids"] == [node.pid(0), node.pid(1)]
    for process in (0, 1):
        assert node.log.event("status_report", process=process)["phase"] == "ready"
    assert node.proc.poll() is None


def _gone(pid: int) -> bool:
    """Exited (a zombie left to whoever reaps orphans counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_processes_drain_and_exit_when_their_supervisor_is_killed(node: Node) -> None:
    pids = [node.pid(0), node.pid(1)]
    runtime = Path(node.log.event("supervisor_started")["runtime"])
    assert runtime.is_dir() and stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert any(runtime.glob("admin-*.sock"))
    node.proc.kill()
    node.proc.wait(timeout=10)
    for process in (0, 1):
        node.log.event("supervisor_gone", process=process)
        node.log.event("drained", process=process)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a process outlived its supervisor"
        time.sleep(0.05)
    assert not runtime.exists()  # the key and the handovers went with them


def test_a_quic_connection_stays_on_its_process_while_another_restarts(node: Node) -> None:
    """The UDP sockets are held across restarts, so the kernel's pick for a live QUIC
    connection never moves: a request on the same connection after the other process was
    killed and restarted lands on the same process."""

    async def scenario() -> None:
        async with asyncio.timeout(90):
            async with connect(
                "127.0.0.1",
                node.quic_port,
                configuration=client_configuration(idle_timeout=120),
                create_protocol=H3Client,
            ) as client:
                assert isinstance(client, H3Client)

                async def served_by(request_id: str) -> int:
                    headers = [("x-request-id", request_id), ("x-model", "mock-model")]
                    response = await client.request(body=chat(), headers=headers, timeout=10)
                    assert response.status == 200
                    line = await asyncio.to_thread(
                        node.log.event, "request_done", request_id=request_id
                    )
                    return int(line["process"])

                mine = await served_by("before")
                other = 1 - mine
                os.kill(node.pid(other), signal.SIGKILL)
                restarted = await asyncio.to_thread(
                    node.log.event, "process_started", 30, process=other, restarts=1
                )
                await asyncio.to_thread(
                    node.log.wait_for,
                    lambda line: (
                        line.get("event") == "ready"
                        and line.get("process") == other
                        and node.log.lines.index(line) > node.log.lines.index(restarted)
                    ),
                    60,
                )
                assert await served_by("after") == mine

    asyncio.run(scenario())


class Streams:
    """Streaming requests on their own connections, each read on a thread to its end."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.results: dict[str, dict[str, Any]] = {}
        self._threads: list[threading.Thread] = []
        self._started = threading.Semaphore(0)

    def open(self, request_id: str) -> None:
        thread = threading.Thread(target=self._run, args=(request_id,), daemon=True)
        self._threads.append(thread)
        thread.start()
        assert self._started.acquire(timeout=10), "the stream's head never came"

    def _run(self, request_id: str) -> None:
        result: dict[str, Any] = {"events": 0, "done": False, "error": None}
        self.results[request_id] = result
        started = False
        try:
            with (
                httpx.Client(timeout=30) as client,
                client.stream(
                    "POST",
                    self.node.url + CHAT,
                    content=_body(True, TOKENS),
                    headers={**HEADERS, "x-request-id": request_id},
                ) as reply,
            ):
                result["status"] = reply.status_code
                for line in reply.iter_lines():
                    if not started:
                        started = True
                        self._started.release()
                    if line.startswith("data:"):
                        result["events"] += 1
                        result["done"] = result["done"] or line.strip() == "data: [DONE]"
        except httpx.HTTPError as exc:
            result["error"] = type(exc).__name__
        finally:
            if not started:
                self._started.release()

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=60)
            assert not thread.is_alive()


def _streams_on_both(node: Node, streams: Streams, limit: int = 32) -> None:
    """Open streams until each process has at least one in flight."""
    for i in range(limit):
        streams.open(f"stream-{i}")
        in_flight = node.per_process("pylon_requests_in_flight")
        if in_flight.get("0", 0) >= 1 and in_flight.get("1", 0) >= 1:
            return
    raise AssertionError(f"after {limit} streams, not both processes: {in_flight}")


def test_sigterm_drains_both_processes_with_streams_in_flight(node: Node) -> None:
    streams = Streams(node)
    _streams_on_both(node, streams)
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(timeout=60) == 0
    streams.join()
    for request_id, result in streams.results.items():
        assert result["done"] and result["error"] is None, (request_id, result)
    for process in (0, 1):
        node.log.event("drained", process=process)
        stopped = node.log.event("process_stopped", process=process)
        assert stopped["exit_code"] == 0
    assert node.log.event("stopped", role="supervisor")["exit_codes"] == [0, 0]
    assert not node.log.events("process_exited")
    assert not Path(node.log.event("supervisor_started")["runtime"]).exists()


def test_a_process_killed_mid_stream_cuts_only_its_streams_and_is_restarted(node: Node) -> None:
    streams = Streams(node)
    _streams_on_both(node, streams)
    victim = node.pid(0)
    os.kill(victim, signal.SIGKILL)
    exited = node.log.event("process_exited", process=0)
    assert exited["signal"] == "SIGKILL" and exited["restart_in_s"] == 0.5
    ready = httpx.get(f"{node.admin}/ready", timeout=10)
    if len([line for line in node.log.events("ready") if line.get("process") == 0]) == 1:
        # (the restarted process has not passed bring-up when the answer was made)
        assert ready.status_code == 503, ready.text
        assert 0 in ready.json()["not_ready"]
    restarted = node.log.event("process_started", process=0, restarts=1)
    assert restarted["pid"] != victim
    # Until the new process passed bring-up, the node is not ready; then it is.
    node.log.wait_for(
        lambda line: (
            line.get("event") == "ready"
            and line.get("process") == 0
            and node.log.lines.index(line) > node.log.lines.index(restarted)
        ),
        timeout=60,
        what="process 0 ready again",
    )
    _until_ready(node)
    streams.join()
    cut = [rid for rid, result in streams.results.items() if not result["done"]]
    whole = [rid for rid, result in streams.results.items() if result["done"]]
    assert cut and whole, streams.results
    # The survivor finished its own streams (its line comes just after the client's end);
    # none of the cut ones was its.
    for rid in whole:
        assert node.log.event("request_done", request_id=rid)["process"] == 1
    done_by = {line["request_id"]: line["process"] for line in node.log.events("request_done")}
    assert not any(done_by.get(rid) == 1 for rid in cut), (cut, done_by)
    metrics = node.metrics()
    assert metrics[("pylon_process_restarts_total", (("reason", "signal"),))] == 1
    # The restarted process serves.
    _until_both(
        lambda: node.per_process("pylon_requests_total", transport="http1"),
        lambda i: _h1(node, i),
        limit=64,
    )


def _until_ready(node: Node, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = httpx.get(f"{node.admin}/ready", timeout=10)
        if reply.status_code == 200:
            return
        assert reply.status_code == 503
        time.sleep(0.05)
    raise AssertionError("the node never became ready again")


def test_one_process_runs_no_supervisor(engine: str) -> None:
    proc = subprocess.Popen(
        [*PYLON, "serve", "--listen", "127.0.0.1:0", "--upstream", engine],
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    log = NodeLog(proc)
    try:
        listening = log.event("listening")
        assert "process" not in listening
        assert not log.events("supervisor_started")
        result = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
        )
        assert not result.stdout.strip()  # no child process
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close(proc)


def test_a_port_in_use_refuses_the_node_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*PYLON, "serve", "--processes", "2", "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=60,
        )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"pylon: --listen 127.0.0.1:{port}: cannot listen: address already in use"
    )


def test_the_starts_warnings_are_said_once_for_the_node() -> None:
    proc = subprocess.Popen(
        [
            *PYLON,
            "serve",
            "--processes",
            "2",
            "--listen",
            "0.0.0.0:0",
            "--quic-max-data",
            "100000",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    log = NodeLog(proc)
    try:
        for process in (0, 1):
            log.event("ready", timeout=60, process=process)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close(proc)
    insecure = log.events("insecure_listener")
    assert [line["listener"] for line in insecure] == ["tcp"]
    assert "process" not in insecure[0]
    assert [line["setting"] for line in log.events("setting_ignored")] == ["quic_max_data"]

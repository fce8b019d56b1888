"""`pylon serve --processes 2 --routing kv` on real processes (``pytest -m dynamo``): the
supervisor runs the node's booking authority as its "router" process, with Dynamo's selection
core in it; the serving processes tokenize and book there.

Three mock_dynamo workers (`--flavor dynamo`, a prefix cache, KV events on a ZMQ socket, the
tiny offline model dir of `scripts/dynamo_stack.py` as tokenizer), 127.0.0.1, kernel-picked
ports. Requests sharing a long prefix, each over a new TCP connection (so the kernel spreads
them over both serving processes), all go to the worker that holds the prefix: one core
decides for the node, so prefix affinity holds across its processes (and it is the only core:
each worker's KV-event socket has the router's two subscriptions, none from a serving process).
Afterwards the core counts no request and no process booked alone.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_cli import ENGINE, PYLON, clean_env
from tests.integration.test_supervisor import NodeLog, _kill_children

pytest.importorskip("dynamo._core", reason="pip install -e '.[dynamo]'")
pytest.importorskip("zmq", reason="pip install -e '.[mock-kv]'")
pytest.importorskip("tokenizers", reason="pip install -e '.[dynamo]'")

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

WORKERS = 3
BLOCK_SIZE = 16
MODEL = "mock-model"
CHAT = "/v1/chat/completions"
# The shared prefix: some 40 blocks of the tiny tokenizer's tokens, so the worker holding it
# wins on overlap by far (Dynamo's cost: overlap weight x prefill blocks + decode blocks).
PREFIX = " ".join(f"alpha{i} beta{i * 7} gamma{i % 13}" for i in range(120))
# Each selection core subscribes twice to a worker's KV events (the native core's SUB and
# pylon's watch); with an authority the node has one core, in the router process.
SUBSCRIBERS = 2


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


class Mock:
    """One mock_dynamo worker: its base URL and KV-event endpoint."""

    def __init__(self, model_dir: Path) -> None:
        argv = [
            *ENGINE, "--host", "127.0.0.1", "--port", "0", "--flavor", "dynamo",
            "--model", MODEL, "--ttft-ms", "5", "--token-delay-ms", "5", "--num-tokens", "8",
            "--capacity", "200", "--kv-block-size", str(BLOCK_SIZE), "--kv-cache-blocks", "512",
            "--tokenizer", str(model_dir), "--kv-events-port", "0", "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        url = re.search(r"listening on (http://\S+)", self.proc.stdout.readline())
        events = re.search(r"kv events on (tcp://\S+)", self.proc.stdout.readline())
        assert url and events, "mock_dynamo did not say where it listens"
        self.url = url.group(1).rstrip("/")
        self.events = events.group(1)

    def chats(self) -> int:
        """Chat completions this worker received since its last reset."""
        snapshot = httpx.get(f"{self.url}/test-control", timeout=10).json()
        return int(snapshot["counters"]["by_endpoint"].get(CHAT, 0))

    def blocks(self) -> int:
        return int(httpx.get(f"{self.url}/test-control/kv", timeout=10).json()["blocks"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dynamo_stack import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("kv-model"))


@pytest.fixture
def mocks(model_dir: Path) -> Iterator[list[Mock]]:
    started: list[Mock] = []
    try:
        for _ in range(WORKERS):
            started.append(Mock(model_dir))
        yield started
    finally:
        for mock in started:
            mock.close()


class KvNode:
    """A running `--processes 2 --routing kv` node: its address, admin and log."""

    def __init__(self, proc: subprocess.Popen[str], log: NodeLog) -> None:
        self.proc = proc
        self.log = log
        started = log.event("supervisor_started", timeout=60)
        assert started["router"], started
        self.admin = f"http://{started['admin']}"
        self.url = f"http://{started['address']}"

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) of every sample called `name` in the node's merged /metrics."""
        text = httpx.get(f"{self.admin}/metrics", timeout=10).text
        return [
            (sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name
        ]

    def per_process(self, name: str, **labels: str) -> dict[str, float]:
        """The sum of `name`'s samples with `labels`, per process."""
        out: dict[str, float] = {}
        for found, value in self.samples(name):
            if all(found.get(k) == v for k, v in labels.items()):
                out[found["process"]] = out.get(found["process"], 0.0) + value
        return out


@pytest.fixture
def node(mocks: list[Mock], model_dir: Path) -> Iterator[KvNode]:
    args = [
        *PYLON, "serve", "--processes", "2", "--listen", "127.0.0.1:0",
        "--admin-listen", "127.0.0.1:0", "--backend", "dynamo", "--routing", "kv",
        "--tokenizer", str(model_dir), "--shutdown-grace", "5",
    ]  # fmt: skip
    for mock in mocks:
        args += ["--worker", f"url={mock.url},kv-events={mock.events},block-size={BLOCK_SIZE}"]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=clean_env())
    log = NodeLog(proc)
    try:
        yield KvNode(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        _kill_children(proc.pid)
        log.close(proc)


def _chat(node: KvNode, n: int) -> None:
    """One request with the shared prefix, over a new connection, read to its end."""
    body = {
        "model": MODEL,
        "stream": True,
        "messages": [
            {"role": "system", "content": PREFIX},
            {"role": "user", "content": f"question number {n}"},
        ],
    }
    headers = {"x-model": MODEL, "x-request-id": f"kv-{n}"}
    with httpx.Client(timeout=20) as client:  # a new TCP connection each time
        reply = client.post(node.url + CHAT, json=body, headers=headers)
    assert reply.status_code == 200, reply.text


def _ready(node: KvNode, mocks: list[Mock]) -> None:
    """The node serves, both processes book at the router, and the router's core hears every
    worker's KV events from now on (its SUBs reached each mock's socket)."""
    _until(lambda: httpx.get(f"{node.admin}/ready", timeout=5).status_code == 200, "ready", 60)
    connected = {"0": 1.0, "1": 1.0}
    _until(
        lambda: node.per_process("pylon_router_authority_connected") == connected,
        "both processes linked to the router",
        30,
    )
    for mock in mocks:
        params = {"wait_subscribers": str(SUBSCRIBERS), "timeout": "15"}
        reply = httpx.get(f"{mock.url}/test-control/kv", params=params, timeout=20)
        assert reply.status_code == 200, reply.text
        # No more: the serving processes run no core of their own.
        assert reply.json()["events"]["subscribers"] == SUBSCRIBERS, reply.json()
        httpx.post(f"{mock.url}/test-control/reset", timeout=10).raise_for_status()


def test_prefix_affinity_holds_across_the_node_processes(node: KvNode, mocks: list[Mock]) -> None:
    _ready(node, mocks)
    # The first request puts the prefix in one worker's cache. Its KV events are published as
    # the prompt is admitted, so they reach the router's core while the reply still streams.
    _chat(node, 0)
    chats = [mock.chats() for mock in mocks]
    assert sorted(chats) == [0] * (WORKERS - 1) + [1], chats
    holder = chats.index(1)
    assert mocks[holder].blocks() > 0
    # Then every request with the prefix, whichever process it came through, goes there: more
    # are sent (each over a new connection) until both processes served some.
    sent = 1
    while True:
        _chat(node, sent)
        sent += 1
        served = node.per_process("pylon_requests_total", status_class="2xx")
        if sent >= 6 and served.get("0", 0) >= 1 and served.get("1", 0) >= 1:
            break
        assert sent < 32, f"after {sent} requests, not both processes: {served}"
    chats = [mock.chats() for mock in mocks]
    assert chats[holder] == sent and sum(chats) == sent, (holder, chats)
    decisions = node.per_process("pylon_router_decisions_total", policy="kv")
    assert decisions.get("0", 0) >= 1 and decisions.get("1", 0) >= 1, decisions
    # After they ended: the core counts no request, the authority holds no booking, and no
    # process booked alone.
    _until(
        lambda: sum(node.per_process("pylon_router_core_active_requests").values()) == 0,
        "the core's load back to 0",
    )
    assert node.per_process("pylon_router_core_active_requests").keys() == {"router"}
    _until(
        lambda: sum(node.per_process("pylon_router_active_bookings").values()) == 0,
        "every booking released",
    )
    local = node.per_process("pylon_router_authority_events_total", event="local_bookings")
    assert local == {"0": 0.0, "1": 0.0}, local

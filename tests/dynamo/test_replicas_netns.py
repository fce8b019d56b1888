"""Replicas across nodes with Dynamo 1.6.1's own replica sync (``pytest -m dynamo``, as root).

Two ``pylon serve --routing kv`` in two network namespaces ("nodes" A and B) joined by a veth
pair, in front of the same two mock workers (in A, reachable from B over the veth). Each
namespace has a second veth to the test's own namespace, where the client and the scrapes run;
the replica sync's PUB (``0.0.0.0:PORT``) is only ever opened inside the namespaces.

- sync on (``--replica-sync-port`` / ``--replica-peer``): after a burst of held requests
  through both, each pylon's view of every worker's load
  (``pylon_router_core_active_requests``) equals the true total (the two pylons'
  ``pylon_router_active_bookings`` added up) exactly, within ``PROPAGATION_BOUND_S``; the
  frees propagate the same way, and the per-peer counter saw the peer's events;
- sync off: each pylon's view is its own bookings only;
- a peer whose catalogue holds one more worker: its bookings there are counted as dropped
  (`unknown_worker`, with a warning), the rest still reach the other's view;
- a replica killed with SIGKILL: its bookings stay in the survivor's view until Dynamo's expiry
  sweep (``--kv-booking-expiry`` plus up to a minute; measured and printed).

Everything the fixture creates (namespaces, veths, processes) has a unique name and is removed
at the end; it skips when not root, without ``ip``, or when namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip(
    "dynamo._core", reason="ai-dynamo-runtime==1.6.1 is not installed (pip install -e '.[dynamo]')"
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(240)]

# The stated bound: a booking (and a free) made through one pylon shows in the other's view
# within this many seconds. Measured on one host: ~1.3 ms p50 / 3.5 ms p99 (docs/routing.md).
PROPAGATION_BOUND_S = 5.0
START_TIMEOUT_S = 60.0
HELD_TTFT_MS = 600_000  # the mock holds every request this long: the burst stays in flight
BURST_A, BURST_B = 5, 3


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


@dataclass
class Nodes:
    """Two namespaces: `a` and `b`; `a_sync`/`b_sync` their addresses on the A-B veth,
    `a_host`/`b_host` their addresses as the test's namespace reaches them."""

    a: str
    b: str
    a_sync: str
    b_sync: str
    a_host: str
    b_host: str

    def run_in(self, ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]


@pytest.fixture
def nodes() -> Iterator[Nodes]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2)")
    tag = secrets.token_hex(3)
    a, b = f"pylon-{tag}-a", f"pylon-{tag}-b"
    # One /24 of 10/8 per run, three /30s in it: A-B, host-A, host-B.
    net = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
    made: list[str] = []
    host_links: list[str] = []
    try:
        for ns in (a, b):
            result = _ip("netns", "add", ns, check=False)
            if result.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {result.stderr.strip()}")
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        # A <-> B: the replica sync and B's way to the workers.
        _ip("link", "add", f"p{tag}ab", "type", "veth", "peer", "name", f"p{tag}ba")
        for link, ns, addr in ((f"p{tag}ab", a, f"{net}.1"), (f"p{tag}ba", b, f"{net}.2")):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
        # The test's namespace <-> each node: the client and the scrapes.
        for ns, side, host, inside in ((a, "a", 5, 6), (b, "b", 9, 10)):
            outer, inner = f"p{tag}h{side}", f"p{tag}{side}h"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            host_links.append(outer)
            _ip("addr", "add", f"{net}.{host}/30", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{net}.{inside}/30", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
        yield Nodes(a, b, f"{net}.1", f"{net}.2", f"{net}.6", f"{net}.10")
    finally:
        for link in host_links:
            _ip("link", "del", link, check=False)
        for ns in made:
            _ip("netns", "del", ns, check=False)


class Proc:
    """A child process whose output lines are read on a thread (JSON ones parsed)."""

    def __init__(self, argv: list[str], stream: str = "stderr") -> None:
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if stream == "stdout" else subprocess.DEVNULL,
            stderr=subprocess.PIPE if stream == "stderr" else subprocess.DEVNULL,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith(("PYLON_", "OTEL_"))},
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        pipe = self.popen.stdout if stream == "stdout" else self.popen.stderr
        assert pipe is not None
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: Any) -> None:
        for line in pipe:
            self.lines.put(line)

    def wait_line(self, predicate: Any, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"no such line within {timeout} s: {self.seen[-20:]}")

    def wait_event(self, event: str) -> dict[str, Any]:
        def is_event(line: str) -> bool:
            with contextlib.suppress(ValueError):
                return bool(json.loads(line).get("event") == event)
            return False

        return dict(json.loads(self.wait_line(is_event)))

    def events(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.seen:
            with contextlib.suppress(ValueError):
                parsed = json.loads(line)
                if parsed.get("event") == event:
                    out.append(parsed)
        return out

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()


@dataclass
class Pylon:
    proc: Proc
    url: str
    admin: str
    started: list[dict[str, Any]] = field(default_factory=list)


def _free_port() -> int:
    """A port the kernel picks (free in the fresh namespaces too: they have nothing bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def replicas(
    nodes: Nodes,
    tokenizer: Path,
    *,
    sync: bool,
    extra: tuple[str, ...] = (),
    b_only: int = 0,
) -> Iterator[tuple[Pylon, Pylon]]:
    """Two mock workers in A, and a pylon in each namespace in front of both (`b_only`: more
    workers that only B's catalogue holds)."""
    procs: list[Proc] = []
    try:
        workers = []
        for _ in range(2 + b_only):
            mock = Proc(
                nodes.run_in(
                    nodes.a,
                    sys.executable,
                    "-m",
                    "mock_dynamo",
                    "--host",
                    nodes.a_sync,
                    "--port",
                    "0",
                    "--model",
                    "m",
                    "--ttft-ms",
                    str(HELD_TTFT_MS),
                    "--log-level",
                    "warning",
                ),
                stream="stdout",
            )
            procs.append(mock)
            line = mock.wait_line(lambda text: "listening on" in text)
            url = line.split("listening on", 1)[1].strip()
            # No KV events (a load-only test): the endpoint is where nobody publishes.
            workers.append(f"url={url},kv-events=tcp://{nodes.a_sync}:1,block-size=16")
        port = _free_port()
        pylons = []
        for ns, host, peer in (
            (nodes.a, nodes.a_host, nodes.b_sync),
            (nodes.b, nodes.b_host, nodes.a_sync),
        ):
            args = [
                "--listen",
                f"{host}:0",
                "--admin-listen",
                f"{host}:0",
                "--routing",
                "kv",
                "--tokenizer",
                str(tokenizer),
                "--worker-health-interval",
                "0.2",
                "--first-output-timeout",
                "900",
            ]
            for worker in workers if ns == nodes.b else workers[:2]:
                args += ["--worker", worker]
            if sync:
                args += ["--replica-sync-port", str(port), "--replica-peer", f"{peer}:{port}"]
            args += extra
            proc = Proc(nodes.run_in(ns, sys.executable, "-m", "pylon", "serve", *args))
            procs.append(proc)
            pylons.append(proc)
        started = []
        for proc in pylons:
            admin = proc.wait_event("listening_admin")["address"]
            listening = proc.wait_event("listening")
            proc.wait_event("ready")
            started.append(Pylon(proc, f"http://{listening['address']}", f"http://{admin}/metrics"))
        yield started[0], started[1]
    finally:
        for proc in reversed(procs):
            proc.stop()


Loads = dict[str, dict[str, float]]  # family -> worker -> value


async def scrape(client: Any, pylon: Pylon) -> Loads:
    text = (await client.get(pylon.admin)).text
    out: Loads = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            worker = sample.labels.get("worker")
            if worker is not None:
                out.setdefault(sample.name, {})[worker] = sample.value
    return out


async def until(check: Any, timeout: float) -> float:
    """Poll `check()` (a coroutine function) until it is true; the seconds it took."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if await check():
            return time.monotonic() - start
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s")
        await asyncio.sleep(0.02)


def hold(client: Any, pylon: Pylon, n: int, tag: str) -> asyncio.Task[None]:
    """A held streaming request through `pylon` (the mock does not answer for minutes)."""

    async def one() -> None:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": f"replica test {tag} {n} " * (n + 3)}],
            "stream": True,
            "max_tokens": 4,
        }
        url = f"{pylon.url}/v1/chat/completions"
        headers = {"x-request-id": f"{tag}-{n}-{secrets.token_hex(4)}", "x-model": "m"}
        async with client.stream("POST", url, json=body, headers=headers) as response:
            assert response.status_code == 200, response.status_code
            async for _ in response.aiter_raw():
                pass

    return asyncio.create_task(one())


def own(loads: Loads) -> dict[str, float]:
    return loads.get("pylon_router_active_bookings", {})


def core(loads: Loads) -> dict[str, float]:
    return loads.get("pylon_router_core_active_requests", {})


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def joined(client: Any, sender: Pylon, receiver: Pylon) -> None:
    """Until a booking through `sender` shows in `receiver`'s view: the receiver's SUB has
    joined (the first events after a cold start can be lost, docs/routing.md). Each probe is
    cancelled again, its free is heard (or ignored, when its add was lost)."""
    for attempt in range(40):
        probe = hold(client, sender, attempt, "probe")

        async def seen() -> bool:
            return sum(core(await scrape(client, receiver)).values()) >= 1

        try:
            await until(seen, 1.0)
            return
        except AssertionError:
            continue
        finally:
            await cancel([probe])
            await until(lambda: _idle(client, sender), PROPAGATION_BOUND_S)
    raise AssertionError("the replica sync never joined")


async def _idle(client: Any, pylon: Pylon) -> bool:
    return sum(own(await scrape(client, pylon)).values()) == 0


async def burst(client: Any, a: Pylon, b: Pylon) -> list[asyncio.Task[None]]:
    tasks = [hold(client, a, n, "a") for n in range(BURST_A)]
    tasks += [hold(client, b, n, "b") for n in range(BURST_B)]

    async def dispatched() -> bool:
        la, lb = await scrape(client, a), await scrape(client, b)
        return sum(own(la).values()) == BURST_A and sum(own(lb).values()) == BURST_B

    await until(dispatched, 30)
    return tasks


async def test_synced_replicas_see_the_true_load_on_every_worker(
    nodes: Nodes, tokenizer_models: dict[str, Path]
) -> None:
    with replicas(nodes, tokenizer_models["chatml"], sync=True) as (a, b):
        for pylon in (a, b):
            (started,) = pylon.proc.events("replica_sync_started")
            assert started["exposure"].startswith("0.0.0.0:") and started["level"] == "warning"
        digests = {p.proc.events("kv_router_started")[0]["catalogue_digest"] for p in (a, b)}
        assert len(digests) == 1  # the same catalogue on both nodes
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client:
            await joined(client, a, b)
            await joined(client, b, a)
            tasks = await burst(client, a, b)
            try:

                async def converged() -> bool:
                    la, lb = await scrape(client, a), await scrape(client, b)
                    truth = {w: own(la)[w] + own(lb).get(w, 0) for w in own(la)}
                    return core(la) == truth and core(lb) == truth

                took = await until(converged, PROPAGATION_BOUND_S)
                la, lb = await scrape(client, a), await scrape(client, b)
                assert sum(core(la).values()) == BURST_A + BURST_B, (la, lb)
                print(f"views converged {took * 1000:.0f} ms after the burst was dispatched")
            finally:
                await cancel(tasks)

            async def freed() -> bool:
                la, lb = await scrape(client, a), await scrape(client, b)
                return sum(core(la).values()) == 0 and sum(core(lb).values()) == 0

            await until(freed, PROPAGATION_BOUND_S)  # the frees propagate too
            text = (await client.get(a.admin)).text
        applied = [
            sample
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "pylon_router_replica_sync_events_total"
            and sample.labels["result"] == "applied"
        ]
        assert [s.labels["peer"] for s in applied] == [
            f"{nodes.b_sync}:{started['exposure'].split(':')[1]}"
        ]
        assert applied[0].value >= 2 * BURST_B  # B's adds and frees, at least
        assert not a.proc.events("replica_sync_dropped")


async def test_unsynced_replicas_see_only_their_own_load(
    nodes: Nodes, tokenizer_models: dict[str, Path]
) -> None:
    with replicas(nodes, tokenizer_models["chatml"], sync=False) as (a, b):
        assert not a.proc.events("replica_sync_started")
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client:
            tasks = await burst(client, a, b)
            try:
                for pylon, total in ((a, BURST_A), (b, BURST_B)):
                    loads = await scrape(client, pylon)
                    assert core(loads) == own(loads) and sum(core(loads).values()) == total
            finally:
                await cancel(tasks)


EXPIRY_S = 5  # --kv-booking-expiry: the shortest useful; Dynamo sweeps about once a minute
SWEEP_S = 60


async def test_a_crashed_replicas_bookings_leave_the_survivors_view_after_the_expiry(
    nodes: Nodes, tokenizer_models: dict[str, Path]
) -> None:
    """B books, then dies by SIGKILL (no free is ever sent): A keeps counting B's bookings
    until Dynamo's expiry sweep drops them, at most the expiry plus one sweep period later."""
    extra = ("--kv-booking-expiry", str(EXPIRY_S))
    with replicas(nodes, tokenizer_models["chatml"], sync=True, extra=extra) as (a, b):
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client:
            await joined(client, b, a)
            tasks = [hold(client, b, n, "b") for n in range(BURST_B)]

            async def mirrored() -> bool:
                return sum(core(await scrape(client, a)).values()) == BURST_B

            await until(mirrored, 30)
            b.proc.stop()  # SIGKILL
            crashed = time.monotonic()
            await cancel(tasks)

            async def forgotten() -> bool:
                return sum(core(await scrape(client, a)).values()) == 0

            lingered = await until(forgotten, EXPIRY_S + SWEEP_S + 15)
            print(f"a crashed replica's bookings lingered {lingered:.1f} s in the survivor")
            # Not dropped when B died (no free was sent): only once older than the expiry.
            assert time.monotonic() - crashed >= EXPIRY_S - 2


async def test_a_peer_with_another_catalogue_is_seen_dropping_events(
    nodes: Nodes, tokenizer_models: dict[str, Path]
) -> None:
    """B holds a worker A does not: the digests differ, and the bookings B places on it are
    counted in A as `unknown_worker` (Dynamo's core drops them), with a warning naming the
    worker; the bookings on the shared workers still reach A's view."""
    with replicas(nodes, tokenizer_models["chatml"], sync=True, b_only=1) as (a, b):
        digest_a, digest_b = (
            p.proc.events("kv_router_started")[0]["catalogue_digest"] for p in (a, b)
        )
        assert digest_a != digest_b
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client:
            await joined(client, b, a)
            before = dropped_events(await client.get(a.admin))  # probes on B's own worker
            tasks = [hold(client, b, n, "b") for n in range(6)]  # spread over B's 3 workers
            try:

                async def placed() -> bool:
                    return sum(own(await scrape(client, b)).values()) == 6

                await until(placed, 30)
                lb = await scrape(client, b)
                (only_b,) = set(own(lb)) - set(own(await scrape(client, a)))
                on_only_b = own(lb)[only_b]
                assert on_only_b >= 1

                async def mirrored() -> bool:
                    la = await scrape(client, a)
                    return sum(core(la).values()) == 6 - on_only_b

                await until(mirrored, PROPAGATION_BOUND_S)
                warning = a.proc.wait_event("replica_sync_dropped")
                assert warning["digest"] == digest_a and warning["level"] == "warning"
                after = dropped_events(await client.get(a.admin))
            finally:
                await cancel(tasks)
        assert after - before == on_only_b  # each add on the worker A does not know


def dropped_events(response: Any) -> float:
    (dropped,) = [
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "pylon_router_replica_sync_events_total"
        and sample.labels["result"] == "unknown_worker"
    ]
    return dropped

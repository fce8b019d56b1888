"""HTTP/3 benchmark: a bare aioquic HTTP/3 server answering canned responses vs pylon over HTTP/3
in front of the canned HTTP/1.1 upstream (scripts/bench/canned_upstream.py).

One QUIC connection per run with `--concurrency` streams in flight, small non-streaming requests
and SSE streams (20 events). Reports req/s, latency p50/p99 (client side) and the server
process's CPU-us per request and per relayed token (utime+stime from /proc/<pid>/stat, which for
pylon excludes the upstream, a separate process).

    .venv/bin/python scripts/bench_h3.py                 # both servers, both request kinds
    .venv/bin/python scripts/bench_h3.py --requests 4000 --concurrency 32
    .venv/bin/python scripts/bench_h3.py --bare-server 4433   # (internal) run the bare server

The bare server is the floor: it sends each response as HEADERS plus one DATA frame with FIN,
from memory, with no request parsing beyond aioquic's, no upstream hop and no logging.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import serve as quic_serve
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ProtocolNegotiated, QuicEvent

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.canned_upstream import JSON_BODY, NUM_EVENTS
from bench.procs import ProcessGroup, cpu_seconds, start_listening

from pylon.tls import self_signed_material

SSE_BODY = (
    b"".join(
        b"data: "
        + json.dumps(
            {
                "id": "chatcmpl-bench",
                "object": "chat.completion.chunk",
                "model": "mock-model",
                "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
        for i in range(NUM_EVENTS)
    )
    + b"data: [DONE]\n\n"
)
REQUEST = json.dumps(
    {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
).encode()
STREAM_REQUEST = REQUEST[:-1] + b', "stream": true}'


# --- the bare server -------------------------------------------------------------------------
class BareServer(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._http: H3Connection | None = None
        self._stream: dict[int, bool] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            self._http = H3Connection(self._quic)
        if self._http is not None:
            for h3_event in self._http.handle_event(event):
                self._answer(h3_event)

    def _answer(self, event: H3Event) -> None:
        assert self._http is not None
        if isinstance(event, DataReceived) and event.data:
            self._stream[event.stream_id] = b'"stream": true' in event.data
        if not isinstance(event, HeadersReceived | DataReceived) or not event.stream_ended:
            return
        stream = self._stream.pop(event.stream_id, False)
        body, kind = (
            (SSE_BODY, b"text/event-stream") if stream else (JSON_BODY, b"application/json")
        )
        self._http.send_headers(event.stream_id, [(b":status", b"200"), (b"content-type", kind)])
        self._http.send_data(event.stream_id, body, end_stream=True)
        self.transmit()


async def run_bare(port: int) -> None:
    material = self_signed_material()
    configuration = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    configuration.certificate = material.certificate
    configuration.private_key = material.private_key
    configuration.max_data = 16 * 1024 * 1024
    configuration.max_stream_data = 4 * 1024 * 1024
    await quic_serve("127.0.0.1", port, configuration=configuration, create_protocol=BareServer)
    print(f"bare-h3 listening on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


# --- the load client -------------------------------------------------------------------------
class LoadClient(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self._waiters: dict[int, tuple[asyncio.Future[int], list[int]]] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.http.handle_event(event):
            entry = self._waiters.get(getattr(h3_event, "stream_id", -1))
            if entry is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                entry[1][0] = int(dict(h3_event.headers)[b":status"])
            elif isinstance(h3_event, DataReceived):
                entry[1][1] += h3_event.data.count(b"data: {")
            if getattr(h3_event, "stream_ended", False):
                del self._waiters[h3_event.stream_id]
                entry[0].set_result(entry[1][0])

    async def post(self, stream: bool) -> tuple[int, int]:
        body = STREAM_REQUEST if stream else REQUEST
        sid = self._quic.get_next_available_stream_id()
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        state = [0, 0]
        self._waiters[sid] = (future, state)
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":authority", b"localhost"),
            (b":path", b"/v1/chat/completions"),
            (b"x-request-id", b"bench-%d" % sid),
            (b"x-model", b"mock-model"),
            (b"content-type", b"application/json"),
        ]
        self.http.send_headers(sid, headers)
        self.http.send_data(sid, body, end_stream=True)
        self.transmit()
        return await future, state[1]


async def load(port: int, requests: int, concurrency: int, stream: bool) -> dict[str, Any]:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.verify_mode = ssl.CERT_NONE
    configuration.max_data = 64 * 1024 * 1024
    configuration.max_stream_data = 4 * 1024 * 1024
    latencies: list[float] = []
    tokens = errors = 0
    async with connect(
        "127.0.0.1", port, configuration=configuration, create_protocol=LoadClient
    ) as client:
        assert isinstance(client, LoadClient)
        queue = iter(range(requests))

        async def worker() -> None:
            nonlocal tokens, errors
            for _ in queue:
                started = time.perf_counter()
                status, seen = await client.post(stream)
                latencies.append(time.perf_counter() - started)
                tokens += seen
                errors += status != 200

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "requests": requests,
        "errors": errors,
        "tokens": tokens,
        "rps": requests / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


def measure(pid: int, port: int, args: argparse.Namespace, stream: bool) -> dict[str, Any]:
    uvloop.run(load(port, max(args.requests // 10, 50), args.concurrency, stream))  # warm-up
    before = cpu_seconds(pid)
    result = uvloop.run(load(port, args.requests, args.concurrency, stream))
    cpu_us = (cpu_seconds(pid) - before) * 1e6
    result["cpu_us_per_req"] = cpu_us / args.requests
    result["cpu_us_per_token"] = cpu_us / result["tokens"] if result["tokens"] else None
    return result


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_servers(group: ProcessGroup, workdir: Path) -> dict[str, tuple[int, int]]:
    """name -> (pid, udp port) for the bare server and pylon (plus pylon's canned upstream)."""
    here = Path(__file__).resolve().parent
    python = sys.executable
    upstream, up_port = start_listening(group, [python, str(here / "bench/canned_upstream.py")])
    bare_port = free_udp_port()
    bare, _ = start_listening(group, [python, __file__, "--bare-server", str(bare_port)])
    quic_port = free_udp_port()
    pylon_argv = [
        str(Path(python).parent / "pylon"),
        "serve",
        "--listen", "127.0.0.1:0",
        "--quic-listen", f"127.0.0.1:{quic_port}",
        "--no-quic-retry",
        "--upstream", f"http://127.0.0.1:{up_port}",
        "--backend", "dynamo",
        "--model", "mock-model",  # the canned upstream lists no models: a static set
        "--log-level", "warning",
        "--admin-listen", "127.0.0.1:0",  # metrics on, and no fixed port to collide on
    ]  # fmt: skip
    pylon = group.start(pylon_argv, workdir / "pylon.log")
    time.sleep(1.5)  # pylon logs JSON, not the "listening on" line start_listening waits for
    if pylon.poll() is not None:
        raise RuntimeError((workdir / "pylon.log").read_text())
    del upstream
    return {"bare-aioquic": (bare.pid, bare_port), "pylon": (pylon.pid, quic_port)}


def report(results: dict[tuple[str, str], dict[str, Any]]) -> None:
    print(
        f"{'server':14} {'kind':6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU us/req':>11} {'CPU us/token':>13} {'errors':>6}"
    )
    for (name, kind), r in results.items():
        per_token = f"{r['cpu_us_per_token']:.1f}" if r["cpu_us_per_token"] else "-"
        print(
            f"{name:14} {kind:6} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
            f"{r['cpu_us_per_req']:11.0f} {per_token:>13} {r['errors']:6d}"
        )
    for kind in ("small", "sse"):
        ratio = (
            results[("pylon", kind)]["cpu_us_per_req"]
            / results[("bare-aioquic", kind)]["cpu_us_per_req"]
        )
        print(f"pylon / bare CPU per request ({kind}): {ratio:.2f}x (target <= 1.3x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--bare-server", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/pylon-bench-h3"))
    args = ap.parse_args()
    if args.bare_server is not None:
        uvloop.run(run_bare(args.bare_server))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup()
    try:
        servers = start_servers(group, args.workdir)
        results = {}
        for name, (pid, port) in servers.items():
            for kind in ("small", "sse"):
                results[(name, kind)] = measure(pid, port, args, stream=kind == "sse")
        report(results)
    finally:
        group.close()


if __name__ == "__main__":
    try:
        main()
    except subprocess.SubprocessError as exc:
        raise SystemExit(str(exc)) from None

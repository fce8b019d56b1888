"""HTTP/3 benchmark: a bare aioquic HTTP/3 server answering canned responses vs pylon over HTTP/3
in front of the canned HTTP/1.1 upstream (scripts/bench/canned_upstream.py).

`--connections` QUIC connections per run (default one; each from its own UDP source port) with
`--concurrency` streams in flight over all of them, small non-streaming requests and SSE streams
(20 events). Reports req/s, latency p50/p99 (client side) and the server's CPU-us per request and
per relayed token (utime+stime from /proc/<pid>/stat of the server and every process under it,
so a supervisor's children count; pylon's upstream is a separate process and does not).

    .venv/bin/python scripts/bench_h3.py                 # both servers, both request kinds
    .venv/bin/python scripts/bench_h3.py --requests 4000 --concurrency 32
    .venv/bin/python scripts/bench_h3.py --only pylon --kinds small --connections 1 4
    .venv/bin/python scripts/bench_h3.py --only pylon --processes 2 --connections 1 4
    .venv/bin/python scripts/bench_h3.py --address 127.0.0.1:4433 --connections 1 4  # no CPU
    .venv/bin/python scripts/bench_h3.py --bare-server 4433   # (internal) run the bare server

The kernel steers each QUIC connection to one process of a `SO_REUSEPORT` group by its address
hash, so one client connection uses one pylon process whatever `--processes` says: the 1 and 4
connection rows show what several gateway connections buy (docs/operations.md, "HTTP/3 with
several processes").

The bare server is the floor: it sends each response as HEADERS plus one DATA frame with FIN,
from memory, with no request parsing beyond aioquic's, no upstream hop and no logging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


async def load(
    address: tuple[str, int], requests: int, concurrency: int, stream: bool, connections: int = 1
) -> dict[str, Any]:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.verify_mode = ssl.CERT_NONE
    configuration.max_data = 64 * 1024 * 1024
    configuration.max_stream_data = 4 * 1024 * 1024
    latencies: list[float] = []
    tokens = errors = 0
    async with contextlib.AsyncExitStack() as stack:
        clients: list[LoadClient] = []
        for _ in range(connections):  # each connect() binds its own UDP socket: its own port
            client = await stack.enter_async_context(
                connect(*address, configuration=configuration, create_protocol=LoadClient)
            )
            assert isinstance(client, LoadClient)
            clients.append(client)
        queue = iter(range(requests))

        async def worker(client: LoadClient) -> None:
            nonlocal tokens, errors
            for _ in queue:
                started = time.perf_counter()
                status, seen = await client.post(stream)
                latencies.append(time.perf_counter() - started)
                tokens += seen
                errors += status != 200

        began = time.perf_counter()
        await asyncio.gather(*(worker(clients[i % connections]) for i in range(concurrency)))
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


def measure(
    pid: int | None,
    address: tuple[str, int],
    args: argparse.Namespace,
    stream: bool,
    connections: int,
) -> dict[str, Any]:
    """One row; `pid` None (a server started elsewhere): no CPU columns."""
    warm_up = max(args.requests // 10, 50)
    uvloop.run(load(address, warm_up, args.concurrency, stream, connections))
    before = tree_cpu_seconds(pid) if pid is not None else 0.0
    result = uvloop.run(load(address, args.requests, args.concurrency, stream, connections))
    result["connections"] = connections
    if pid is None:
        result["cpu_us_per_req"] = result["cpu_us_per_token"] = None
        return result
    cpu_us = (tree_cpu_seconds(pid) - before) * 1e6
    result["cpu_us_per_req"] = cpu_us / args.requests
    result["cpu_us_per_token"] = cpu_us / result["tokens"] if result["tokens"] else None
    return result


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and every process under it (a supervisor and its children):
    `bench.procs.cpu_seconds` walks the tree itself."""
    with contextlib.suppress(OSError):
        return cpu_seconds(pid)
    return 0.0


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_servers(
    group: ProcessGroup, workdir: Path, only: str | None, processes: int, log_level: str
) -> dict[str, tuple[int, int]]:
    """name -> (pid, udp port) for the bare server and pylon (plus pylon's canned upstream)."""
    python = sys.executable
    servers = {}
    if only in (None, "bare"):
        bare_port = free_udp_port()
        bare, _ = start_listening(group, [python, __file__, "--bare-server", str(bare_port)])
        servers["bare-aioquic"] = (bare.pid, bare_port)
    if only in (None, "pylon"):
        servers["pylon"] = start_pylon(group, workdir, processes, log_level)
    return servers


def start_pylon(
    group: ProcessGroup, workdir: Path, processes: int, log_level: str = "info"
) -> tuple[int, int]:
    """pylon over HTTP/3; `log_level` info: its access log on (a `request_done` line per
    request, to the log file), as in production."""
    here = Path(__file__).resolve().parent
    python = sys.executable
    upstream, up_port = start_listening(group, [python, str(here / "bench/canned_upstream.py")])
    quic_port = free_udp_port()
    pylon_argv = [
        python, "-m", "pylon",  # the checkout's pylon (PYTHONPATH), not an installed one
        "serve",
        "--listen", "127.0.0.1:0",
        "--quic-listen", f"127.0.0.1:{quic_port}",
        "--no-quic-retry",
        "--upstream", f"http://127.0.0.1:{up_port}",
        "--backend", "dynamo",
        "--model", "mock-model",  # the canned upstream lists no models: a static set
        "--log-level", log_level,
        "--admin-listen", "127.0.0.1:0",  # metrics on, and no fixed port to collide on
    ]  # fmt: skip
    if processes > 1:
        pylon_argv += ["--processes", str(processes)]
    log = workdir / "pylon.log"
    pylon = group.start(pylon_argv, log)
    # Each process writes its `ready` line (a start line: at any --log-level) once it serves.
    deadline = time.monotonic() + 30
    while log.read_text(errors="replace").count('"event":"ready"') < processes:
        if pylon.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pylon did not get ready: {log.read_text(errors='replace')}")
        time.sleep(0.1)
    del upstream
    return pylon.pid, quic_port


def supports_processes() -> bool:
    """Whether this checkout's `pylon serve` has `--processes` (issue 18's supervisor)."""
    shown = subprocess.run(
        [sys.executable, "-m", "pylon", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return "--processes" in shown.stdout


Row = tuple[str, str, int]  # (server, kind, connections)


def report(rounds: list[dict[Row, dict[str, Any]]], processes: int) -> None:
    """Every round's rows, then per (kind, connections) the pylon / bare ratio of each round
    (both measured in that round) and their median."""
    print(f"pylon processes: {processes}")
    print(
        f"{'round':>5} {'server':14} {'kind':6} {'conns':>5} {'req/s':>8} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'CPU us/req':>11} {'CPU us/token':>13} {'errors':>6}"
    )
    for number, results in enumerate(rounds, 1):
        for (name, kind, connections), r in results.items():
            per_req = f"{r['cpu_us_per_req']:.0f}" if r["cpu_us_per_req"] is not None else "-"
            per_token = f"{r['cpu_us_per_token']:.1f}" if r["cpu_us_per_token"] else "-"
            print(
                f"{number:5d} {name:14} {kind:6} {connections:5d} {r['rps']:8.0f} "
                f"{r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {per_req:>11} {per_token:>13} "
                f"{r['errors']:6d}"
            )
    for name, kind, connections in rounds[0]:
        if name != "pylon" or ("bare-aioquic", kind, connections) not in rounds[0]:
            continue
        ratios = [
            results[(name, kind, connections)]["cpu_us_per_req"]
            / results[("bare-aioquic", kind, connections)]["cpu_us_per_req"]
            for results in rounds
        ]
        each = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        print(
            f"pylon / bare CPU per request ({kind}, {connections} conn): median "
            f"{statistics.median(ratios):.2f}x (rounds: {each}; target <= 1.00x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32, help="streams in flight, in all")
    ap.add_argument(
        "--connections", type=int, nargs="+", default=[1], help="QUIC connections (one row each)"
    )
    ap.add_argument("--processes", type=int, default=1, help="passed to `pylon serve --processes`")
    ap.add_argument("--only", choices=("pylon", "bare"), default=None, help="one server")
    ap.add_argument("--kinds", nargs="+", choices=("small", "sse"), default=["small", "sse"])
    ap.add_argument("--address", default=None, help="HOST:PORT of an HTTP/3 server already running")
    ap.add_argument("--bare-server", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/pylon-bench-h3"))
    ap.add_argument(
        "--log-level", default="info", help="pylon's; info: its access log on (the default)"
    )
    ap.add_argument("--rounds", type=int, default=1, help="every row this many times, in turn")
    args = ap.parse_args()
    if args.bare_server is not None:
        uvloop.run(run_bare(args.bare_server))
        return
    if args.processes > 1 and args.address is None and not supports_processes():
        # A pylon from before issue 18 (measured for comparison) has no supervisor.
        raise SystemExit("--processes needs `pylon serve --processes` (issue 18's supervisor)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup()
    try:
        if args.address is not None:
            host, _, port = args.address.rpartition(":")
            targets: dict[str, tuple[int | None, tuple[str, int]]] = {
                args.address: (None, (host.strip("[]"), int(port)))
            }
        else:
            started = start_servers(group, args.workdir, args.only, args.processes, args.log_level)
            targets = {name: (pid, ("127.0.0.1", port)) for name, (pid, port) in started.items()}
        rounds: list[dict[Row, dict[str, Any]]] = []
        for _ in range(args.rounds):  # the servers in turn within each round
            results: dict[Row, dict[str, Any]] = {}
            for kind in args.kinds:
                for connections in args.connections:
                    for name, (pid, address) in targets.items():
                        results[(name, kind, connections)] = measure(
                            pid, address, args, kind == "sse", connections
                        )
            rounds.append(results)
        report(rounds, args.processes)
    finally:
        group.close()


if __name__ == "__main__":
    try:
        main()
    except subprocess.SubprocessError as exc:
        raise SystemExit(str(exc)) from None

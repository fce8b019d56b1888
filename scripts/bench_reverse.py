"""HTTP/3 over the reverse tunnel beside direct mode: pylon's CPU per request, req/s, p50/p99.

Two pylons in front of one canned HTTP/1.1 upstream (scripts/bench/canned_upstream.py), both
with `--model mock-model` (a static set: no discovery), `--canary-interval 0` and the same
`--log-level` (default `info`: the access log, one `request_done` line per request, is on;
scripts/bench_h3.py runs pylon at `warning`, which turns it off; pass `--log-level warning`
for its setting):

* direct: `pylon serve --quic-listen 127.0.0.1:PORT ...`, driven by scripts/bench_h3.py's
  HTTP/3 load client (aioquic's `H3Connection`, one QUIC connection);
* reverse: `pylon serve --gateway <gRPC stand-in> --connectivity reverse --tunnel-connections 1
  --gateway-ca <CA> ...`; this process runs the stand-in gateway (tests/gateway/stand_in_grpc.py,
  whose acks name tests/gateway/stand_in_quic.py's tunnel listener) and sends the same requests,
  at the same concurrency, as role-reversed HTTP/3 requests on the one tunnel pylon dialled.
  The registration interval is pylon's default (1 s); its snapshots fall inside the window.

Each row: a warm-up of max(requests/10, 50), then `--requests` requests with `--concurrency`
streams in flight; pylon's CPU is utime+stime from /proc (pylon and its children,
scripts/bench/procs.py) around the measured part. The load side's own CPU (this process, all its
threads: the client, and in reverse mode the stand-in gateway) is shown too: a `busy` near 100%
means the load side, not pylon, limits req/s (pylon's CPU per request still holds).
Rows interleave: every round runs direct then reverse for each kind.

    .venv/bin/python scripts/bench_reverse.py                      # 2 rounds, small and sse
    .venv/bin/python scripts/bench_reverse.py --rounds 3 --requests 4000 --kinds small
    .venv/bin/python scripts/bench_reverse.py --log-level warning  # access log off
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.procs import ProcessGroup, cpu_seconds, start_listening
from bench_h3 import REQUEST, STREAM_REQUEST, free_udp_port, load

from tests.gateway.stand_in_grpc import StandInGrpc, gateway_info
from tests.gateway.stand_in_quic import GatewayConnection, StandInGateway

HERE = Path(__file__).resolve().parent
NODE = "bench"
PATH = "/v1/chat/completions"


# --- the load client over the tunnel ---------------------------------------------------------
async def load_reverse(
    connection: GatewayConnection, requests: int, concurrency: int, stream: bool
) -> dict[str, Any]:
    """bench_h3's `load`, with the stand-in gateway as the HTTP/3 client on the tunnel."""
    body = STREAM_REQUEST if stream else REQUEST
    latencies: list[float] = []
    tokens = errors = 0
    queue = iter(range(requests))

    async def worker() -> None:
        nonlocal tokens, errors
        for index in queue:
            headers = [
                ("x-request-id", f"bench-{index}"),
                ("x-model", "mock-model"),
                ("content-type", "application/json"),
            ]
            started = time.perf_counter()
            response = await connection.send_request("POST", PATH, headers, body).wait(30.0)
            latencies.append(time.perf_counter() - started)
            # The stand-in keeps every response for a test to read: drop it (bounded memory).
            connection._responses.pop(response.stream_id, None)
            tokens += response.body.count(b"data: {")
            errors += response.status != 200 or response.reset_code is not None

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


def udp_drops() -> int:
    """The host's UDP receive-buffer drops so far (/proc/net/snmp `RcvbufErrors`; host-wide):
    a drop on loopback is a QUIC loss, with its retransmission, for whichever side it hit."""
    names, values = (
        line.split()[1:]
        for line in Path("/proc/net/snmp").read_text().splitlines()
        if line.startswith("Udp:")
    )
    return int(dict(zip(names, values, strict=True))["RcvbufErrors"])


# --- the two pylons --------------------------------------------------------------------------
def pylon_argv(up_port: int, log_level: str) -> list[str]:
    return [
        sys.executable, "-m", "pylon",  # the checkout's pylon (PYTHONPATH), not an installed one
        "serve",
        "--listen", "127.0.0.1:0",
        "--upstream", f"http://127.0.0.1:{up_port}",
        "--backend", "dynamo",
        "--model", "mock-model",  # the canned upstream lists no models: a static set
        "--log-level", log_level,
        "--admin-listen", "127.0.0.1:0",  # metrics on, and no fixed port to collide on
        "--canary-interval", "0",
    ]  # fmt: skip


async def wait_ready(proc: Any, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while '"event":"ready"' not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"pylon did not get ready: {log.read_text(errors='replace')}")
        await asyncio.sleep(0.1)


class Bench:
    def __init__(self, args: argparse.Namespace, group: ProcessGroup, folder: Path) -> None:
        self.args = args
        self.group = group
        self.folder = folder
        self.pids: dict[str, int] = {}
        self.logs: dict[str, Path] = {}
        self.quic_port = 0
        self.grpc: StandInGrpc | None = None
        self.tunnel: StandInGateway | None = None

    async def start(self) -> None:
        args = self.args
        upstream_argv = [sys.executable, str(HERE / "bench/canned_upstream.py")]
        _, up_port = start_listening(self.group, upstream_argv)
        # direct
        self.quic_port = free_udp_port()
        direct_argv = [
            *pylon_argv(up_port, args.log_level),
            "--quic-listen", f"127.0.0.1:{self.quic_port}",
            "--no-quic-retry",
        ]  # fmt: skip
        self.logs["direct"] = self.folder / "pylon-direct.log"
        direct = self.group.start(direct_argv, self.logs["direct"])
        self.pids["direct"] = direct.pid
        # reverse: the stand-in gateway (gRPC control plane + tunnel listener) in this process
        tunnel_folder = self.folder / "gateway"
        tunnel_folder.mkdir(exist_ok=True)
        self.tunnel = await StandInGateway(tunnel_folder, {NODE: None}).start()
        self.grpc = StandInGrpc(ack_target=self.tunnel.address)
        await self.grpc.start()
        self.grpc.set_watch(gateways=[gateway_info(self.grpc.address)])
        reverse_argv = [
            *pylon_argv(up_port, args.log_level),
            "--gateway", self.grpc.address,
            "--inference-server-id", NODE,
            "--connectivity", "reverse",
            "--gateway-ca", str(self.tunnel.ca_path),
            "--tunnel-connections", "1",
        ]  # fmt: skip
        self.logs["reverse"] = self.folder / "pylon-reverse.log"
        reverse = self.group.start(reverse_argv, self.logs["reverse"])
        self.pids["reverse"] = reverse.pid
        await wait_ready(direct, self.logs["direct"])
        await wait_ready(reverse, self.logs["reverse"])
        await self.tunnel.wait_live(1, timeout=30.0)

    async def stop(self) -> None:
        if self.tunnel is not None:
            self.tunnel.close()
        if self.grpc is not None:
            await self.grpc.stop()

    async def drive(self, mode: str, requests: int, stream: bool) -> dict[str, Any]:
        concurrency = self.args.concurrency
        if mode == "direct":
            return await load(("127.0.0.1", self.quic_port), requests, concurrency, stream)
        assert self.tunnel is not None
        return await load_reverse(self.tunnel.connection(), requests, concurrency, stream)

    async def measure(self, mode: str, stream: bool) -> dict[str, Any]:
        requests = self.args.requests
        await self.drive(mode, max(requests // 10, 50), stream)
        pid = self.pids[mode]
        before, own_before, wall_before = cpu_seconds(pid), time.process_time(), time.monotonic()
        drops = udp_drops()
        result = await self.drive(mode, requests, stream)
        wall = time.monotonic() - wall_before
        own = time.process_time() - own_before
        result["cpu_us_per_req"] = (cpu_seconds(pid) - before) * 1e6 / requests
        result["load_cpu_us_per_req"] = own * 1e6 / requests
        result["load_busy"] = own / wall
        result["udp_drops"] = udp_drops() - drops
        return result

    async def idle_cpu(self, seconds: float) -> dict[str, float]:
        """Each pylon's CPU while nothing is sent (us/s): the reverse tunnel's keepalives and
        registration snapshots against the direct listener's nothing."""
        before = {mode: cpu_seconds(pid) for mode, pid in self.pids.items()}
        await asyncio.sleep(seconds)
        return {
            mode: (cpu_seconds(pid) - before[mode]) * 1e6 / seconds
            for mode, pid in self.pids.items()
        }


Row = tuple[int, str, str]  # (round, kind, mode)


def report(results: dict[Row, dict[str, Any]], idle: dict[str, float], bench: Bench) -> None:
    args = bench.args
    print(
        f"requests {args.requests}, concurrency {args.concurrency}, one QUIC connection, "
        f"pylon --log-level {args.log_level}"
    )
    print(f"idle pylon CPU: direct {idle['direct']:.0f} us/s, reverse {idle['reverse']:.0f} us/s")
    print(
        f"{'round':>5} {'kind':6} {'mode':8} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'pylon CPU us/req':>16} {'load CPU us/req':>15} {'load busy':>9} {'UDP drops':>9} "
        f"{'errors':>6}"
    )
    for (round_, kind, mode), r in results.items():
        print(
            f"{round_:5d} {kind:6} {mode:8} {r['rps']:7.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
            f"{r['cpu_us_per_req']:16.0f} {r['load_cpu_us_per_req']:15.0f} "
            f"{r['load_busy']:9.0%} {r['udp_drops']:9d} {r['errors']:6d}"
        )
    for kind in args.kinds:
        ratios = []
        for round_ in range(1, args.rounds + 1):
            direct, reverse = results[(round_, kind, "direct")], results[(round_, kind, "reverse")]
            ratios.append(reverse["cpu_us_per_req"] / direct["cpu_us_per_req"])
        means = {
            mode: statistics.mean(
                results[(round_, kind, mode)]["cpu_us_per_req"]
                for round_ in range(1, args.rounds + 1)
            )
            for mode in ("direct", "reverse")
        }
        print(
            f"reverse / direct pylon CPU per request ({kind}): "
            + ", ".join(f"{ratio:.2f}x" for ratio in ratios)
            + f"  (means {means['reverse']:.0f} / {means['direct']:.0f} us ="
            f" {means['reverse'] / means['direct']:.2f}x; target <= 1.10x)"
        )
    for mode, log in bench.logs.items():
        lines = log.read_text(errors="replace").count('"event":"request_done"')
        print(f"access-log lines ({mode}): {lines}")


async def run(args: argparse.Namespace, folder: Path) -> None:
    group = ProcessGroup()
    bench = Bench(args, group, folder)
    try:
        await bench.start()
        idle = await bench.idle_cpu(args.idle_seconds)
        results: dict[Row, dict[str, Any]] = {}
        for round_ in range(1, args.rounds + 1):
            for kind in args.kinds:
                for mode in ("direct", "reverse"):
                    results[(round_, kind, mode)] = await bench.measure(mode, kind == "sse")
        report(results, idle, bench)
    finally:
        await bench.stop()
        group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32, help="streams in flight")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved direct/reverse rounds")
    ap.add_argument("--kinds", nargs="+", choices=("small", "sse"), default=["small", "sse"])
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="idle CPU sample (s)")
    ap.add_argument("--workdir", type=Path, default=None, help="logs (default: a temp folder)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-rev-")))
        else:
            folder = args.workdir
            folder.mkdir(parents=True, exist_ok=True)
        uvloop.run(run(args, folder))


if __name__ == "__main__":
    main()

"""Repro: the first token of a cache hit through pylon in front of a real Dynamo 1.6.1 frontend.

Starts a `DynamoStack` (one frontend, `--workers` mockers timed by the bench's profile, so that a
cache hit's prefill takes ~4 ms), pylon `--routing off` in front of it, then N concurrent
closed-loop clients that repeat the same streaming chat completion (all hits after the first),
through pylon and directly to the frontend. Each client keeps one HTTP/1.1 connection and times,
per request, the response head (`HTTP/1.1 200`) and the first SSE `data:` line.

    PYTHONPATH=. .venv/bin/python scripts/repro_stall.py --clients 8 --requests 40
    PYTHONPATH=. .venv/bin/python scripts/repro_stall.py --tcpdump /tmp/stall.pcap

Everything binds to 127.0.0.1; the stack is started without KV-event ports, so nothing binds
other interfaces. `--tcpdump PATH` captures loopback during the runs (needs tcpdump and root),
`--hold S` keeps everything up S seconds before the runs (to attach strace / ss).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_routing import write_perf_profile  # noqa: E402
from dynamo_stack import DynamoStack  # noqa: E402
from procs import ProcessGroup, free_port  # noqa: E402

MODEL = "tiny"


def body(words: int) -> bytes:
    text = " ".join(f"word{i % 97} item{i % 13}" for i in range(words))
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 16,
            "stream": True,
        }
    ).encode()


def request_bytes(host: str, payload: bytes, rid: str) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
        f"x-request-id: {rid}\r\nx-model: {MODEL}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode() + payload


async def client(
    host: str,
    port: int,
    payload: bytes,
    n: int,
    out: list[tuple[float, float, float]],
    quickack: bool = False,
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    try:
        for i in range(n):
            raw = request_bytes(f"{host}:{port}", payload, f"r{id(out)}-{id(writer)}-{i}")
            started = time.perf_counter()
            writer.write(raw)
            head = first = 0.0
            buf = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError(f"closed after {buf[:600]!r} ... {buf[-200:]!r}")
                now = time.perf_counter()
                if quickack:  # acknowledge what was read at once (no delayed ACK)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
                buf += data
                if not head and b"\r\n\r\n" in buf:
                    head = now
                if head and not first and b"data:" in buf:
                    first = now
                if buf.endswith(b"0\r\n\r\n"):
                    break
            out.append((head - started, first - started, time.perf_counter() - started))
    finally:
        writer.close()


async def run(
    host: str, port: int, payload: bytes, clients: int, n: int, quickack: bool = False
) -> list[tuple[float, ...]]:
    out: list[tuple[float, float, float]] = []
    await asyncio.gather(*(client(host, port, payload, n, out, quickack) for _ in range(clients)))
    return list(out)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


def report(label: str, rows: list[tuple[float, ...]]) -> dict[str, float]:
    heads = [r[0] for r in rows]
    firsts = [r[1] for r in rows]
    summary = {
        "head_p50": pct(heads, 0.5),
        "first_p50": pct(firsts, 0.5),
        "first_p90": pct(firsts, 0.9),
        "first_mean": statistics.fmean(firsts) * 1000.0,
        "stalled_40ms": sum(1 for f in firsts if f > 0.035) / len(firsts),
    }
    print(
        f"{label:>15}: n={len(rows)} head p50 {summary['head_p50']:.1f} ms | first data p50 "
        f"{summary['first_p50']:.1f} p90 {summary['first_p90']:.1f} mean "
        f"{summary['first_mean']:.1f} ms | >35 ms: {summary['stalled_40ms']:.0%}",
        flush=True,
    )
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=30, help="per client, per phase")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--words", type=int, default=400, help="prompt size (~2.5 tokens a word)")
    ap.add_argument("--model-dir", default="/tmp/stall-model")
    ap.add_argument("--tcpdump", default=None, help="write a loopback capture here")
    ap.add_argument("--hold", type=float, default=0.0)
    ap.add_argument(
        "--order",
        default="pylon,direct,direct-quickack,pylon,direct,direct-quickack",
        help="phases: pylon, direct (to the frontend), direct-quickack (the client sets "
        "TCP_QUICKACK after every read: the frontend without the delayed-ACK stall)",
    )
    ap.add_argument("--pylon-arg", action="append", default=[], help="extra pylon serve argument")
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="stall-"))
    profile = write_perf_profile(
        state / "profile.npz", ttft_ms=1.0, prefill_tokens_per_s=20000.0, itl_ms=2.0
    )
    stack = DynamoStack(
        num_workers=args.workers,
        speedup_ratio=1.0,
        router_mode="kv",
        router_queue_threshold=None,
        model_name=MODEL,
        model_dir=args.model_dir,
        state_dir=state / "dynamo",
        extra_mocker_args=["--planner-profile-data", str(profile)],
        num_gpu_blocks=4096,
        dyn_log="warn",
        startup_timeout_s=120.0,
    )
    group = ProcessGroup()
    try:
        stack.start()
        listen, admin = free_port(), free_port()
        pylon = [
            str(Path(sys.executable).parent / "pylon"), "serve",
            "--listen", f"127.0.0.1:{listen}", "--admin-listen", f"127.0.0.1:{admin}",
            "--upstream", stack.frontend_url, "--backend", "dynamo", "--routing", "off",
            "--log-level", "warning", *args.pylon_arg,
        ]  # fmt: skip
        group.start(pylon, state / "pylon.log")
        _wait(f"http://127.0.0.1:{admin}/ready")
        frontend_port = int(stack.frontend_url.rsplit(":", 1)[1])
        print(
            f"frontend 127.0.0.1:{frontend_port} pid {stack._procs[1].popen.pid}, pylon "
            f"127.0.0.1:{listen} pid {group._procs[0].pid}, state {state}",
            flush=True,
        )
        payload = body(args.words)
        asyncio.run(run("127.0.0.1", frontend_port, payload, 1, 2))  # warm the cache
        if args.hold:
            time.sleep(args.hold)
        dump = None
        if args.tcpdump:
            dump = subprocess.Popen(
                ["tcpdump", "-i", "lo", "-nn", "-s", "200", "-w", args.tcpdump,
                 f"tcp port {frontend_port} or tcp port {listen}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(1.0)
        results: dict[str, list[dict[str, float]]] = {}
        for phase in args.order.split(","):
            port = listen if phase.startswith("pylon") else frontend_port
            quickack = phase.endswith("-quickack")
            rows = asyncio.run(
                run("127.0.0.1", port, payload, args.clients, args.requests, quickack)
            )
            results.setdefault(phase, []).append(report(phase, rows))
        if dump is not None:
            time.sleep(0.5)
            dump.terminate()
            dump.wait(5)
        print(json.dumps(results))
    finally:
        group.close()
        stack.stop()
    return 0


def _wait(url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

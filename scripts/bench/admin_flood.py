"""Admin-port floods: how long pipelined `GET /metrics` that are never read hold pylon's event
loop, and how much memory they make it keep (issue 17, section 3).

pylon runs in this process (`pylon.run.start`, with its embedded mock engine) next to a loop
probe (a task that sleeps 1 ms in a loop and records how late it wakes: what a tunnel stream
waiting for its turn sees). `--clients` threads each open one admin connection, write
`--requests` pipelined `GET /metrics` in one `sendall` (2,000 are ~68 KB), never read, hold
the connection `--hold` seconds, then close it. Printed: the longest loop gap during the flood,
the resident memory before, at its peak (sampled by a thread every 20 ms), and 1 s after the
clients closed.

    PYTHONPATH=. .venv/bin/python scripts/bench/admin_flood.py
    PYTHONPATH=OLD_TREE .venv/bin/python scripts/bench/admin_flood.py   # a tree from before
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
from pathlib import Path

# This folder holds a `router_ffi.py` of its own: keep it off the path (pylon imports the package).
HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p).resolve() != HERE]

from pylon.run import start  # noqa: E402
from pylon.settings import load_settings  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE / 2**20


def flood(host: str, port: int, requests: int, hold: float, done: threading.Event) -> None:
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n" * requests)
        done.wait(hold)


async def main(clients: int, requests: int, hold: float) -> None:
    settings = load_settings(
        {"listen": "127.0.0.1:0", "quic_listen": None, "admin_listen": "127.0.0.1:0"}
    )
    async with start(settings) as running:
        assert running.admin_url is not None
        host, port = running.admin_url.removeprefix("http://").rsplit(":", 1)
        loop = asyncio.get_running_loop()
        gaps: list[float] = []
        stop = asyncio.Event()

        async def probe() -> None:
            while not stop.is_set():
                before = loop.time()
                await asyncio.sleep(0.001)
                gaps.append(loop.time() - before - 0.001)

        probing = asyncio.create_task(probe())
        await asyncio.sleep(0.3)
        idle_gap = max(gaps)
        before = rss_mib()
        gaps.clear()
        done = threading.Event()
        threads = [
            threading.Thread(target=flood, args=(host, int(port), requests, hold, done))
            for _ in range(clients)
        ]
        for thread in threads:
            thread.start()
        peaks = [before]

        def sample() -> None:  # off the loop: a loop held by the flood still gets measured
            while not done.wait(0.02):
                peaks.append(rss_mib())

        sampler = threading.Thread(target=sample)
        sampler.start()
        await asyncio.sleep(hold)
        flood_gap = max(gaps)
        done.set()
        for thread in [*threads, sampler]:
            await asyncio.to_thread(thread.join)
        peak = max(peaks)
        await asyncio.sleep(1.0)
        after = rss_mib()
        stop.set()
        await probing
    print(
        f"{clients} clients x {requests} pipelined GET /metrics, never read, held {hold:g} s: "
        f"longest loop gap {flood_gap * 1000:.1f} ms (idle {idle_gap * 1000:.1f} ms); "
        f"RSS {before:.0f} MiB before, {peak:.0f} MiB peak, {after:.0f} MiB after they closed"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--hold", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(main(args.clients, args.requests, args.hold))

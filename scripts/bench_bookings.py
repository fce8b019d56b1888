"""Exact bookings across local processes: the race and the cost, measured on real processes.

For each number of processes P and total arrival rate R, two ways to book:

* `exact`: one booking authority (`pylon.routing.authority`, its own process) and P serving
  processes booking there over its Unix socket (`RemoteRouter`), as `pylon serve --processes P`
  runs them;
* `alone`: P processes each booking on its own (a single pylon's routing parts each, no
  sharing): what P processes do without the authority.

Each process is a `tests.booking_processes client`: it books R/P times a second (paced from one
shared start time), never releasing (no frees, distinct prompts: the issue's race setup), for
`--seconds`. A *mis-pick* is a choice that is not the least-loaded worker given every earlier
booking by any process: replayed from the authority's journal (its order is the truth) for
`exact`, and from the processes' answer times (`time.monotonic()`, one clock for the host) for
`alone`. Reported: selections, mis-pick fraction, and each booking's round trip as the serving
process waits for it (p50 / p99: for `exact` the socket round trip and the authority's choice,
for `alone` the local choice), and the bookings made locally because the authority did not
answer in time (should be 0).

    PYTHONPATH=. .venv/bin/python scripts/bench_bookings.py                 # 2, 4 x 1000, 3000/s
    PYTHONPATH=. .venv/bin/python scripts/bench_bookings.py --processes 2 --rates 500 --seconds 1
    PYTHONPATH=. .venv/bin/python scripts/bench_bookings.py --mode kv --dynamo  # exact, real core

`--mode round-robin` reports the fairness instead (the spread of bookings over the workers);
`--mode kv` runs `exact` only (each `alone` process would need a selection core of its own), on
the stand-in core unless `--dynamo` (Dynamo's own, `ai-dynamo-runtime`). Everything is on this
host: a Unix socket in a private temporary directory; every process is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 60.0


async def spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.booking_processes",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=ROOT,
        limit=64 * 1024 * 1024,  # a run answers with every booking on one line
    )


async def line(proc: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    async with asyncio.timeout(timeout):
        raw = await proc.stdout.readline()
    if not raw:
        raise RuntimeError("a benchmark process ended")
    answer: dict[str, Any] = json.loads(raw)
    return answer


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


def mis_picks(books: list[str], workers: list[str]) -> int:
    """Choices, in order, that were not least loaded given every earlier one (no frees)."""
    load = dict.fromkeys(workers, 0)
    wrong = 0
    for worker in books:
        if load[worker] != min(load.values()):
            wrong += 1
        load[worker] += 1
    return wrong


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def cell(args: argparse.Namespace, processes: int, rate: int, variant: str) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="pylon-bench-book-"))
    socket_path = directory / "run" / "bookings.sock"
    journal = directory / "journal"
    workers = [f"url=http://127.0.0.1:{9 + index}" for index in range(args.workers)]
    if args.mode == "kv":
        workers = [f"{spec},kv-events=tcp://127.0.0.1:9" for spec in workers]
    labels = [spec.split(",")[0].removeprefix("url=") for spec in workers]
    common = ["--mode", args.mode, *[f"--worker={spec}" for spec in workers]]
    procs: list[asyncio.subprocess.Process] = []
    try:
        if variant == "exact":
            extra = ["--dynamo"] if args.dynamo else []
            authority = await spawn(
                "authority",
                "--socket",
                str(socket_path),
                "--journal",
                str(journal),
                *common,
                *extra,
            )
            procs.append(authority)
            await line(authority, START_TIMEOUT)
            client_args = ["client", "--socket", str(socket_path), *common]
        else:
            client_args = ["client", "--alone", *common]
        clients = [await spawn(*client_args) for _ in range(processes)]
        procs += clients
        for client in clients:
            await line(client, START_TIMEOUT)
        count = max(1, int(rate * args.seconds / processes))
        start_at = time.monotonic() + 0.5
        for index, client in enumerate(clients):
            command = {
                "op": "run",
                "count": count,
                "seed": index,
                "hold": 1.0,
                "rate": rate / processes,
                "start_at": start_at,
            }
            assert client.stdin is not None
            client.stdin.write(json.dumps(command).encode() + b"\n")
        runs = [await line(client, args.seconds * 10 + 30) for client in clients]
    finally:
        for proc in reversed(procs):
            await stop(proc)
    seconds = [s for run in runs for s in run["seconds"]]
    if variant == "exact":
        events = [text.split() for text in journal.read_text().splitlines()]
        books = [event[3] for event in events if event[0] == "book"]
    else:
        timed = [
            (at, booked[1])
            for run in runs
            for at, booked in zip(run["at"], run["booked"], strict=True)
            if booked is not None
        ]
        books = [worker for _, worker in sorted(timed)]
    elapsed = max(a for run in runs for a in run["at"]) - start_at
    return {
        "processes": processes,
        "rate": rate,
        "variant": variant,
        "selections": len(books),
        "achieved_per_s": round(len(books) / elapsed) if elapsed > 0 else None,
        "mis_pick_pct": round(100 * mis_picks(books, labels) / max(1, len(books)), 2),
        "spread": {label: books.count(label) for label in labels},
        "p50_ms": round(1000 * statistics.median(seconds), 3),
        "p99_ms": round(1000 * percentile(seconds, 0.99), 3),
        "local_bookings": sum(run["counters"]["local_bookings"] for run in runs),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", default="2,4", help="comma-separated")
    parser.add_argument("--rates", default="1000,3000", help="total selections/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--mode", default="least-loaded", choices=("least-loaded", "round-robin", "kv")
    )
    parser.add_argument("--dynamo", action="store_true", help="kv: Dynamo's own selection core")
    parser.add_argument("--json", action="store_true", help="one JSON object a row")
    args = parser.parse_args()
    variants = ["exact"] if args.mode == "kv" else ["exact", "alone"]
    rows = []
    for processes in (int(p) for p in args.processes.split(",")):
        for rate in (int(r) for r in args.rates.split(",")):
            for variant in variants:
                row = await cell(args, processes, rate, variant)
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print(
            f"{'procs':>5} {'rate/s':>6} {'variant':>7} {'n':>6} {'got/s':>6} "
            f"{'mis-pick':>8} {'p50 ms':>7} {'p99 ms':>7} {'local':>5}"
        )
        for row in rows:
            print(
                f"{row['processes']:>5} {row['rate']:>6} {row['variant']:>7} "
                f"{row['selections']:>6} {row['achieved_per_s']!s:>6} "
                f"{row['mis_pick_pct']:>7}% {row['p50_ms']:>7} {row['p99_ms']:>7} "
                f"{row['local_bookings']:>5}"
            )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    asyncio.run(main())

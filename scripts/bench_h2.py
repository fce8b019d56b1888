"""HTTP/2 vs HTTP/1.1 through pylon, side by side, in front of the canned upstream.

pylon (one process, `pylon serve`, uvloop) listens on one TCP port for both protocols; the
canned HTTP/1.1 upstream (scripts/bench/canned_upstream.py) answers from memory. Each row runs a
load generator for `--duration` seconds after a `--warmup`:

* `h1 wrk c32`       wrk -t1 -c32 (the scripts/bench_proxies.py setup), for reference
* `h1 h2load c32`    h2load --h1 -c32: the same client as the HTTP/2 rows
* `h2 h2load c1 m32` h2c prior knowledge, one connection, 32 concurrent streams
* `h2 h2load c4 m8`  four connections, 8 streams each

for small non-streaming requests (~1 KB JSON) and SSE streams (20 events). Reported: req/s,
p50/p99 latency (wrk's, or from h2load's per-request --log-file), and pylon's CPU-us per request
(utime+stime from /proc/<pid>/stat around the measured run; the upstream is another process).

    .venv/bin/python scripts/bench_h2.py
    .venv/bin/python scripts/bench_h2.py --duration 3 --warmup 1 --json-out h2.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from loadgen import H2Load, h2_probe, probe, run_h2load, run_wrk
from procs import ProcessGroup, cpu_seconds, free_port, start_listening, wait_port
from proxies import pylon_spec

TOKENS_PER_STREAM = 20


@dataclass(frozen=True)
class Load:
    label: str
    tool: str  # "wrk" or "h2load"
    h1: bool
    clients: int
    streams: int  # concurrent streams per connection (h2load -m)


LOADS = (
    Load("h1 wrk c32", "wrk", True, 32, 1),
    Load("h1 h2load c32", "h2load", True, 32, 1),
    Load("h2 h2load c1 m32", "h2load", False, 1, 32),
    Load("h2 h2load c4 m8", "h2load", False, 4, 8),
)


@dataclass
class Row:
    mode: str
    load: str
    rps: float = 0.0
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests: int = 0
    failed: int = 0
    pylon_cpu_us_per_req: float | None = None
    status: str = "ok"


def run_load(args: argparse.Namespace, port: int, pid: int, load: Load, stream: bool) -> Row:
    workdir: Path = args.workdir

    def once(seconds: int) -> Row:
        if load.tool == "wrk":
            res = run_wrk(port, stream, seconds, load.clients)
            row = Row(mode="", load=load.label, rps=res.rps, requests=res.requests)
            row.p50_ms, row.p99_ms, row.failed = res.p50_ms, res.p99_ms, res.error_count
            return row
        try:
            load_of = H2Load(load.clients, load.streams, load.h1)
            res = run_h2load(port, stream, seconds, load_of, workdir)
        except RuntimeError as exc:
            return Row(mode="", load=load.label, status=f"FAILED: {exc}")
        row = Row(mode="", load=load.label, rps=res.rps, requests=res.requests)
        row.p50_ms, row.p99_ms, row.failed = res.p50_ms, res.p99_ms, res.error_count
        if row.failed:
            row.status = f"FAILED: {row.failed} non-2xx or errored requests"
        return row

    if args.warmup:
        once(args.warmup)
    before = cpu_seconds(pid)
    row = once(args.duration)
    used = cpu_seconds(pid) - before
    row.mode = "stream 20 SSE" if stream else "non-stream 1KB"
    if row.requests:
        row.pylon_cpu_us_per_req = used * 1e6 / row.requests
    return row


def markdown(rows: list[Row]) -> str:
    lines = [
        "| mode | load | req/s | p50 ms | p99 ms | pylon CPU-us/req | requests |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.mode} | {r.load} | {r.status[:80]} | | | | |")
            continue
        p50 = f"{r.p50_ms:.2f}" if r.p50_ms is not None else "-"
        p99 = f"{r.p99_ms:.2f}" if r.p99_ms is not None else "-"
        cpu = f"{r.pylon_cpu_us_per_req:.0f}" if r.pylon_cpu_us_per_req is not None else "-"
        lines.append(
            f"| {r.mode} | {r.load} | {r.rps:.0f} | {p50} | {p99} | {cpu} | {r.requests} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=8, help="seconds per measured run")
    ap.add_argument("--warmup", type=int, default=2, help="seconds of unmeasured warm-up")
    ap.add_argument("--json-out", type=Path)
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    for tool in ("h2load", "nghttp", "wrk"):
        if shutil.which(tool) is None:
            print(f"{tool} not installed (apt-get install nghttp2-client wrk)", file=sys.stderr)
            return 2
    args.workdir = Path(tempfile.mkdtemp(prefix="pylon-bench-h2-"))
    group = ProcessGroup()
    rows: list[Row] = []
    try:
        script = Path(__file__).resolve().parent / "bench" / "canned_upstream.py"
        _, up_port = start_listening(
            group, [sys.executable, str(script), "--port", "0", "--pace-ms", "0"]
        )
        port = free_port()
        spec = pylon_spec(port, up_port, args.workdir)
        pylon = group.start(spec.argv, args.workdir / "pylon.log")
        wait_port(pylon, port, spec.startup_timeout_s)
        for stream in (False, True):
            probe(port, stream)
            h2_probe(port, stream, args.workdir)
            for load in LOADS:
                row = run_load(args, port, pylon.pid, load, stream)
                print(f"  {row.mode:15} {row.load:17} {row.rps:8.0f} req/s  {row.status}",
                      file=sys.stderr, flush=True)  # fmt: skip
                rows.append(row)
    finally:
        group.close()
    print(markdown(rows))
    if args.json_out:
        doc = {"command": " ".join(sys.argv), "rows": [asdict(r) for r in rows]}
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 1 if any(r.status != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

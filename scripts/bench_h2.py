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
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from loadgen import PATH, body, probe, run_wrk
from procs import ProcessGroup, cpu_seconds, free_port, start_listening, wait_port
from proxies import pylon_spec

TOKENS_PER_STREAM = 20
_FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")
_REQUESTS = re.compile(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded")


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


def h2load_argv(
    port: int, load: Load, stream: bool, seconds: int, log: Path, data: Path
) -> list[str]:
    argv = [
        "h2load",
        f"-c{load.clients}",
        f"-m{load.streams}",
        "-t1",
        f"-D{seconds}",
        "-d",
        str(data),
        "-H",
        "content-type: application/json",
        "-H",
        "x-model: mock-model",
        "-H",
        "x-request-id: bench-h2",
        f"--log-file={log}",
    ]
    if load.h1:
        argv.append("--h1")
    return [*argv, f"http://127.0.0.1:{port}{PATH}"]


def run_h2load(port: int, load: Load, stream: bool, seconds: int, workdir: Path) -> Row:
    data = workdir / ("stream.json" if stream else "nonstream.json")
    data.write_bytes(body(stream))
    log = workdir / "h2load.log"
    log.unlink(missing_ok=True)
    argv = h2load_argv(port, load, stream, seconds, log, data)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    row = Row(mode="", load=load.label)
    finished, counts = _FINISHED.search(out.stdout), _REQUESTS.search(out.stdout)
    if out.returncode != 0 or finished is None or counts is None:
        row.status = f"FAILED: h2load rc={out.returncode}: {(out.stdout + out.stderr)[-300:]}"
        return row
    row.rps = float(finished.group(3))
    row.requests = int(counts.group(2))
    row.failed = int(counts.group(2)) - int(counts.group(3))
    durations = sorted(
        int(line.split("\t")[2]) for line in log.read_text().splitlines() if line.count("\t") >= 2
    )
    if durations:
        row.p50_ms = durations[len(durations) // 2] / 1e3
        row.p99_ms = durations[min(len(durations) - 1, int(len(durations) * 0.99))] / 1e3
    if row.failed:
        row.status = f"FAILED: {row.failed} non-2xx or errored requests"
    return row


def run_load(args: argparse.Namespace, port: int, pid: int, load: Load, stream: bool) -> Row:
    workdir: Path = args.workdir

    def once(seconds: int) -> Row:
        if load.tool == "wrk":
            res = run_wrk(port, stream, seconds, load.clients)
            row = Row(mode="", load=load.label, rps=res.rps, requests=res.requests)
            row.p50_ms, row.p99_ms, row.failed = res.p50_ms, res.p99_ms, res.error_count
            return row
        return run_h2load(port, load, stream, seconds, workdir)

    if args.warmup:
        once(args.warmup)
    before = cpu_seconds(pid)
    row = once(args.duration)
    used = cpu_seconds(pid) - before
    row.mode = "stream 20 SSE" if stream else "non-stream 1KB"
    if row.requests:
        row.pylon_cpu_us_per_req = used * 1e6 / row.requests
    return row


def h2_probe(port: int, stream: bool, workdir: Path) -> None:
    """One request over h2c with nghttp2's client: 200, and (SSE) terminated by [DONE]."""
    data = workdir / "probe.json"
    data.write_bytes(body(stream))
    argv = [
        "nghttp", "-H", "x-model: mock-model", "-H", "x-request-id: probe",
        "-H", "content-type: application/json", "-d", str(data),
        f"http://127.0.0.1:{port}{PATH}",
    ]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    if out.returncode != 0 or (stream and b"data: [DONE]" not in out.stdout):
        raise RuntimeError(f"h2 probe failed: {out.stdout[-200:]!r} {out.stderr[-200:]!r}")


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

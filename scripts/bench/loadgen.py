"""wrk driver and a one-shot correctness probe for the proxy benchmark."""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

LUA = Path(__file__).resolve().parent / "wrk_post.lua"
PATH = "/v1/chat/completions"


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]
    loadgen_cpu_s: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def wrk_bin() -> str:
    found = shutil.which("wrk")
    if not found:
        raise RuntimeError("wrk not installed (apt-get install -y wrk)")
    return found


def body(stream: bool) -> bytes:
    flag = "true" if stream else "false"
    return (
        '{"model":"mock-model","messages":[{"role":"user","content":"hi"}],'
        f'"stream":{flag},"max_tokens":20}}'
    ).encode()


def run_wrk(port: int, stream: bool, duration_s: int, connections: int) -> WrkResult:
    """Run wrk -t1 -cN against 127.0.0.1:port; parse the Lua done() JSON line."""
    argv = [
        wrk_bin(),
        "-t1",
        f"-c{connections}",
        f"-d{duration_s}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        f"http://127.0.0.1:{port}{PATH}",
    ]
    env = {**os.environ, "BENCH_STREAM": "1" if stream else "0"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=duration_s + 60, check=False
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed rc={proc.returncode}: {proc.stderr.strip()[-300:]}")
    data = json.loads(line.removeprefix("BENCH_JSON "))
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return WrkResult(
        requests=data["requests"],
        duration_s=data["duration_us"] / 1e6,
        p50_ms=data["p50_us"] / 1e3,
        p99_ms=data["p99_us"] / 1e3,
        errors=data["errors"],
        loadgen_cpu_s=cpu,
    )


def probe(port: int, stream: bool) -> int:
    """Send one request like wrk's; check 200 (+ SSE framing); return number of SSE data events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {
            "content-type": "application/json",
            "x-model": "mock-model",
            "x-request-id": "bench-probe",
        }
        conn.request("POST", PATH, body=body(stream), headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"probe got HTTP {resp.status}: {payload[:200]!r}")
    if not stream:
        json.loads(payload)
        return 0
    events = [ln for ln in payload.split(b"\n") if ln.startswith(b"data:")]
    if not events or events[-1].strip() != b"data: [DONE]":
        raise RuntimeError(f"probe stream not terminated by [DONE]: {payload[-200:]!r}")
    return len(events) - 1


_H2LOAD_FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")
_H2LOAD_REQUESTS = re.compile(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded")


@dataclass(frozen=True)
class H2Load:
    """An h2load load: `clients` connections of `streams` concurrent streams each (h2c, prior
    knowledge), or HTTP/1.1 (`h1`); `rps`: a fixed rate per connection (h2load --rps)."""

    clients: int
    streams: int = 1
    h1: bool = False
    rps: float | None = None


def run_h2load(port: int, stream: bool, seconds: int, load: H2Load, workdir: Path) -> WrkResult:
    """Run h2load (-t1) for `seconds` against 127.0.0.1:port; p50/p99 from its per-request
    log. Failed or non-2xx requests are counted in `errors`."""
    data = workdir / ("stream.json" if stream else "nonstream.json")
    data.write_bytes(body(stream))
    log = workdir / "h2load.log"
    log.unlink(missing_ok=True)
    argv = [
        "h2load", f"-c{load.clients}", f"-m{load.streams}", "-t1", f"-D{seconds}",
        "-d", str(data), "-H", "content-type: application/json",
        "-H", "x-model: mock-model", "-H", "x-request-id: bench-h2", f"--log-file={log}",
    ]  # fmt: skip
    if load.h1:
        argv.append("--h1")
    if load.rps is not None:
        argv.append(f"--rps={load.rps:g}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [*argv, f"http://127.0.0.1:{port}{PATH}"],
        capture_output=True, text=True, timeout=seconds + 60, check=False,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finished = _H2LOAD_FINISHED.search(out.stdout)
    counts = _H2LOAD_REQUESTS.search(out.stdout)
    if out.returncode != 0 or finished is None or counts is None:
        raise RuntimeError(f"h2load rc={out.returncode}: {(out.stdout + out.stderr)[-300:]}")
    done, succeeded = int(counts.group(2)), int(counts.group(3))
    durations = sorted(
        int(line.split("\t")[2]) for line in log.read_text().splitlines() if line.count("\t") >= 2
    )
    statuses = [line.split("\t")[1] for line in log.read_text().splitlines() if "\t" in line]
    bad = sum(1 for status in statuses if not status.startswith("2"))
    elapsed = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
    return WrkResult(
        requests=done,
        duration_s=elapsed,
        p50_ms=durations[len(durations) // 2] / 1e3 if durations else 0.0,
        p99_ms=durations[min(len(durations) - 1, int(len(durations) * 0.99))] / 1e3
        if durations
        else 0.0,
        errors={"failed": done - succeeded, "status": bad} if done - succeeded or bad else {},
        loadgen_cpu_s=(after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
    )


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

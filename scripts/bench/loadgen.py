"""wrk driver and a one-shot correctness probe for the proxy benchmark."""

from __future__ import annotations

import http.client
import json
import os
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

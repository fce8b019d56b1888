"""Side-by-side reverse-proxy benchmark: direct vs pylon vs nginx vs Envoy.

For every (upstream, mode) the upstream is started once, then each proxy is
started in front of it (one worker / one process each), probed for a correct
response, warmed up and measured with ``wrk -t1 -c32`` for a fixed duration.
The proxy's CPU (utime+stime of the process, all its threads and children,
from /proc) is sampled around the measured run and reported per request and
per relayed SSE token.

    .venv/bin/python scripts/bench_proxies.py --json-out bench.json
    .venv/bin/python scripts/bench_proxies.py --quick --proxies nginx,envoy
    .venv/bin/python scripts/bench_proxies.py --proxies direct,pylon,pylon@2 --modes nonstream

`pylon@N` is `pylon serve --processes N` (the CPU is the whole process tree's: supervisor and
processes).

Dimensions, each a comma list: `--protocols h1,h2c` (HTTP/1.1 by wrk; cleartext HTTP/2 by
h2load, one connection of 32 streams unless `--loads` says otherwise), `--logs on,off` (on: a
JSON access line per request to a file for every proxy, the same fields; off: pylon at
`warning`, nginx and Envoy without an access log), `--loads` (`c32`: wrk/h2load connections;
`c1m32`: h2c connections x streams; `r1000`: a fixed 1,000 requests/s, h2load over 10
connections), `--rounds N` (the whole set N times; the table gives per-round ratios' median and
range). `--sweep` = `--loads c1,c8,c32,c128,r1000,r5000 --protocols h1 --modes nonstream`.

    .venv/bin/python scripts/bench_proxies.py --protocols h1,h2c --logs on,off --rounds 3
    .venv/bin/python scripts/bench_proxies.py --sweep --proxies direct,pylon,envoy,nginx
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from loadgen import H2Load, WrkResult, h2_probe, probe, run_h2load, run_wrk
from procs import ProcessGroup, cpu_seconds, free_port, start_listening, wait_port
from proxies import SPEC_BUILDERS, Setup, envoy_bin, nginx_bin

TOKENS_PER_STREAM = 20
ALL_PROXIES = ("direct", "pylon", "nginx", "envoy")
# `pylon serve --processes N`: asked for by name (`--proxies direct,pylon,pylon@2`).
MORE_PROXIES = ("pylon@2", "pylon@4")
READY_WAIT_S = 30.0  # a supervisor's processes each say `ready` within this
ALL_UPSTREAMS = ("canned", "mock")
ALL_PROTOCOLS = ("h1", "h2c")
SWEEP_LOADS = "c1,c8,c32,c128,r1000,r5000"
RATE_CONNECTIONS = 10  # a fixed-rate load's connections (h2load --rps is per connection)


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    stream: bool
    paced: bool


MODES = {
    "nonstream": Mode("nonstream", "non-stream 1KB", stream=False, paced=False),
    "stream": Mode("stream", "stream 20 SSE", stream=True, paced=False),
    "stream-paced": Mode("stream-paced", "stream 20 SSE paced", stream=True, paced=True),
}


@dataclass(frozen=True)
class Load:
    """`c32`: 32 connections (h2c: 1 stream each unless `m` says); `c1m32`: 1 connection x 32
    streams; `r1000`: a fixed rate of 1,000 requests/s (HTTP/1.1 or h2c by h2load)."""

    label: str
    connections: int
    streams: int = 1
    rate: float | None = None

    @staticmethod
    def parse(text: str) -> Load:
        if text.startswith("r"):
            return Load(text, RATE_CONNECTIONS, 1, float(text[1:]))
        connections, _, streams = text[1:].partition("m")
        return Load(text, int(connections), int(streams or 1))


@dataclass
class Row:
    upstream: str
    mode: str
    proxy: str
    protocol: str = "h1"
    logs: str = "on"
    load: str = "c32"
    round: int = 1
    status: str = "ok"
    rps: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    requests: int | None = None
    proxy_cpu_s: float | None = None
    proxy_cpu_us_per_req: float | None = None
    proxy_cpu_us_per_token: float | None = None
    upstream_cpu_us_per_req: float | None = None
    loadgen_cpu_us_per_req: float | None = None
    sse_events_probe: int | None = None
    errors: dict[str, int] = field(default_factory=dict)
    vs_envoy: float | None = None
    vs_nginx: float | None = None
    added_p50_ms: float | None = None  # over the direct row of the same round
    added_p99_ms: float | None = None


@dataclass
class Ctx:
    args: argparse.Namespace
    group: ProcessGroup
    workdir: Path


# ---------------------------------------------------------------- upstreams


def mock_available() -> bool:
    try:
        return importlib.util.find_spec("mock_dynamo.cli") is not None
    except (ImportError, ValueError):
        return False


def upstream_argv(name: str, pace_ms: float) -> list[str]:
    if name == "canned":
        script = Path(__file__).resolve().parent / "bench" / "canned_upstream.py"
        return [sys.executable, str(script), "--port", "0", "--pace-ms", f"{pace_ms:g}"]
    mock = Path(sys.executable).parent / "mock-dynamo"
    return [
        str(mock),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--flavor",
        "dynamo",
        "--model",
        "mock-model",
        "--num-tokens",
        str(TOKENS_PER_STREAM),
        "--token-delay-ms",
        f"{pace_ms:g}",
    ]


# ---------------------------------------------------------------- one row


def start_proxy(
    ctx: Ctx, proxy: str, up_port: int, rowdir: Path, setup: Setup
) -> tuple[int, subprocess.Popen[bytes]]:
    """Start a proxy in front of up_port; return (listen port, process)."""
    port = free_port()
    spec = SPEC_BUILDERS[proxy](port, up_port, rowdir, setup)
    proc = ctx.group.start(spec.argv, rowdir / f"{proxy}.log")
    try:
        wait_port(proc, port, spec.startup_timeout_s)
        if "@" in proxy:  # the port answers once one process listens: wait for all N
            wait_ready_lines(rowdir / f"{proxy}.log", int(proxy.split("@")[1]), READY_WAIT_S)
        if proxy.startswith("pylon"):
            wait_serving(port, READY_WAIT_S)
    except RuntimeError as exc:
        ctx.group.stop(proc)
        log = (rowdir / f"{proxy}.log").read_text(errors="replace").strip()
        raise RuntimeError(f"{exc}; log tail: {log[-400:]}") from exc
    return port, proc


def wait_serving(port: int, timeout_s: float) -> None:
    """Until pylon answers a request: it listens before its upstream's models are discovered,
    and answers 503 `not_ready` until then (its `ready` line is not logged at warning level)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            probe(port, False)
            return
        except (OSError, ValueError) as exc:  # as a RuntimeError: the caller stops the proxy
            raise RuntimeError(f"probe failed: {exc}") from exc
        except RuntimeError as exc:
            if "not_ready" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def wait_ready_lines(log: Path, count: int, timeout_s: float) -> None:
    """Until the log holds `count` `ready` lines (one per process of a supervisor)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if text.count('"event":"ready"') >= count:
            return
        time.sleep(0.1)
    raise RuntimeError(f"fewer than {count} processes said ready within {timeout_s:g} s")


def measure(ctx: Ctx, row: Row, mode: Mode, port: int, pids: tuple[int, int]) -> None:
    proxy_pid, up_pid = pids
    load = Load.parse(row.load)
    if row.protocol == "h2c":
        h2_probe(port, mode.stream, ctx.workdir)
    events = probe(port, mode.stream) if row.protocol == "h1" else TOKENS_PER_STREAM
    row.sse_events_probe = events if mode.stream else None

    def drive(seconds: int) -> WrkResult:
        if row.protocol == "h1" and load.rate is None:
            return run_wrk(port, mode.stream, seconds, load.connections)
        h2 = H2Load(load.connections, load.streams, row.protocol == "h1", None)
        if load.rate is not None:
            h2 = H2Load(load.connections, 1, row.protocol == "h1", load.rate / load.connections)
        return run_h2load(port, mode.stream, seconds, h2, ctx.workdir)

    if ctx.args.warmup > 0:
        drive(ctx.args.warmup)
    p0, u0 = cpu_seconds(proxy_pid), cpu_seconds(up_pid)
    res = drive(ctx.args.duration)
    p1, u1 = cpu_seconds(proxy_pid), cpu_seconds(up_pid)
    fill_row(row, mode, res, p1 - p0, u1 - u0)
    if row.status != "ok" and row.protocol == "h1":
        row.status += f"; post-run probe: {post_probe(port, mode.stream)}"


def post_probe(port: int, stream: bool) -> str:
    """Diagnose a failed run: does a single request still succeed?"""
    try:
        probe(port, stream)
    except (RuntimeError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def fill_row(row: Row, mode: Mode, res: WrkResult, proxy_cpu: float, up_cpu: float) -> None:
    n = max(res.requests, 1)
    row.rps, row.p50_ms, row.p99_ms, row.requests = res.rps, res.p50_ms, res.p99_ms, res.requests
    row.errors = res.errors
    row.upstream_cpu_us_per_req = up_cpu * 1e6 / n
    row.loadgen_cpu_us_per_req = res.loadgen_cpu_s * 1e6 / n
    if row.proxy != "direct":
        row.proxy_cpu_s = proxy_cpu
        row.proxy_cpu_us_per_req = proxy_cpu * 1e6 / n
        if mode.stream:
            row.proxy_cpu_us_per_token = row.proxy_cpu_us_per_req / TOKENS_PER_STREAM
    if res.error_count or res.requests == 0:
        row.status = f"FAILED: {res.error_count} errors/non-2xx {res.errors}"


def run_row(ctx: Ctx, proto: Row, mode: Mode, up: tuple[int, int]) -> Row:
    """Measure one proxy for one (upstream, mode, protocol, logs, load, round): `proto` names
    them."""
    up_port, up_pid = up
    row = Row(**{**asdict(proto), "errors": {}})
    setup = Setup(row.protocol, row.logs == "on")
    tag = f"{row.upstream}-{mode.key}-{row.protocol}-{row.logs}-{row.load}-r{row.round}"
    rowdir = ctx.workdir / f"{tag}-{row.proxy}"
    rowdir.mkdir()
    proc: subprocess.Popen[bytes] | None = None
    try:
        port = up_port
        if row.proxy != "direct":
            port, proc = start_proxy(ctx, row.proxy, up_port, rowdir, setup)
        measure(ctx, row, mode, port, (proc.pid if proc else up_pid, up_pid))
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
        row.status = f"FAILED: {exc}"
    finally:
        if proc is not None:
            ctx.group.stop(proc)
    log_row(row)
    return row


def log_row(row: Row) -> None:
    if row.status != "ok":
        print(f"!!! {row.upstream} / {row.mode} / {row.proxy}: {row.status}", file=sys.stderr)
        return
    print(
        f"  r{row.round} {row.upstream:6} {row.protocol:3} {row.mode:20} {row.load:6} "
        f"logs {row.logs:3} {row.proxy:6} {row.rps:9.0f} req/s  "
        f"p50 {row.p50_ms:.2f} ms  p99 {row.p99_ms:.2f} ms  "
        f"proxy {fmt(row.proxy_cpu_us_per_req)} us/req",
        file=sys.stderr,
        flush=True,
    )


# ---------------------------------------------------------------- orchestration


def run_upstream(ctx: Ctx, upstream: str, round_: int) -> list[Row]:
    rows: list[Row] = []
    for mode in ctx.args.modes:
        pace = ctx.args.pace_ms if mode.paced else 0.0
        try:
            argv = upstream_argv(upstream, pace)
            log = ctx.workdir / f"upstream-{upstream}-{mode.key}-r{round_}.log"
            proc, up_port = start_listening(ctx.group, argv, log_path=log)
        except (RuntimeError, OSError) as exc:
            print(f"!!! upstream {upstream} failed to start: {exc}", file=sys.stderr)
            rows += [
                Row(upstream, mode.label, p, round=round_, status=f"FAILED: upstream: {exc}")
                for p in ctx.args.proxies
            ]
            continue
        try:
            for protocol in ctx.args.protocols:
                for logs in ctx.args.logs:
                    for load in loads_for(ctx.args, protocol):
                        for proxy in ctx.args.proxies:
                            if proxy == "direct" and (protocol != "h1" or logs == "off"):
                                continue  # the upstream speaks HTTP/1.1 and logs nothing
                            proto = Row(upstream, mode.label, proxy, protocol, logs, load, round_)
                            rows.append(run_row(ctx, proto, mode, (up_port, proc.pid)))
        finally:
            ctx.group.stop(proc)
    return rows


def loads_for(args: argparse.Namespace, protocol: str) -> list[str]:
    """The loads asked for; h2c's default is one connection of `--connections` streams."""
    if args.loads is not None:
        return list(args.loads)
    return [f"c{args.connections}" if protocol == "h1" else f"c1m{args.connections}"]


def _key(row: Row) -> tuple[Any, ...]:
    return (row.upstream, row.mode, row.protocol, row.logs, row.load, row.round)


def add_ratios(rows: list[Row]) -> None:
    """Per round: each row against Envoy's and nginx's of the same setting, with the same
    access-log setting; and its latency over the direct row's (logs on and off alike)."""
    for row in rows:
        same = [r for r in rows if _key(r) == _key(row) and r.status == "ok"]
        ref = {r.proxy: r.proxy_cpu_us_per_req for r in same}
        direct = [
            r
            for r in rows
            if r.proxy == "direct"
            and r.status == "ok"
            and (r.upstream, r.mode, r.protocol, r.load, r.round)
            == (row.upstream, row.mode, row.protocol, row.load, row.round)
        ]
        mine = row.proxy_cpu_us_per_req
        if mine is None or row.status != "ok":
            continue
        if ref.get("envoy"):
            row.vs_envoy = mine / ref["envoy"]  # type: ignore[operator]
        if ref.get("nginx"):
            row.vs_nginx = mine / ref["nginx"]  # type: ignore[operator]
        if direct and row.p50_ms is not None and row.p99_ms is not None:
            row.added_p50_ms = row.p50_ms - (direct[0].p50_ms or 0.0)
            row.added_p99_ms = row.p99_ms - (direct[0].p99_ms or 0.0)


def fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def short(status: str, limit: int = 90) -> str:
    """One-line, pipe-free, truncated status for a table cell."""
    text = " ".join(status.replace("|", "/").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _spread(values: list[float], spec: str = ".2f", suffix: str = "x") -> str:
    """The median, and the range when there is more than one value."""
    if not values:
        return "-"
    text = f"{_median(values):{spec}}{suffix}"
    if len(values) > 1:
        text += f" ({min(values):{spec}}-{max(values):{spec}})"
    return text


def markdown_table(rows: list[Row]) -> str:
    """One line per (upstream, mode, protocol, logs, load, proxy): medians over the rounds; a
    ratio is the median of the per-round ratios (each measured side by side in that round)."""
    head = (
        "| upstream | protocol | mode | load | logs | proxy | req/s | p50 ms | p99 ms "
        "| +p50/+p99 ms over direct | proxy CPU-us/req | CPU-us/token | vs Envoy | vs nginx "
        "| upstream CPU-us/req |"
    )
    lines = [head, "|" + "---|" * 15]
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.upstream, r.mode, r.protocol, r.load, r.logs, r.proxy), []).append(r)
    for (upstream, mode, protocol, load, logs, proxy), group in groups.items():
        ok = [r for r in group if r.status == "ok"]
        label = f"| {upstream} | {protocol} | {mode} | {load} | {logs} | {proxy} |"
        if not ok:
            lines.append(f"{label} {short(group[0].status)} |" + " |" * 8)
            continue

        def med(name: str, rows_: list[Row] = ok) -> float | None:
            values = [getattr(r, name) for r in rows_ if getattr(r, name) is not None]
            return _median(values) if values else None

        added = "-"
        if med("added_p50_ms") is not None:
            added = f"{fmt(med('added_p50_ms'), '+.2f')} / {fmt(med('added_p99_ms'), '+.2f')}"
        failed = len(group) - len(ok)
        lines.append(
            f"{label} {fmt(med('rps'), '.0f')} | {fmt(med('p50_ms'), '.2f')} | "
            f"{fmt(med('p99_ms'), '.2f')} | {added} | "
            f"{fmt(med('proxy_cpu_us_per_req'))} | {fmt(med('proxy_cpu_us_per_token'))} | "
            f"{_spread([r.vs_envoy for r in ok if r.vs_envoy is not None])} | "
            f"{_spread([r.vs_nginx for r in ok if r.vs_nginx is not None])} | "
            f"{fmt(med('upstream_cpu_us_per_req'))}"
            + (f" ({failed} round(s) FAILED) |" if failed else " |")
        )
    return "\n".join(lines)


def tool_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return "n/a"
    text = (out.stdout + out.stderr).strip().splitlines()
    return text[0].strip() if text else "n/a"


def environment() -> dict[str, Any]:
    nginx, envoy = nginx_bin(), envoy_bin()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "nginx": tool_version([str(nginx), "-v"]) if nginx else "n/a",
        "envoy": tool_version([str(envoy), "--version"]) if envoy else "n/a",
        "wrk": tool_version(["wrk", "-v"]),
    }


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxies", default=",".join(ALL_PROXIES))
    ap.add_argument("--upstreams", default="canned", help="canned,mock")
    ap.add_argument("--modes", default="nonstream,stream,stream-paced")
    ap.add_argument("--duration", type=int, default=8, help="seconds per measured run")
    ap.add_argument("--warmup", type=int, default=2, help="seconds of unmeasured warm-up")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--pace-ms", type=float, default=1.0, help="inter-event delay, paced mode")
    ap.add_argument("--protocols", default="h1", help="h1,h2c")
    ap.add_argument("--logs", default="on", help="on,off: every proxy's access log")
    ap.add_argument("--loads", default=None, help="e.g. c1,c8,c32,c128,r1000,r5000, c1m32")
    ap.add_argument("--rounds", type=int, default=1, help="the whole set this many times")
    ap.add_argument("--sweep", action="store_true", help=f"--loads {SWEEP_LOADS}, h1 non-stream")
    ap.add_argument("--quick", action="store_true", help="~1 minute smoke run (3s + 1s warm-up)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.warmup = 3, 1
    args.proxies = split_choices(ap, args.proxies, ALL_PROXIES + MORE_PROXIES)
    args.upstreams = split_choices(ap, args.upstreams, ALL_UPSTREAMS)
    if args.sweep:
        args.loads, args.protocols, args.modes = SWEEP_LOADS, "h1", "nonstream"
    args.modes = [MODES[m] for m in split_choices(ap, args.modes, tuple(MODES))]
    args.protocols = split_choices(ap, args.protocols, ALL_PROTOCOLS)
    args.logs = split_choices(ap, args.logs, ("on", "off"))
    if args.loads is not None:
        args.loads = [v.strip() for v in args.loads.split(",") if v.strip()]
        for load in args.loads:
            try:
                Load.parse(load)
            except ValueError:
                ap.error(f"--loads: cannot read {load!r} (c32, c1m32, r1000)")
    return args


def split_choices(ap: argparse.ArgumentParser, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        ap.error(f"choose from {','.join(allowed)}; got {value!r}")
    return items


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_all(ctx: Ctx) -> list[Row]:
    rows: list[Row] = []
    for round_ in range(1, ctx.args.rounds + 1):
        for upstream in ctx.args.upstreams:
            if upstream == "mock" and not mock_available():
                print(
                    "--- skipping upstream 'mock': mock_dynamo.cli not importable", file=sys.stderr
                )
                continue
            print(f"--- round {round_}, upstream {upstream}", file=sys.stderr, flush=True)
            rows += run_upstream(ctx, upstream, round_)
    add_ratios(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # pylon's admin listener on an ephemeral port: its metrics run as in production, and no
    # fixed port can collide with another pylon. An environment variable, not a flag, so an
    # older pylon measured for comparison only warns about it.
    os.environ.setdefault("PYLON_ADMIN_LISTEN", "127.0.0.1:0")
    signal.signal(signal.SIGTERM, _sigterm)
    workdir = Path(tempfile.mkdtemp(prefix="pylon-bench-"))
    group = ProcessGroup()
    rows: list[Row] = []
    try:
        rows = run_all(Ctx(args, group, workdir))
    except KeyboardInterrupt:
        print("interrupted; stopping subprocesses", file=sys.stderr)
        return 130
    finally:
        group.close()
    failed = [r for r in rows if r.status != "ok"]
    report(args, rows)
    if failed:
        print(f"{len(failed)} row(s) FAILED; logs kept in {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


def report(args: argparse.Namespace, rows: list[Row]) -> None:
    print(markdown_table(rows))
    if args.json_out:
        doc = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "settings": {
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "connections": args.connections,
                "protocols": args.protocols,
                "logs": args.logs,
                "loads": args.loads,
                "rounds": args.rounds,
                "wrk_threads": 1,
                "pace_ms": args.pace_ms,
                "tokens_per_stream": TOKENS_PER_STREAM,
            },
            "environment": environment(),
            "rows": [asdict(r) for r in rows],
        }
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""Routing quality: one shared-prefix trace replayed through pylon's routing modes.

Each policy gets a fresh fleet: N mock_dynamo workers (`--flavor dynamo`) with the engine
model on (the tiny offline model dir of `scripts/dynamo_stack.py` as tokenizer, an LRU prefix
cache, a prefill lane whose speed makes a cache miss cost tens of ms, KV events on ZMQ), and a
pylon (`--routing POLICY`) in front of them. The same trace is replayed against each: many
prefix groups (a long system prompt each), several conversations per group, several turns per
conversation, Poisson arrivals (open loop), streaming chat completions. The client is one
asyncio process (aiohttp) and measures the time to first token (the first SSE `data:` line).

Reported per policy, over the requests after the warm-up (the first turn of one conversation
per group, in the trace's first seconds, so that every prefix has been seen once):
mean / p50 / p99 TTFT, the prefix-cache hit rate (full prompt blocks found, from each mock's
`GET /test-control/kv`, counted over the same window), pylon's select latency (the admin
listener's `pylon_router_select_seconds`, kv only), and how the requests spread over the
workers. Each worker's cache holds a third of the trace's distinct blocks, so the fleet can
hold the whole working set only if each prefix stays on one worker.

    PYTHONPATH=. .venv/bin/python scripts/bench_routing.py            # ~2 min, 5 rows
    PYTHONPATH=. .venv/bin/python scripts/bench_routing.py --duration 60 --policies kv,kv@3

`kv@W` is `--routing kv --kv-overlap-weight W` (the native core's overlap weight; Dynamo's
default, and pylon's when the flag is unset, is 1: a cached block saves as much as one block of
decode load costs). `vllm-router` is
vllm-router (PyPI; `--vllm-router PATH` or on PATH) with `--policy cache_aware` in front of the
same fresh mocks instead of pylon.

The `dynamo:*` rows (the anchor) run a real Dynamo 1.6.1 fleet instead: one `dynamo.frontend`
and N `dynamo.mocker` workers (`scripts/dynamo_stack.py`, file discovery), fresh per row, with
pylon in front of the frontend:

* `dynamo:round-robin`: frontend `--router-mode direct`, pylon `--routing round-robin` over
  `instance-id=` workers (pylon writes the pin `x-dynamo-worker-instance-id`);
* `dynamo:frontend-kv[@W]`: frontend `--router-mode kv` (Dynamo's own KV router; `@W` is its
  `--router-kv-overlap-score-weight W`, the same knob as pylon's), pylon `--routing off`;
* `dynamo:kv[@W]`: frontend `--router-mode direct`, pylon `--routing kv` over `instance-id=`
  workers with `kv-events=` each mocker's `--zmq-kv-events-ports` PUB, `--tokenizer` the model dir.

Their hit rate comes from the engines themselves: the streamed
`usage.prompt_tokens_details.cached_tokens` (`stream_options.include_usage`) of each measured
reply. The mocker binds its KV-event PUB on all interfaces, so when `dynamo:*` rows are asked for
the whole run happens inside a private network namespace: the script re-executes itself under
`unshare --net` (root only; `lo` brought up) and refuses to start otherwise.

    sudo PYTHONPATH=. .venv/bin/python scripts/bench_routing.py --policies dynamo   # 5 Dynamo rows

**Scale rows** (`--processes`, `--replicas`): `--routing kv` on one node's fleet, run as
several pylons, each row with a fresh fleet of mocks and the same trace:

* `--processes 1,2,4`: a row per count, `pylon serve --processes P` (P > 1: the supervisor and
  its P processes on the shared listener). Its processes book at the node's booking authority
  when the supervisor starts one, and each alone otherwise; the row says which it got, from
  the supervisor's merged `/metrics` (`pylon_router_authority_connected`, one sample a process
  with an authority: "authority (P/P connected)", or "each process alone (no authority)"), and
  how many bookings were made alone (`pylon_router_authority_events_total{event=
  "local_bookings"}`).
* `--replicas on,off`: a row each, 2 separate `pylon serve`s on this host (the "nodes"), each
  in front of all the mocks; `on`: each with its own `--replica-sync-port` (a port the kernel
  picked) and the other as `--replica-peer 127.0.0.1:PORT` (the row says how many peer events
  each applied), `off`: no sync flags. The client sends each conversation to one replica
  (by its number: half the conversations each). The sync binds its PUB on all interfaces, so
  an `on` row runs the whole run in a private network namespace, as the `dynamo:*` rows do
  (root).

After its trace, each scale row measures **the race** on the same fleet, at each of
`--race-rates` (default 50, 200, 1,000 selections/s): `--race-count` distinct prompts of one
length (`--race-tokens`, so that a worker's block load orders the workers as its booking count
does), paced open loop and sent to the replicas in turn, each held open (the mocks stall
every stream before its first event, so no booking is released while the rate runs), then
all closed and drained. A *mis-pick* is a choice that is not the least-loaded worker given
every earlier booking by any process or replica: the workers' records (which worker got
which request, by its `x-request-id`) replayed in the order the client sent them, with
`bench_bookings.mis_picks` (scripts/bench_bookings.py's method; the send order stands for the
booking order, the workers' own arrival times on a busy host do not). So the race is measured
through the real pylons, not from the trace.

Reported per scale row, besides the big table: a compact markdown table (TTFT p99 and its
ratio to the 1-process row, the block hit rate, the mis-picks at each rate) for
docs/benchmarks.md, and the target, reported (not asserted): with P local processes TTFT p99
within 10 % of one process.

    sudo PYTHONPATH=. .venv/bin/python scripts/bench_routing.py --processes 1,2,4 --replicas on,off
    PYTHONPATH=. .venv/bin/python scripts/bench_routing.py --processes 1,2 --duration 5 \
        --groups 8 --sessions 2 --race-count 40     # a quick check that it works (~45 s)

Everything binds to 127.0.0.1 (but the sync and the Dynamo mockers, inside their private
network namespace); every process is killed on exit (also on Ctrl-C / SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from dynamo_stack import BLOCK_SIZE as DYNAMO_BLOCK_SIZE  # noqa: E402
from dynamo_stack import DynamoStack, build_model_dir  # noqa: E402
from procs import ProcessGroup, free_port  # noqa: E402

MODEL = "mock-model"
POLICIES = ("round-robin", "least-loaded", "kv", "vllm-router")
# A real Dynamo fleet (frontend + mockers), pylon in front: see the module docstring.
DYNAMO_POLICIES = ("dynamo:round-robin", "dynamo:frontend-kv", "dynamo:kv")
WEIGHTED = ("kv", "dynamo:kv", "dynamo:frontend-kv")  # the modes that take `@W`
# vllm-router is left out of the default run (with a note) when its binary is not found.
DEFAULT_POLICIES = "round-robin,least-loaded,kv,kv@8,vllm-router"
# `--policies dynamo` is short for these.
DYNAMO_DEFAULT = "dynamo:round-robin,dynamo:frontend-kv,dynamo:kv,dynamo:frontend-kv@8,dynamo:kv@8"
HIT_FROM_MOCK = "mock /test-control/kv"
HIT_FROM_USAGE = "engine usage.cached_tokens"
# Set in the re-executed child: the network namespace it was started from (see netns_guard).
NETNS_ENV = "BENCH_ROUTING_PARENT_NETNS"

# Word pool for the synthetic text: lowercase pseudo-words, deterministic per seed.
_SYLLABLES = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count)
    )


@dataclass(frozen=True, slots=True)
class Request:
    at: float  # seconds after the start of the replay
    group: int
    session: int
    turn: int
    body: bytes
    usage_body: bytes  # the same, asking for the streamed usage (the Dynamo rows' hit rate)


@dataclass
class Trace:
    requests: list[Request]
    prompt_tokens: list[int]
    distinct_blocks: int
    prefix_tokens: float  # mean tokens of a group's system prompt (rendered)
    warmup: int  # the first `warmup` requests are not measured


def build_trace(args: argparse.Namespace, model_dir: Path) -> Trace:
    """Groups x sessions x turns chat requests, each session's turns in order, randomly
    interleaved, at Poisson arrival times of rate `args.rate` over `args.duration` s."""
    from mock_dynamo.tokens import load_tokenizer, prompts
    from pylon.core.blocks import block_hashes, sequence_hashes

    rng = random.Random(args.seed)
    systems = [_words(rng, args.prefix_words) for _ in range(args.groups)]
    sessions: list[tuple[int, list[str], list[str]]] = []  # group, user turns, assistant turns
    for group in range(args.groups):
        for _ in range(args.sessions):
            users = [_words(rng, args.turn_words) for _ in range(args.turns)]
            replies = [_words(rng, args.turn_words) for _ in range(args.turns)]
            sessions.append((group, users, replies))
    # Warm-up: the first turn of each group's first conversation, one per group, so every
    # prefix has been seen once before the measured part (which then has no cold misses).
    first = [group * args.sessions for group in range(args.groups)]
    rng.shuffle(first)
    rest = [s for s in range(len(sessions)) for _ in range(args.turns)]
    for sid in first:
        rest.remove(sid)
    rng.shuffle(rest)
    order = first + rest
    count = len(order)
    rate = count / args.duration
    at = 0.0
    next_turn = [0] * len(sessions)
    tokenizer = load_tokenizer(str(model_dir), "dynamo")
    requests: list[Request] = []
    lengths: list[int] = []
    blocks: set[int] = set()
    for sid in order:
        group, users, replies = sessions[sid]
        turn = next_turn[sid]
        next_turn[sid] += 1
        messages = [{"role": "system", "content": systems[group]}]
        for k in range(turn):
            messages.append({"role": "user", "content": users[k]})
            messages.append({"role": "assistant", "content": replies[k]})
        messages.append({"role": "user", "content": users[turn]})
        body = {
            "model": MODEL,
            "messages": messages,
            "stream": True,
            "max_tokens": args.num_tokens,
        }
        tokens = prompts(tokenizer, "chat", body)[0]
        lengths.append(len(tokens))
        blocks.update(sequence_hashes(block_hashes(tokens, args.block_size)))
        usage_body = {**body, "stream_options": {"include_usage": True}}
        requests.append(
            Request(
                at, group, sid, turn, json.dumps(body).encode(), json.dumps(usage_body).encode()
            )
        )
        at += rng.expovariate(rate)
    prefix = [
        len(prompts(tokenizer, "chat", {"messages": [{"role": "system", "content": s}]})[0])
        for s in systems[:8]
    ]
    return Trace(requests, lengths, len(blocks), statistics.fmean(prefix), len(first))


@dataclass(frozen=True, slots=True)
class Scale:
    """A scale row: `--routing kv` on one node as `processes` local processes (`pylon serve
    --processes P`), or as `replicas` separate pylons (the "nodes"), with Dynamo's replica sync
    between them or not."""

    processes: int = 1
    replicas: int = 1
    sync: bool = False

    @property
    def label(self) -> str:
        if self.replicas > 1:
            return f"kv, {self.replicas} replicas, sync {'on' if self.sync else 'off'}"
        return f"kv, {self.processes} process{'es' if self.processes > 1 else ''}"

    def flags(self, index: int, sync_ports: list[int]) -> list[str]:
        """The `pylon serve` flags of replica `index` (`sync_ports`: every replica's sync
        port, empty when the sync is off)."""
        out = ["--processes", str(self.processes)] if self.processes > 1 else []
        if sync_ports:
            out += ["--replica-sync-port", str(sync_ports[index])]
            for other, port in enumerate(sync_ports):
                if other != index:
                    out += ["--replica-peer", f"127.0.0.1:{port}"]
        return out


def parse_scales(processes: str, replicas: str) -> list[Scale]:
    """The scale rows of `--processes 1,2,4` and `--replicas on,off` (2 replicas each), in
    that order; ValueError on anything else."""
    out: list[Scale] = []
    for item in (s.strip() for s in processes.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--processes: {item!r} is not a count >= 1")
        out.append(Scale(processes=int(item)))
    for item in (s.strip() for s in replicas.split(",")):
        if not item:
            continue
        if item not in ("on", "off"):
            raise ValueError(f"--replicas: {item!r} is neither `on` nor `off` (the sync)")
        out.append(Scale(replicas=2, sync=item == "on"))
    return out


def slug(text: str) -> str:
    """`text` as a log file name part."""
    return re.sub(r"[^A-Za-z0-9@.]+", "-", text).strip("-")


@dataclass
class Outcome:
    ttft_s: float | None = None
    total_s: float | None = None
    status: int = 0
    error: str | None = None
    lag_s: float = 0.0  # how late the client sent it (a saturated client shows here)
    prompt_tokens: int | None = None  # from the streamed usage, when asked for
    cached_tokens: int | None = None


@dataclass
class Row:
    policy: str
    mode: str
    requests: int = 0
    measured: int = 0
    errors: int = 0
    ttft_mean_ms: float = math.nan
    ttft_p50_ms: float = math.nan
    ttft_p99_ms: float = math.nan
    hit_rate: float = math.nan
    token_hit_rate: float = math.nan
    select_count: int = 0
    select_mean_us: float = math.nan
    select_p50_us: str = "-"
    select_p99_us: str = "-"
    fallbacks: int = 0
    per_worker: list[int] = field(default_factory=list)
    max_lag_ms: float = 0.0
    slowest: list[tuple[float, int, int, int]] = field(default_factory=list)  # ms, n, group, turn
    failed: str | None = None
    hit_source: str = HIT_FROM_MOCK
    booking: str = "-"  # a scale row: how its processes / replicas shared the bookings
    race: dict[str, float] = field(default_factory=dict)  # arrival rate -> mis-pick fraction


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(0, math.ceil(q * len(ordered)) - 1)
    return ordered[rank]


class Fleet:
    """N mocks and one pylon (or, for a scale row, one `pylon serve --processes P`, or R
    replicas), as subprocesses of one ProcessGroup."""

    def __init__(
        self,
        args: argparse.Namespace,
        policy: str,
        model_dir: Path,
        cache_blocks: int,
        logs: Path,
        scale: Scale | None = None,
    ) -> None:
        self.args = args
        self.policy = policy
        self.scale = scale
        # `kv@W`: --routing kv --kv-overlap-weight W (Dynamo's default is 1).
        self.mode, _, self.overlap_weight = policy.partition("@")
        if scale is not None:
            self.mode, self.overlap_weight = "kv", ""
        self.urls: list[str] = []  # one per replica: the client spreads the trace over them
        self.admins: list[str] = []
        self.model_dir = model_dir
        self.cache_blocks = cache_blocks
        self.logs = logs
        self.group = ProcessGroup()
        self.mocks: list[str] = []
        self.kv_events: list[str] = []
        self.url = ""
        self.admin = ""

    def start(self) -> None:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DYN_ROUTER_")},
            "PYTHONPATH": str(ROOT),
        }
        args = self.args
        for index in range(args.workers):
            port, kv_port = free_port(), free_port()
            argv = [
                sys.executable, "-m", "mock_dynamo", "--host", "127.0.0.1", "--port", str(port),
                "--flavor", "dynamo", "--model", MODEL, "--ttft-ms", str(args.ttft_ms),
                "--token-delay-ms", str(args.token_delay_ms),
                "--num-tokens", str(args.num_tokens), "--capacity", str(self._records()),
                "--kv-block-size", str(args.block_size),
                "--kv-cache-blocks", str(self.cache_blocks),
                "--prefill-tokens-per-s", str(args.prefill_tokens_per_s),
                "--tokenizer", str(self.model_dir), "--kv-events-port", str(kv_port),
                "--log-level", "warning",
            ]  # fmt: skip
            self._spawn(f"mock{index}-{self.policy}", argv, env)
            self.mocks.append(f"http://127.0.0.1:{port}")
            self.kv_events.append(f"tcp://127.0.0.1:{kv_port}")
        for url in self.mocks:
            _wait_http(f"{url}/test-control/kv", 30.0)
        scale = self.scale or Scale()
        ports = [(free_port(), free_port()) for _ in range(scale.replicas)]
        self.urls = [f"http://127.0.0.1:{listen}" for listen, _ in ports]
        self.admins = [f"http://127.0.0.1:{admin}" for _, admin in ports]
        self.url, self.admin = self.urls[0], self.admins[0]
        if self.mode == "vllm-router":
            self._start_vllm_router(*ports[0], env)
            return
        sync_ports = [free_port() for _ in ports] if scale.sync else []
        for index, (listen, admin) in enumerate(ports):
            argv = self._pylon_argv(listen, admin) + scale.flags(index, sync_ports)
            self._spawn(f"pylon{index}-{slug(self.policy)}", argv, dict(env))
        for admin_url in self.admins:
            _wait_http(f"{admin_url}/ready", 60.0)

    def _records(self) -> int:
        """Requests each mock keeps records of: the race reads them (`race_at`), and the
        pylons' health probes are recorded too (a margin, so none pushes a race record out)."""
        return 2 * self.args.race_count + 1000 if self.scale is not None else 1

    def _pylon_argv(self, listen: int, admin: int) -> list[str]:
        args = self.args
        argv = [
            str(Path(sys.executable).parent / "pylon"), "serve",
            "--listen", f"127.0.0.1:{listen}", "--admin-listen", f"127.0.0.1:{admin}",
            "--backend", "dynamo", "--routing", self.mode, "--log-level", "warning",
        ]  # fmt: skip
        for url, events in zip(self.mocks, self.kv_events, strict=True):
            spec = f"url={url}"
            if self.mode == "kv":
                spec += f",kv-events={events},block-size={args.block_size}"
            argv += ["--worker", spec]
        if self.mode == "kv":
            argv += ["--tokenizer", str(self.model_dir)]
        if self.overlap_weight:
            argv += ["--kv-overlap-weight", self.overlap_weight]
        return argv

    def _start_vllm_router(self, listen: int, admin: int, env: dict[str, str]) -> None:
        """vllm-router (PyPI) in its cache-aware policy (an approximate radix tree of the
        request text per worker, with its default load-balance thresholds)."""
        binary = self.args.vllm_router or shutil.which("vllm-router")
        if not binary:
            raise RuntimeError("vllm-router not found (pip install vllm-router; --vllm-router)")
        argv = [
            binary, "--host", "127.0.0.1", "--port", str(listen),
            "--worker-urls", *self.mocks, "--policy", "cache_aware",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(admin),
            "--log-level", "warning",
        ]  # fmt: skip
        self._spawn(f"vllm-router-{self.policy}", argv, env)
        _wait_http(f"{self.url}/health", 60.0)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.group.start(argv, self.logs / f"{name}.log", env)

    def close(self) -> None:
        self.group.close()


class DynamoFleet:
    """N real Dynamo mockers behind one Dynamo frontend (`DynamoStack`), pylon in front; see
    the module docstring for the three modes. Must run inside a private network namespace."""

    def __init__(
        self, args: argparse.Namespace, policy: str, model_dir: Path, gpu_blocks: int, logs: Path
    ) -> None:
        self.args = args
        self.policy = policy
        self.mode, _, self.overlap_weight = policy.removeprefix("dynamo:").partition("@")
        self.model_dir = model_dir
        self.gpu_blocks = gpu_blocks
        self.logs = logs
        self.group = ProcessGroup()
        self.stack: DynamoStack | None = None
        self.mocks: list[str] = []  # no /test-control here
        self.url = ""
        self.admin = ""

    def start(self) -> None:
        args = self.args
        frontend_kv = self.mode == "frontend-kv"
        extra_frontend: list[str] = []
        if frontend_kv and self.overlap_weight:
            # The same native weight pylon's --kv-overlap-weight sets (1.6.1 keeps it under
            # this deprecated name; its env twin is DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT).
            extra_frontend = ["--router-kv-overlap-score-weight", self.overlap_weight]
        name = self.policy.replace(":", "-").replace("@", "-w")
        mocker_args = [
            "--decode-speedup-ratio", str(args.dynamo_decode_speedup_ratio),
        ]  # fmt: skip
        if args.dynamo_timing == "profile":
            profile = write_perf_profile(
                self.logs / "mocker-profile.npz",
                ttft_ms=args.ttft_ms,
                prefill_tokens_per_s=args.prefill_tokens_per_s,
                itl_ms=args.token_delay_ms,
            )
            mocker_args += ["--planner-profile-data", str(profile)]
        self.stack = DynamoStack(
            num_workers=args.workers,
            speedup_ratio=args.dynamo_speedup_ratio,
            router_mode="kv" if frontend_kv else "direct",
            router_queue_threshold=None,  # Dynamo's default: no router queue (pylon has none)
            kv_event_ports=[free_port() for _ in range(args.workers)],
            num_gpu_blocks=self.gpu_blocks,
            model_name=MODEL,
            model_dir=self.model_dir,
            state_dir=self.logs / name,
            extra_frontend_args=extra_frontend,
            extra_mocker_args=mocker_args,
            startup_timeout_s=120.0,
            # The direct-mode frontend warns once per request that it tokenizes a pinned
            # request itself (pylon sends no token_data): keep that log cost out of the rows.
            dyn_log="info,dynamo_llm::preprocessor=error",
        )
        self.stack.start()
        listen, admin = free_port(), free_port()
        self.url = f"http://127.0.0.1:{listen}"
        self.admin = f"http://127.0.0.1:{admin}"
        routing = "off" if frontend_kv else self.mode
        argv = [
            str(Path(sys.executable).parent / "pylon"), "serve",
            "--listen", f"127.0.0.1:{listen}", "--admin-listen", f"127.0.0.1:{admin}",
            "--upstream", self.stack.frontend_url,
            "--backend", "dynamo", "--routing", routing, "--log-level", "warning",
        ]  # fmt: skip
        if routing != "off":
            for index, instance_id in enumerate(self.stack.worker_ids):
                spec = f"instance-id={instance_id}"
                if routing == "kv":
                    events = self.stack.kv_events_endpoint(index)
                    spec += f",kv-events={events},block-size={DYNAMO_BLOCK_SIZE}"
                argv += ["--worker", spec]
        if routing == "kv":
            argv += ["--tokenizer", str(self.model_dir)]
            if self.overlap_weight:
                argv += ["--kv-overlap-weight", self.overlap_weight]
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DYN_ROUTER_")},
            "PYTHONPATH": str(ROOT),
        }
        self.group.start(argv, self.logs / f"pylon-{name}.log", env)
        _wait_http(f"{self.admin}/ready", 60.0)

    def requests_per_worker(self) -> list[int]:
        """`generate` requests each mocker logged receiving (whole trace)."""
        if self.stack is None:
            return []
        return [len(_RECEIVED.findall(self.stack.worker_log(i))) for i in range(self.args.workers)]

    def close(self) -> None:
        self.group.close()
        if self.stack is not None:
            self.stack.stop()


def perf_profile(
    ttft_ms: float, prefill_tokens_per_s: float, itl_ms: float
) -> dict[str, list[float] | list[list[float]]]:
    """The arrays of a mocker timing profile (`--planner-profile-data`, mocker NPZ format) with
    the mocks' cost model: a prefill step of N new tokens (summed over its batch) takes
    `ttft_ms + N / prefill_tokens_per_s` (linear, so it extrapolates), a decode step `itl_ms`
    whatever the batch and context."""
    span = 1_000_000.0  # tokens; linear interpolation extrapolates beyond it anyway
    return {
        "prefill_isl": [0.0, span],
        "prefill_ttft_ms": [ttft_ms, ttft_ms + span / prefill_tokens_per_s * 1000.0],
        "decode_active_kv_tokens": [0.0, span * 16],
        "decode_context_length": [0.0, span],
        "decode_itl": [[itl_ms, itl_ms], [itl_ms, itl_ms]],
    }


def write_perf_profile(
    path: Path, *, ttft_ms: float, prefill_tokens_per_s: float, itl_ms: float
) -> Path:
    import numpy as np  # the mocker itself needs numpy to read it

    arrays = perf_profile(ttft_ms, prefill_tokens_per_s, itl_ms)
    np.savez(path, **{k: np.array(v, dtype=np.float64) for k, v in arrays.items()})
    return path


_RECEIVED = re.compile(r'request received request_id=\S+.*endpoint="generate"')


def _wait_http(url: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s: {last}")


async def _kv_view(session: aiohttp.ClientSession, mocks: list[str]) -> list[dict[str, Any]]:
    views = []
    for url in mocks:
        async with session.get(f"{url}/test-control/kv") as reply:
            reply.raise_for_status()
            views.append(await reply.json())
    return views


def usage_of(line: bytes) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) from an SSE line that carries the OpenAI `usage`
    (`stream_options.include_usage`), else None. No `prompt_tokens_details`: 0 cached."""
    if not line.startswith(b"data:") or b'"prompt_tokens"' not in line:
        return None
    try:
        usage = json.loads(line[5:]).get("usage")
    except (ValueError, AttributeError):
        return None
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return None
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return usage["prompt_tokens"], cached if isinstance(cached, int) else 0


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    request: Request,
    n: int,
    lag: float,
    usage: bool = False,
) -> Outcome:
    outcome = Outcome(lag_s=lag)
    headers = {
        "content-type": "application/json",
        "x-model": MODEL,
        "x-request-id": f"route-{n}",
    }
    started = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            data=request.usage_body if usage else request.body,
            headers=headers,
        ) as reply:
            outcome.status = reply.status
            if reply.status != 200:
                outcome.error = f"status {reply.status}: {(await reply.text())[:200]}"
                return outcome
            async for line in reply.content:
                if outcome.ttft_s is None and line.startswith(b"data:"):
                    outcome.ttft_s = time.perf_counter() - started
                elif usage and (found := usage_of(line)) is not None:
                    outcome.prompt_tokens, outcome.cached_tokens = found
            outcome.total_s = time.perf_counter() - started
    except (TimeoutError, aiohttp.ClientError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def _send(
    session: aiohttp.ClientSession,
    urls: list[str],
    requests: list[Request],
    first: int,
    usage: bool = False,
) -> list[Outcome]:
    """Send each request at its time (open loop, relative to the first one's); wait for all.
    With several replicas (`urls`) each conversation goes to one of them, by its number."""
    tasks: list[asyncio.Task[Outcome]] = []
    origin = requests[0].at if requests else 0.0
    start = time.perf_counter()
    for n, request in enumerate(requests, first):
        due = request.at - origin
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(0.0, time.perf_counter() - start - due)
        url = urls[request.session % len(urls)]
        tasks.append(asyncio.create_task(_one(session, url, request, n, lag, usage)))
    return list(await asyncio.gather(*tasks))


async def replay(fleet: Fleet | DynamoFleet, trace: Trace, race: Race | None = None) -> Row:
    dynamo = isinstance(fleet, DynamoFleet)
    row = Row(fleet.policy, fleet.mode, requests=len(trace.requests))
    urls = fleet.urls if isinstance(fleet, Fleet) and fleet.urls else [fleet.url]
    admins = fleet.admins if isinstance(fleet, Fleet) and fleet.admins else [fleet.admin]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if isinstance(fleet, Fleet) and fleet.scale is not None:
            row.booking = await booking_of(session, fleet.scale, admins)
        if fleet.mode == "kv":  # the selection core's SUBs hear every event from now on
            subscribers = 2 * cores(fleet.scale, row.booking) if isinstance(fleet, Fleet) else 2
            for url in fleet.mocks:  # (two per core: the native core's and pylon's watch)
                params = {"wait_subscribers": str(subscribers), "timeout": "15"}
                async with session.get(f"{url}/test-control/kv", params=params) as reply:
                    reply.raise_for_status()
        for url in fleet.mocks:  # pylon's bring-up probes are not part of the run
            async with session.post(f"{url}/test-control/reset") as reply:
                reply.raise_for_status()
        # Warm-up (every prefix once), drained before the measured part starts on its own
        # clock, so that no measured request queues behind the warm-up's cold prefills.
        warm = trace.requests[: trace.warmup]
        outcomes = await _send(session, urls, warm, 0, usage=dynamo)
        before = await _kv_view(session, fleet.mocks)
        outcomes += await _send(
            session, urls, trace.requests[trace.warmup :], len(warm), usage=dynamo
        )
        after = await _kv_view(session, fleet.mocks)
        metrics: list[str] = []
        if fleet.mode != "vllm-router":
            metrics = [await _metrics(session, admin) for admin in admins]
        if isinstance(fleet, Fleet) and fleet.scale is not None:
            row.booking = booking_after(fleet.scale, row.booking, metrics)
        if race is not None:
            for rate in race.rates:
                row.race[f"{rate:g}"] = await race_at(
                    session, fleet.mocks, urls, admins, race, rate
                )
    measured = outcomes[trace.warmup :]
    errors = [o for o in outcomes if o.error is not None or o.ttft_s is None]
    row.errors = len(errors)
    if errors:
        print(f"  {fleet.policy}: {len(errors)} failed, e.g. {errors[0].error}", file=sys.stderr)
    ttfts = [o.ttft_s * 1000 for o in measured if o.ttft_s is not None and o.error is None]
    row.measured = len(ttfts)
    row.ttft_mean_ms = statistics.fmean(ttfts) if ttfts else math.nan
    row.ttft_p50_ms = percentile(ttfts, 0.50)
    row.ttft_p99_ms = percentile(ttfts, 0.99)
    row.max_lag_ms = max(o.lag_s for o in outcomes) * 1000
    row.slowest = sorted(
        (
            (round(o.ttft_s * 1000, 1), n, r.group, r.turn)
            for n, (o, r) in enumerate(zip(outcomes, trace.requests, strict=True))
            if o.ttft_s is not None and n >= trace.warmup
        ),
        reverse=True,
    )[:10]
    if isinstance(fleet, DynamoFleet):
        _usage_hit_rates(measured, row)
        row.per_worker = fleet.requests_per_worker()
        _read_metrics(metrics, row)
        return row
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before, strict=True))
    misses = sum(a["misses"] - b["misses"] for a, b in zip(after, before, strict=True))
    row.hit_rate = hits / (hits + misses) if hits + misses else math.nan
    cached = sum(
        a["cached_tokens"] - b["cached_tokens"] for a, b in zip(after, before, strict=True)
    )
    prompt = sum(
        a["prompt_tokens"] - b["prompt_tokens"] for a, b in zip(after, before, strict=True)
    )
    row.token_hit_rate = cached / prompt if prompt else math.nan
    row.per_worker = [a["requests"] for a in after]
    _read_metrics(metrics, row)
    return row


# -- the scale rows: how the bookings were shared, and the race -----------------------------


@dataclass(frozen=True, slots=True)
class Race:
    """The race measured on each scale row's fleet after its trace: at each arrival rate,
    `count` distinct prompts of one length, never released while the rate runs."""

    rates: list[float]
    count: int
    bodies: dict[float, list[bytes]]  # per rate: distinct prompts, none shared with the trace


def race_bodies(args: argparse.Namespace, model_dir: Path, count: int) -> list[bytes]:
    """`count` distinct one-message chats whose prompts all have the same number of blocks
    (`--race-tokens` up to one block more), so that a worker's block load orders the workers
    as its booking count does (the mis-pick counts bookings)."""
    from mock_dynamo.tokens import load_tokenizer, prompts

    rng = random.Random(args.seed + 1)
    tokenizer = load_tokenizer(str(model_dir), "dynamo")
    low = args.race_tokens
    high = low + args.block_size - 1 - (low - 1) % args.block_size  # the same last block

    def body(words: list[str]) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": " ".join(words)}],
            "stream": True,
            "max_tokens": args.num_tokens,
        }

    out: list[bytes] = []
    pool = _words(rng, 8 * low).split()
    while len(out) < count:
        words = [rng.choice(pool) for _ in range(low // 2)]
        for _ in range(64):  # grow or shrink to the band (a few tokens a word)
            tokens = len(prompts(tokenizer, "chat", body(words))[0])
            if tokens < low:
                words += [rng.choice(pool) for _ in range(max(1, (low - tokens) // 3))]
            elif tokens > high:
                del words[-max(1, (tokens - high) // 3) :]
            else:
                out.append(json.dumps(body(words)).encode())
                break
    return out


def authority_state(metrics: str) -> tuple[int, int]:
    """(processes booking at the node's booking authority, processes that expose the gauge)
    from a supervisor's merged exposition: `pylon_router_authority_connected`, one sample a
    process that has an authority (absent in a process that books alone)."""
    values = [v for name, _, v in _samples(metrics) if name == "pylon_router_authority_connected"]
    return sum(1 for v in values if v == 1), len(values)


def scraped_processes(metrics: str) -> int:
    """Processes whose samples are in a supervisor's merged exposition."""
    return sum(
        1 for name, _, v in _samples(metrics) if name == "pylon_supervisor_process_scraped" and v
    )


def booking_label(scale: Scale, connected: int, gauges: int) -> str:
    """How a scale row's processes or replicas shared their bookings, in words."""
    if scale.replicas > 1:
        return "replica sync" if scale.sync else "each replica alone"
    if scale.processes == 1:
        return "one process"
    if gauges == 0:
        return "each process alone (no authority)"
    return f"authority ({connected}/{scale.processes} connected)"


def booking_after(scale: Scale, booking: str, metrics: list[str]) -> str:
    """The row's booking with what its run showed: for sync on, the peers' events applied
    (0: the sync did not work); through an authority, the bookings made alone."""
    counts: dict[str, float] = {}
    for text in metrics:
        for name, labels, value in _samples(text):
            if name == "pylon_router_replica_sync_events_total":
                key = labels.get("result", "")
            elif name == "pylon_router_authority_events_total":
                key = labels.get("event", "")
            else:
                continue
            counts[key] = counts.get(key, 0.0) + value
    if scale.sync:
        return f"{booking} ({counts.get('applied', 0):g} peer events applied)"
    if booking.startswith("authority") and counts.get("local_bookings"):
        return f"{booking}, {counts['local_bookings']:g} booked alone"
    return booking


def cores(scale: Scale | None, booking: str) -> int:
    """Selection cores that subscribe to each worker's KV events in this fleet."""
    if scale is None:
        return 1
    per_replica = 1 if booking.startswith("authority") else scale.processes
    return scale.replicas * per_replica


async def _metrics(session: aiohttp.ClientSession, admin: str) -> str:
    async with session.get(f"{admin}/metrics") as reply:
        reply.raise_for_status()
        return await reply.text()


async def booking_of(session: aiohttp.ClientSession, scale: Scale, admins: list[str]) -> str:
    """The row's booking, for `--processes P`: whether every process books at the
    authority (polled for up to 10 s: the processes connect after the supervisor's /ready)."""
    connected = gauges = 0
    if scale.processes > 1:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            metrics = await _metrics(session, admins[0])
            connected, gauges = authority_state(metrics)
            if connected == scale.processes or (
                not gauges and scraped_processes(metrics) >= scale.processes
            ):  # every process books at the authority, or every one answered without one
                break
            await asyncio.sleep(0.1)
    return booking_label(scale, connected, gauges)


def race_order(received: list[list[int]]) -> list[int]:
    """The workers' indexes in the order the client sent the requests (`received`: per worker,
    the send numbers of the requests it got). The send order stands for the booking order: one
    paced client, each request's booking made as its pylon reads it; the workers' own arrival
    times are no use (a busy host schedules each worker's process late by milliseconds)."""
    sent = sorted((n, index) for index, numbers in enumerate(received) for n in numbers)
    return [index for _, index in sent]


def race_number(record: dict[str, Any]) -> int | None:
    """The send number of a race request from a worker's record (its `x-request-id`)."""
    for name, value in record.get("headers") or []:
        if name.lower() == "x-request-id" and value.startswith("race-"):
            number = value.removeprefix("race-")
            return int(number) if number.isdigit() else None
    return None


async def _hold(session: aiohttp.ClientSession, url: str, body: bytes, n: int) -> str | None:
    """Open one stream and hold it (the workers stall it) until cancelled: its booking stays.
    An error in words if it ended first."""
    headers = {"content-type": "application/json", "x-model": MODEL, "x-request-id": f"race-{n}"}
    try:
        async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as reply:
            if reply.status != 200:
                return f"status {reply.status}: {(await reply.text())[:200]}"
            async for _ in reply.content:
                pass
            return "the stream ended (the stall fault did not hold it)"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def _received(
    session: aiohttp.ClientSession, mocks: list[str], count: int, timeout: float
) -> list[list[int]]:
    """Each worker's race requests (their send numbers), once `count` have arrived."""
    deadline = time.monotonic() + timeout
    while True:
        received = []
        for url in mocks:
            async with session.get(f"{url}/test-control") as reply:
                reply.raise_for_status()
                records = (await reply.json())["requests"]
            numbers = (race_number(r) for r in records if r["path"] == "/v1/chat/completions")
            received.append([n for n in numbers if n is not None])
        if sum(map(len, received)) >= count:
            return received
        if time.monotonic() > deadline:
            raise RuntimeError(f"race: {sum(map(len, received))} of {count} reached a worker")
        await asyncio.sleep(0.05)


async def _drained(session: aiohttp.ClientSession, admins: list[str], timeout: float) -> None:
    """Wait until no pylon counts a booking (its own or a peer's)."""
    names = ("pylon_router_active_bookings", "pylon_router_core_active_requests")
    deadline = time.monotonic() + timeout
    while True:
        left = 0.0
        for admin in admins:
            left += sum(v for n, _, v in _samples(await _metrics(session, admin)) if n in names)
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"race: {left:g} bookings still counted {timeout:.0f} s after")
        await asyncio.sleep(0.1)


async def race_at(
    session: aiohttp.ClientSession,
    mocks: list[str],
    urls: list[str],
    admins: list[str],
    race: Race,
    rate: float,
) -> float:
    """The mis-pick fraction at `rate` selections/s: `race.count` held requests, paced and
    spread over the replicas in turn; each worker's arrivals, merged in time order, replayed
    by `bench_bookings.mis_picks` (a choice not least loaded given every earlier booking)."""
    from bench_bookings import mis_picks

    for url in mocks:  # forget the trace; every stream stalls before its first event
        async with session.post(f"{url}/test-control/reset") as reply:
            reply.raise_for_status()
        async with session.put(
            f"{url}/test-control/faults", json=[{"stall_after_events": 0}]
        ) as reply:
            reply.raise_for_status()
    tasks: list[asyncio.Task[str | None]] = []
    start = time.perf_counter()
    try:
        for n, body in enumerate(race.bodies[rate]):
            delay = start + n / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_hold(session, urls[n % len(urls)], body, n)))
        received = await _received(session, mocks, race.count, 30.0)
        ended = [t.result() for t in tasks if t.done()]
        if ended:
            raise RuntimeError(f"race: {len(ended)} requests ended early, e.g. {ended[0]}")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await _drained(session, admins, 30.0)
    for url in mocks:
        async with session.delete(f"{url}/test-control/faults") as reply:
            reply.raise_for_status()
    order = race_order(received)
    return mis_picks(order, list(range(len(mocks)))) / max(1, len(order))


def _usage_hit_rates(
    measured: list[Outcome], row: Row, block_size: int = DYNAMO_BLOCK_SIZE
) -> None:
    """Hit rates from the engines' own streamed usage: tokens (cached / prompt) and full blocks
    (cached blocks / full prompt blocks, as the mocks count them). A measured reply without a
    usage chunk is an error of the row."""
    row.hit_source = HIT_FROM_USAGE
    found = [(o.prompt_tokens, o.cached_tokens or 0) for o in measured if o.prompt_tokens]
    missing = sum(1 for o in measured if o.error is None and o.prompt_tokens is None)
    if missing:
        row.errors += missing
        print(f"  {row.policy}: {missing} replies without a usage chunk", file=sys.stderr)
    prompt = sum(p for p, _ in found)
    cached = sum(c for _, c in found)
    blocks = sum(p // block_size for p, _ in found)
    hit_blocks = sum(c // block_size for _, c in found)
    row.token_hit_rate = cached / prompt if prompt else math.nan
    row.hit_rate = hit_blocks / blocks if blocks else math.nan


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def _read_metrics(texts: str | list[str], row: Row) -> None:
    """The select latency and the kv fallbacks, summed over the expositions given (one per
    replica; a supervisor's already holds every process's samples)."""
    cumulative: dict[float, float] = {}
    total = count = 0.0
    for text in [texts] if isinstance(texts, str) else texts:
        for name, labels, value in _samples(text):
            if name == "pylon_router_select_seconds_bucket":
                le = float(labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + value
            elif name == "pylon_router_select_seconds_sum":
                total += value
            elif name == "pylon_router_select_seconds_count":
                count += value
            elif (
                name == "pylon_router_decisions_total"
                and row.mode == "kv"
                and labels.get("policy") == "least-loaded"
            ):
                row.fallbacks += int(value)
    row.select_count = int(count)
    if not count:
        return
    row.select_mean_us = total / count * 1e6
    buckets = sorted(cumulative.items())

    def bound(q: float) -> str:
        for le, cumulative in buckets:
            if cumulative >= q * count:
                return "<= %g" % (le * 1e6) if math.isfinite(le) else "> 1 s"
        return "-"

    row.select_p50_us = bound(0.50)
    row.select_p99_us = bound(0.99)


def table(rows: list[Row]) -> str:
    head = (
        "| policy | requests (measured) | errors | TTFT mean ms | TTFT p50 ms | TTFT p99 ms "
        "| p99 vs round-robin | block hit rate | token hit rate | select mean us "
        "| select p50 us | select p99 us | kv fallbacks | requests per worker (whole trace) "
        "| hit rate from |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    # Each fleet kind against its own round-robin: mocks vs `round-robin`, Dynamo fleets vs
    # `dynamo:round-robin`.
    bases = {
        kind: next((r.ttft_p99_ms for r in rows if r.policy == policy), math.nan)
        for kind, policy in (("mock", "round-robin"), ("dynamo", "dynamo:round-robin"))
    }
    lines = []
    for r in rows:
        if r.failed:
            lines.append(f"| {r.policy} | FAILED: {r.failed} |" + " |" * 13)
            continue
        base = bases["dynamo" if r.policy.startswith("dynamo:") else "mock"]
        ratio = _ratio(base, r.ttft_p99_ms)
        select_mean = "-" if math.isnan(r.select_mean_us) else f"{r.select_mean_us:.0f}"
        lines.append(
            f"| {r.policy} | {r.requests} ({r.measured}) | {r.errors} | {r.ttft_mean_ms:.1f} "
            f"| {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | {ratio} | {r.hit_rate:.1%} "
            f"| {r.token_hit_rate:.1%} | {select_mean} | {r.select_p50_us} | {r.select_p99_us} "
            f"| {r.fallbacks if r.mode == 'kv' else '-'} "
            f"| {'/'.join(str(n) for n in r.per_worker)} | {r.hit_source} |"
        )
    return head + "\n".join(lines) + "\n"


def _ratio(num: float, den: float) -> str:
    """`num / den` as `1.23x`, or `-` when either is missing."""
    if math.isnan(num) or math.isnan(den) or not den:
        return "-"
    return f"{num / den:.2f}x"


def scale_table(rows: list[Row], rates: list[float]) -> str:
    """The scale rows, compact (markdown for docs/benchmarks.md): TTFT p99 and the hit rate
    on the trace, and the race's mis-pick fraction at each rate."""
    scaled = [r for r in rows if r.booking != "-" or r.policy.startswith("kv, ")]
    base = next((r.ttft_p99_ms for r in scaled if r.policy == Scale().label), math.nan)
    head = (
        "| row | bookings | TTFT p99 ms | p99 vs 1 process | block hit rate | "
        + " | ".join(f"mis-picks at {rate:g}/s" for rate in rates)
        + " |\n|---|---|---|---|---|"
        + "---|" * len(rates)
        + "\n"
    )
    lines = []
    for r in scaled:
        if r.failed:
            lines.append(f"| {r.policy} | FAILED: {r.failed} |" + " |" * (3 + len(rates)))
            continue
        race = " | ".join(
            f"{r.race[f'{rate:g}']:.1%}" if f"{rate:g}" in r.race else "-" for rate in rates
        )
        lines.append(
            f"| {r.policy} | {r.booking} | {r.ttft_p99_ms:.1f} | {_ratio(r.ttft_p99_ms, base)} "
            f"| {r.hit_rate:.1%} | {race} |"
        )
    return head + "\n".join(lines) + "\n"


def scale_target_lines(rows: list[Row]) -> list[str]:
    """The target, reported (not asserted): N local processes route as well as one (TTFT p99
    within 10 %)."""
    one = next((r for r in rows if r.policy == Scale().label and not r.failed), None)
    if one is None:
        return []
    out = []
    for r in rows:
        if r.failed or r is one or not r.policy.startswith("kv, ") or "process" not in r.policy:
            continue
        ratio = r.ttft_p99_ms / one.ttft_p99_ms
        verdict = "within" if abs(ratio - 1) <= 0.10 else "NOT within"
        out.append(
            f"target: {r.policy} ({r.booking}) TTFT p99 {r.ttft_p99_ms:.1f} ms vs "
            f"{one.ttft_p99_ms:.1f} ms for one process ({ratio - 1:+.0%}): {verdict} 10 %"
        )
    return out


def anchor_lines(rows: list[Row]) -> list[str]:
    """pylon `dynamo:kv[@W]` against Dynamo's own `dynamo:frontend-kv[@W]` on the same fleet."""
    lines = []
    by_policy = {r.policy: r for r in rows if not r.failed}
    for policy, ours in by_policy.items():
        if not policy.startswith("dynamo:kv"):
            continue
        theirs = by_policy.get(policy.replace("dynamo:kv", "dynamo:frontend-kv", 1))
        if theirs is None:
            continue
        lines.append(
            f"{policy} vs {theirs.policy}: TTFT p99 {ours.ttft_p99_ms:.1f} vs "
            f"{theirs.ttft_p99_ms:.1f} ms ({ours.ttft_p99_ms / theirs.ttft_p99_ms - 1:+.0%}), "
            f"mean {ours.ttft_mean_ms:.1f} vs {theirs.ttft_mean_ms:.1f} ms "
            f"({ours.ttft_mean_ms / theirs.ttft_mean_ms - 1:+.0%}), token hit rate "
            f"{ours.token_hit_rate:.1%} vs {theirs.token_hit_rate:.1%}"
        )
    return lines


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) >= 0
    except ValueError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--policies",
        default=None,
        help="comma-separated pylon --routing modes; kv@W: kv with --kv-overlap-weight W; "
        "vllm-router: vllm-router's cache_aware policy instead of pylon; "
        "dynamo:round-robin, dynamo:frontend-kv[@W], dynamo:kv[@W]: a real Dynamo fleet "
        f"(root: run inside `unshare --net`); `dynamo` = {DYNAMO_DEFAULT}; default "
        f"{DEFAULT_POLICIES}, none when --processes or --replicas is given",
    )
    scale = p.add_argument_group("scale rows (--routing kv on one node: processes, replicas)")
    scale.add_argument(
        "--processes",
        default="",
        help="comma-separated process counts, a row each: `pylon serve --processes P` (P > 1: "
        "a supervisor, its processes booking at the node's authority or, without one, alone)",
    )
    scale.add_argument(
        "--replicas",
        default="",
        help='comma-separated `on`/`off`, a row each: 2 separate pylons (the "nodes"), with '
        "replica sync between them or not; the client spreads the conversations over them "
        "(sync on: root, run inside `unshare --net`)",
    )
    scale.add_argument(
        "--race-rates",
        default="50,200,1000",
        help="selections/s at which each scale row's race (mis-picks) is measured",
    )
    scale.add_argument("--race-count", type=int, default=200, help="selections per race rate")
    scale.add_argument(
        "--race-tokens", type=int, default=129, help="each race prompt's length, in tokens"
    )
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--groups", type=int, default=48, help="prefix groups (system prompts)")
    p.add_argument("--sessions", type=int, default=8, help="conversations per group")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--prefix-words", type=int, default=330, help="words per system prompt")
    p.add_argument("--turn-words", type=int, default=12, help="words per user / assistant turn")
    p.add_argument("--duration", type=float, default=20.0, help="seconds the trace spans")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=1 / 3,
        help="each worker's cache, as a fraction of the trace's distinct blocks",
    )
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    p.add_argument("--ttft-ms", type=float, default=1.0, help="the mocks' fixed TTFT part")
    p.add_argument("--token-delay-ms", type=float, default=2.0)
    p.add_argument("--num-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model-dir", type=Path, default=None, help="default: a temporary one")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument(
        "--vllm-router",
        default=None,
        help="the vllm-router binary for the `vllm-router` policy (default: on PATH)",
    )
    dyn = p.add_argument_group("dynamo:* rows (real Dynamo mockers)")
    dyn.add_argument(
        "--dynamo-timing",
        choices=("profile", "builtin"),
        default="profile",
        help="profile: the mockers time prefill and decode by a profile (--planner-profile-data) "
        "made from --ttft-ms, --prefill-tokens-per-s and --token-delay-ms, the mocks' own cost "
        "model; builtin: the mocker's built-in GPU timing model",
    )
    dyn.add_argument(
        "--dynamo-speedup-ratio",
        type=float,
        default=1.0,
        help="mocker --speedup-ratio (divides every simulated delay)",
    )
    dyn.add_argument(
        "--dynamo-decode-speedup-ratio",
        type=float,
        default=1.0,
        help="mocker --decode-speedup-ratio (decode steps only)",
    )
    dyn.add_argument(
        "--dynamo-gpu-blocks",
        type=int,
        default=None,
        help="mocker --num-gpu-blocks-override (default: the mocks' cache size, from "
        "--cache-fraction)",
    )
    args = p.parse_args(argv)
    try:
        args.scales = parse_scales(args.processes, args.replicas)
        args.race_rate_list = [float(r) for r in args.race_rates.split(",") if r.strip()]
    except ValueError as exc:
        p.error(str(exc))
    if not args.race_rate_list or min(args.race_rate_list) <= 0 or args.race_count < 1:
        p.error("--race-rates must be positive numbers, --race-count >= 1")
    if args.policies is None:
        args.policies = "" if args.scales else DEFAULT_POLICIES
    args.policy_list = expand_policies(args.policies)
    if args.policies == DEFAULT_POLICIES and not (args.vllm_router or shutil.which("vllm-router")):
        print(
            "vllm-router not found (pip install vllm-router): its row is left out", file=sys.stderr
        )
        args.policy_list.remove("vllm-router")
    for policy in args.policy_list:
        if not valid_policy(policy):
            p.error(
                f"unknown policy {policy!r}; choose from {', '.join(POLICIES + DYNAMO_POLICIES)}, "
                f"or {', '.join(WEIGHTED)} with @WEIGHT"
            )
    if any(is_dynamo(policy) for policy in args.policy_list) and args.block_size != (
        DYNAMO_BLOCK_SIZE
    ):
        p.error(f"dynamo:* rows need --block-size {DYNAMO_BLOCK_SIZE} (the mockers' block size)")
    return args


def expand_policies(text: str) -> list[str]:
    """The comma-separated list, with `dynamo` standing for the default Dynamo rows."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if item == "dynamo":
            out += DYNAMO_DEFAULT.split(",")
        elif item:
            out.append(item)
    return out


def is_dynamo(policy: str) -> bool:
    return policy.startswith("dynamo:")


def valid_policy(policy: str) -> bool:
    mode, at, weight = policy.partition("@")
    if mode not in POLICIES + DYNAMO_POLICIES:
        return False
    return not at or (mode in WEIGHTED and _is_number(weight))


# -- the private network namespace the dynamo:* rows need ------------------------------------


def _interfaces() -> list[str]:
    """The network interfaces this process's namespace sees (netlink: not /sys)."""
    return sorted(name for _, name in socket.if_nameindex())


def _loopback_works() -> bool:
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=1.0):
                return True
    except OSError:
        return False


WHY_DYNAMO = (
    "the dynamo:* rows must run in a private network namespace (the Dynamo mocker binds "
    "its KV-event PUB sockets on all interfaces)"
)
WHY_SYNC = (
    "the `--replicas on` row must run in a private network namespace (Dynamo's replica sync "
    "binds its PUB on all interfaces, unauthenticated)"
)


def netns_guard(argv: list[str], why: str = WHY_DYNAMO) -> int | None:
    """None when this process may start the rows that bind on all interfaces here: it is in a
    network namespace whose only interface is loopback, and loopback is up. Otherwise re-run
    this script under `unshare --net` (root only; `ip link set lo up` first) and return its
    exit status, or refuse (2) with one clear line when that cannot be done (`why`: the rows'
    reason, in that line)."""
    if _interfaces() == ["lo"]:
        if _loopback_works():
            return None
        ip = shutil.which("ip")
        if ip:
            subprocess.run([ip, "link", "set", "lo", "up"], check=False)
        if _loopback_works():
            return None
        print(
            f"bench_routing: {why}, and loopback is down here: `ip link set lo up`", file=sys.stderr
        )
        return 2
    if os.environ.get(NETNS_ENV):
        print(
            f"bench_routing: {why}, but after `unshare --net` this process still sees "
            f"{', '.join(_interfaces())}: refusing",
            file=sys.stderr,
        )
        return 2
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    if os.geteuid() != 0 or not unshare or not ip:
        missing = "not root" if os.geteuid() != 0 else "`unshare` or `ip` not found"
        print(
            f"bench_routing: {why}; this script re-executes itself under `unshare --net` for "
            f"that, which needs root, `unshare` and `ip` ({missing}): run it as root, or inside "
            "your own `unshare --net sh -c 'ip link set lo up && ...'`",
            file=sys.stderr,
        )
        return 2
    cmd = [
        unshare, "--net", "--", "sh", "-c", '"$0" link set lo up && exec "$@"', ip,
        sys.executable, str(Path(__file__).resolve()), *argv,
    ]  # fmt: skip
    env = {**os.environ, NETNS_ENV: os.readlink("/proc/self/ns/net")}
    print("bench_routing: re-running inside `unshare --net` (loopback only)", file=sys.stderr)
    child = subprocess.Popen(cmd, env=env)

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # the child got the terminal's SIGINT too: let it clean up
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    dynamo_rows = any(is_dynamo(policy) for policy in args.policy_list)
    if dynamo_rows or any(scale.sync for scale in args.scales):
        status = netns_guard(argv, WHY_DYNAMO if dynamo_rows else WHY_SYNC)
        if status is not None:
            return status
    logs = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    fleets: list[Fleet | DynamoFleet] = []

    def on_term(signum: int, _frame: FrameType | None) -> None:
        for fleet in fleets:
            fleet.close()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    model_dir = build_model_dir(args.model_dir or logs / "model")
    trace = build_trace(args, model_dir)
    cache_blocks = max(1, round(trace.distinct_blocks * args.cache_fraction))
    gpu_blocks = args.dynamo_gpu_blocks or cache_blocks
    rate = len(trace.requests) / max(trace.requests[-1].at, 1e-9)
    print(
        f"trace: {len(trace.requests)} requests, {args.groups} groups x {args.sessions} "
        f"sessions x {args.turns} turns, {rate:.1f} req/s over {trace.requests[-1].at:.1f} s; "
        f"prompt tokens mean {statistics.fmean(trace.prompt_tokens):.0f} "
        f"(system prompt ~{trace.prefix_tokens:.0f}); {trace.distinct_blocks} distinct blocks, "
        f"{cache_blocks} per worker cache; a full miss costs "
        f"~{statistics.fmean(trace.prompt_tokens) / args.prefill_tokens_per_s * 1000:.0f} ms",
        file=sys.stderr,
    )
    if any(is_dynamo(policy) for policy in args.policy_list):
        print(
            f"dynamo:* rows: {args.workers} mockers, --num-gpu-blocks-override {gpu_blocks}, "
            f"timing {args.dynamo_timing}, --speedup-ratio {args.dynamo_speedup_ratio:g}, "
            f"--decode-speedup-ratio {args.dynamo_decode_speedup_ratio:g}; load average before: "
            + " ".join(f"{x:.2f}" for x in os.getloadavg()),
            file=sys.stderr,
        )
    race = None
    if args.scales:
        bodies = race_bodies(args, model_dir, args.race_count * len(args.race_rate_list))
        race = Race(
            args.race_rate_list,
            args.race_count,
            {
                rate: bodies[i * args.race_count : (i + 1) * args.race_count]
                for i, rate in enumerate(args.race_rate_list)
            },
        )
    rows: list[Row] = []
    plan: list[tuple[str, Scale | None]] = [(policy, None) for policy in args.policy_list]
    plan += [(scale.label, scale) for scale in args.scales]
    try:
        for policy, scale in plan:
            fleet: Fleet | DynamoFleet
            if is_dynamo(policy):
                fleet = DynamoFleet(args, policy, model_dir, gpu_blocks, logs)
            else:
                fleet = Fleet(args, policy, model_dir, cache_blocks, logs, scale)
            fleets.append(fleet)
            began = time.monotonic()
            try:
                fleet.start()
                row = asyncio.run(replay(fleet, trace, race if scale else None))
            except Exception as exc:  # one failed policy must not hide the others
                row = Row(policy, fleet.mode, failed=f"{type(exc).__name__}: {exc}")
            finally:
                fleet.close()
            rows.append(row)
            race_text = ", ".join(f"{v:.1%} at {k}/s" for k, v in row.race.items())
            print(
                f"  {policy}: done in {time.monotonic() - began:.0f} s "
                f"(p99 {row.ttft_p99_ms:.1f} ms, hit {row.hit_rate:.1%}, "
                f"client max lag {row.max_lag_ms:.0f} ms"
                + (f"; {row.booking}; mis-picks {race_text}" if scale else "")
                + ")",
                file=sys.stderr,
            )
    finally:
        for fleet in fleets:
            fleet.close()
    print(table(rows))
    if args.scales:
        print(scale_table(rows, args.race_rate_list))
        for line in scale_target_lines(rows):
            print(line)
    for line in anchor_lines(rows):
        print(line, file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "trace": {
                        "requests": len(trace.requests),
                        "distinct_blocks": trace.distinct_blocks,
                        "cache_blocks_per_worker": cache_blocks,
                        "dynamo_gpu_blocks_per_worker": gpu_blocks,
                        "prompt_tokens_mean": statistics.fmean(trace.prompt_tokens),
                    },
                    "rows": [asdict(r) for r in rows],
                },
                indent=2,
            )
        )
    failed = any(r.failed or r.errors for r in rows)
    if failed or args.keep_logs:
        print(f"logs kept in {logs}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""How long `Planner.plan` holds the event loop, per body shape and size.

`Planner.plan` runs synchronously on the one event loop that relays every SSE stream of the
node, so its wall time for one request *is* the loop hold. The planner is built as
pylon/assemble.py builds it (dynamo backend, derived priority) and fed a `TunnelRequest` from
`parse_request`. For each shape and size the script times `--repeat` calls and prints the median
in ms per MiB and the longest single call (the max loop hold) in ms.

    .venv/bin/python scripts/bench_plan.py                      # 1, 5, 20 MiB, this tree
    .venv/bin/python scripts/bench_plan.py --baseline main      # before (git ref) and after
    .venv/bin/python scripts/bench_plan.py --sizes 1 --shapes tiny_arrays,deep_nesting
    .venv/bin/python scripts/bench_plan.py --memory             # tracemalloc peak, one call
    .venv/bin/python scripts/bench_plan.py --components --sizes 20   # each candidate pass alone
    .venv/bin/python scripts/bench_plan.py --offload --sizes 20      # loop lag, plan off the loop

`--baseline REF` loads `pylon/core/plan.py` as it is at the git ref REF into a separate module
(the rest of pylon is this tree's) and times both in the same process, interleaved per shape.
A call that raises is timed too: the "result" column shows the outcome (`ok`, the problem code
of a `PylonError`, or the exception class that would have escaped, e.g. `RecursionError`).
`--components` times the candidate passes one by one instead (orjson, the stdlib, msgspec
decoding to objects, to raw members, the skim, the key census, the UTF-8 check); `*` marks a
pass that refused the body. `--offload` runs `Planner.plan` on an asyncio loop inline, on a
worker thread and in a worker process, and reports the wall time and the longest wait of a 1 ms
ticker on the same loop (what every SSE relay would see).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import orjson  # noqa: E402

from pylon.adapters import AdapterOptions, build_adapter  # noqa: E402
from pylon.core import body as body_module  # noqa: E402
from pylon.core import plan as current_plan  # noqa: E402
from pylon.core.contract import TunnelRequest, parse_request  # noqa: E402
from pylon.core.errors import PylonError  # noqa: E402

MiB = 1024 * 1024
HEADERS = [(b"x-request-id", b"bench-1"), (b"x-model", b"m"), (b"x-priority", b"5")]

# --- body shapes ------------------------------------------------------------------------------

_ASCII_TEXT = (
    "the quick brown fox jumps over a lazy dog while tokens stream past; "
    'def f(x):\n    return {"k": x * 2}  # code, quotes "and" \\ backslashes\t'
)
_ASCII_WORDS = _ASCII_TEXT.split(" ")
_UNICODE_WORDS = ["café", "naïve", "日本語の文章", "данные", "😀", "→", "中文内容", "ελληνικά", "x"]


def _text(size: int, words: list[str], seed: int) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    n = 0
    while n < size:
        word = rng.choice(words)
        parts.append(word)
        n += len(word.encode()) + 1
    return " ".join(parts)


def _chat(content: str, ensure_ascii: bool, **extra: Any) -> bytes:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": content},
        ],
        "stream": True,
        "max_tokens": 512,
        "temperature": 0.7,
        **extra,
    }
    return json.dumps(body, ensure_ascii=ensure_ascii).encode("utf-8")


def ascii_content(size: int) -> bytes:
    return _chat(_text(size, _ASCII_WORDS, 1), True)


def utf8_content(size: int) -> bytes:
    # Raw UTF-8; a non-ASCII character is 2-4 bytes, so fewer characters fill the size.
    return _chat(_text(size, _UNICODE_WORDS + _ASCII_WORDS, 2), False)


def escaped_content(size: int) -> bytes:
    # json.dumps' default: every non-ASCII character as \uXXXX (6 or 12 bytes).
    return _chat(_text(size * 10 // 19, _UNICODE_WORDS + _ASCII_WORDS, 3), True)


def many_messages(size: int) -> bytes:
    rng = random.Random(4)
    messages: list[dict[str, Any]] = []
    n = 0
    while n < size:
        role = rng.choice(["user", "assistant", "tool"])
        message: dict[str, Any] = {
            "role": role,
            "content": _text(rng.randint(20, 200), _ASCII_WORDS, n),
        }
        if role == "tool":
            message["tool_call_id"] = f"call_{n}"
        messages.append(message)
        n += len(message["content"]) + 40
    return json.dumps({"model": "m", "messages": messages, "stream": True}).encode()


def token_ids(size: int) -> bytes:
    rng = random.Random(5)
    ids = [rng.randrange(0, 152_000) for _ in range(size // 7)]
    return json.dumps({"model": "m", "prompt": ids, "max_tokens": 16}).encode()


def pretty_printed(size: int) -> bytes:
    # json.dumps(indent=2): whitespace everywhere, and before the closing brace.
    return json.dumps(json.loads(many_messages(size * 3 // 4)), indent=2).encode() + b"\n"


def strip_nvext(size: int) -> bytes:
    nvext = {"backend_instance_id": 7, "greed_sampling": True}
    return _chat(_text(size, _ASCII_WORDS, 6), True, nvext=nvext)


def strip_cache_salt(size: int) -> bytes:
    return _chat(_text(size, _ASCII_WORDS, 7), True, cache_salt="tenant-a")


def strip_escaped(size: int) -> bytes:
    # The costliest realistic strip: every character of a long escaped string re-encoded.
    return _chat(_text(size * 10 // 19, _UNICODE_WORDS + _ASCII_WORDS, 8), True, cache_salt="t")


def dup_nvext(size: int) -> bytes:
    body = _chat(_text(size, _ASCII_WORDS, 9), True, nvext={"greed_sampling": True})
    return body[:-1] + b',"nvext":{"ignore_eos":true}}'


# Hostile: the most containers per byte a body can hold.
def tiny_arrays(size: int) -> bytes:
    return b'{"x":[' + b"[]," * (size // 3) + b"[]]}"


def tiny_objects(size: int) -> bytes:
    return b"{" + b'"a":{},' * (size // 7) + b'"a":{}}'


def tiny_arrays_escaped_strip(size: int) -> bytes:
    # ... and takes every slow path of the old planner: a \u escape and a field to strip.
    return b'{"cache_salt":"\\u0041","x":[' + b"[]," * (size // 3) + b"[]]}"


def many_keys_strip(size: int) -> bytes:
    # Distinct top-level keys (a dict entry each, for any parser that builds one) and a strip.
    return b'{"cache_salt":"t",' + b",".join(b'"k%d":0' % i for i in range(size // 10)) + b"}"


def huge_nvext(size: int) -> bytes:
    keys = b",".join(b'"k%d":0' % i for i in range(size // 10))
    return b'{"nvext":{"dp_rank":1,' + keys + b"}}"


def repeated_stream(size: int) -> bytes:
    return b"{" + b'"stream":true,' * (size // 14) + b'"stream":true}'


def deep_nesting(size: int) -> bytes:
    del size  # depth, not size: 1,000 levels is 2 KB
    return b'{"cache_salt":"t","x":' + b"[" * 1000 + b"]" * 1000 + b"}"


SHAPES: dict[str, Callable[[int], bytes]] = {
    "ascii_content": ascii_content,
    "utf8_content": utf8_content,
    "escaped_content": escaped_content,
    "many_messages": many_messages,
    "token_ids": token_ids,
    "pretty_printed": pretty_printed,
    "strip_nvext": strip_nvext,
    "strip_cache_salt": strip_cache_salt,
    "strip_escaped": strip_escaped,
    "dup_nvext": dup_nvext,
    "tiny_arrays": tiny_arrays,
    "tiny_objects": tiny_objects,
    "tiny_arrays_escaped_strip": tiny_arrays_escaped_strip,
    "many_keys_strip": many_keys_strip,
    "huge_nvext": huge_nvext,
    "repeated_stream": repeated_stream,
    "deep_nesting": deep_nesting,
}
SIZE_FREE = {"deep_nesting"}

# --- timing -------------------------------------------------------------------------------------


def load_baseline(ref: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{ref}:pylon/core/plan.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    spec = importlib.util.spec_from_loader("pylon_plan_baseline", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{ref}:pylon/core/plan.py", "exec"), module.__dict__)
    return module


def make_planner(module: ModuleType) -> Any:
    return module.Planner(build_adapter("dynamo", AdapterOptions(3600), derive=True))


def request() -> TunnelRequest:
    parsed = parse_request(b"POST", b"/v1/chat/completions", HEADERS)
    assert isinstance(parsed, TunnelRequest)
    return parsed


def outcome(planner: Any, req: TunnelRequest, body: bytes) -> str:
    try:
        planner.plan(req, body)
    except PylonError as error:
        return f"{error.status} {error.code.value}"
    except BaseException as error:  # what would escape the planner (no HTTP answer at all)
        return type(error).__name__
    return "ok"


def time_once(planner: Any, req: TunnelRequest, body: bytes) -> float:
    gc.collect()
    start = time.perf_counter()
    with contextlib.suppress(BaseException):  # timed like a success; `outcome` reports it
        planner.plan(req, body)
    return time.perf_counter() - start


def peak_bytes(planner: Any, req: TunnelRequest, body: bytes) -> int:
    gc.collect()
    tracemalloc.start()
    with contextlib.suppress(BaseException):
        planner.plan(req, body)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


# --- the building blocks, one by one (--components) ------------------------------------------


def components() -> dict[str, Callable[[bytes], object]]:
    """Each candidate pass over a whole body, timed alone: what the choice in body.py rests on."""

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        return dict(pairs)

    return {
        "orjson.loads": orjson.loads,
        "json.loads": json.loads,
        "json pairs_hook": lambda b: json.loads(b, object_pairs_hook=pairs_hook),
        "json.dumps(loads)": lambda b: json.dumps(json.loads(b), ensure_ascii=False).encode(),
        "msgspec Any": msgspec.json.Decoder().decode,
        "msgspec dict[str,Raw]": msgspec.json.Decoder(dict[str, msgspec.Raw]).decode,
        "msgspec skim": body_module._TOP_DECODER.decode,
        "key census": body_module._top_level_keys,
        "utf-8 check": body_module._check_utf8,
    }


def run_components(shapes: list[str], size: int, repeat: int) -> None:
    passes = components()
    print("| shape | " + " | ".join(passes) + " |")
    print("|" + "---|" * (len(passes) + 1))
    for shape in shapes:
        text = SHAPES[shape](size)
        cells = []
        for call in passes.values():
            times = []
            for _ in range(repeat):
                gc.collect()
                start = time.perf_counter()
                try:
                    call(text)
                except Exception:  # a pass that refuses the body still spent the time
                    cells_note = "*"
                else:
                    cells_note = ""
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3 / (len(text) / MiB):.2f}{cells_note}")
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)


# --- on the loop, on a thread, in a process (--offload) ---------------------------------------

_OFFLOAD_PLANNER: Any = None


def _plan_in_worker(text: bytes) -> bytes:
    global _OFFLOAD_PLANNER
    if _OFFLOAD_PLANNER is None:
        _OFFLOAD_PLANNER = make_planner(current_plan)
    result: bytes = _OFFLOAD_PLANNER.plan(request(), text).body
    return result


async def _loop_lag(text: bytes, pool: Executor | None) -> tuple[float, float]:
    """Wall time of one plan, and the longest a 1 ms ticker on the same loop waited meanwhile."""
    loop = asyncio.get_running_loop()
    lag = 0.0
    done = False

    async def ticker() -> None:
        nonlocal lag
        while not done:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - start - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    if pool is None:
        _plan_in_worker(text)
    else:
        await loop.run_in_executor(pool, _plan_in_worker, text)
    wall = time.perf_counter() - start
    done = True
    await task
    return wall * 1e3, lag * 1e3


async def run_offload(shapes: list[str], size: int, repeat: int) -> None:
    threads = ThreadPoolExecutor(1)
    processes = ProcessPoolExecutor(1)
    await asyncio.get_running_loop().run_in_executor(processes, _plan_in_worker, b"{}")
    print("| shape | MiB | " + " | ".join(f"{m} wall ms | {m} loop lag ms" for m in _MODES) + " |")
    print("|" + "---|" * (2 + 2 * len(_MODES)))
    for shape in shapes:
        text = SHAPES[shape](size)
        cells = []
        for pool in (None, threads, processes):
            runs = [await _loop_lag(text, pool) for _ in range(repeat)]
            cells += [f"{statistics.median(r[i] for r in runs):.1f}" for i in (0, 1)]
        print(f"| {shape} | {len(text) / MiB:.1f} | " + " | ".join(cells) + " |", flush=True)
    threads.shutdown()
    processes.shutdown()


_MODES = ("inline", "thread", "process")


@dataclass
class Row:
    shape: str
    mib: float
    label: str
    median_ms: float
    max_ms: float
    result: str
    peak_mb: float | None

    @property
    def ms_per_mib(self) -> float:
        return self.median_ms / self.mib


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,5,20", help="body sizes in MiB (default 1,5,20)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--repeat", type=int, default=5, help="calls per row (median, max)")
    parser.add_argument("--baseline", metavar="REF", help="also time plan.py at this git ref")
    parser.add_argument("--memory", action="store_true", help="tracemalloc peak of one call")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--components", action="store_true", help="time each candidate pass alone (ms/MiB)"
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="loop lag with plan inline, on a thread, in a process (largest size)",
    )
    args = parser.parse_args()
    size = int(float(args.sizes.split(",")[-1]) * MiB)
    sized = [shape for shape in args.shapes.split(",") if shape not in SIZE_FREE]
    if args.components:
        run_components(sized, size, args.repeat)
        return 0
    if args.offload:
        asyncio.run(run_offload(sized, size, args.repeat))
        return 0

    planners: list[tuple[str, Any]] = []
    if args.baseline:
        planners.append((f"before ({args.baseline})", make_planner(load_baseline(args.baseline))))
    planners.append(("after" if args.baseline else "this tree", make_planner(current_plan)))
    sys.setrecursionlimit(1000)  # CPython's default, as in pylon serve
    req = request()
    rows: list[Row] = []
    for shape in args.shapes.split(","):
        sizes = ["0"] if shape in SIZE_FREE else args.sizes.split(",")
        for size_text in sizes:
            body = SHAPES[shape](int(float(size_text) * MiB))
            mib = len(body) / MiB
            for label, planner in planners:
                result = outcome(planner, req, body)
                times = [time_once(planner, req, body) for _ in range(args.repeat)]
                peak = peak_bytes(planner, req, body) / 1e6 if args.memory else None
                row = Row(
                    shape,
                    mib,
                    label,
                    statistics.median(times) * 1e3,
                    max(times) * 1e3,
                    result,
                    peak,
                )
                rows.append(row)
                print(
                    f"{shape:28} {mib:7.2f} MiB {label:16} {row.median_ms:9.2f} ms "
                    f"{row.ms_per_mib:8.2f} ms/MiB max {row.max_ms:9.2f} ms  {result}"
                    + (f"  peak {peak:.0f} MB" if peak is not None else ""),
                    file=sys.stderr,
                    flush=True,
                )
    print_table(rows, [label for label, _ in planners], args.memory)
    if args.json_out:
        args.json_out.write_text(json.dumps([vars(r) for r in rows], indent=1))
    return 0


def print_table(rows: list[Row], labels: list[str], memory: bool) -> None:
    head = ["shape", "MiB"]
    for label in labels:
        head += [f"{label} ms/MiB", "max ms", "result"] + (["peak MB"] if memory else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    by_key: dict[tuple[str, float], dict[str, Row]] = {}
    for row in rows:
        by_key.setdefault((row.shape, row.mib), {})[row.label] = row
    for (shape, mib), cells in by_key.items():
        line = [shape, f"{mib:.3f}" if mib < 0.1 else f"{mib:.1f}"]
        for label in labels:
            row = cells[label]
            line += [f"{row.ms_per_mib:.1f}", f"{row.max_ms:.1f}", row.result]
            if memory:
                line.append(f"{row.peak_mb:.0f}" if row.peak_mb is not None else "")
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    sys.exit(main())

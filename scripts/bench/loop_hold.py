"""Loop hold with large prompts: how long one chat request of 1 KiB .. 1 MiB keeps pylon's event
loop from serving anything else, with `--routing kv` (tokenization included) and `--routing off`.

pylon runs in this process (`pylon.run.start`, the wiring `pylon serve` runs) on a plain asyncio
loop, next to two loop probes and nothing else of the benchmark:

- **sampler**: a task that sleeps 1 ms in a loop and records how late it wakes. That is what any
  other stream on the loop sees (a relay waiting for its turn): every callback, the selector, and
  the time the loop thread waits for the GIL while another thread (the tokenizer's) holds it. It
  reads up to 1 ms low (a hold that starts just before a wake-up is cut by the sleep still due).
- **callback**: `asyncio.events.Handle._run` wrapped with `time.perf_counter`: the longest
  single callback (a task step, a transport's read) exactly, and what it was (the task's
  coroutine, or the callback's name). A private method of asyncio, patched only here, in a
  benchmark; `loop.slow_callback_duration` would need debug mode, which slows every callback.
  Under `--loop uvloop` (pylon's production loop) only the sampler runs.

Everything else runs outside the loop: the engines are two mock_dynamo subprocesses (`--worker
url=`), the client is a thread that writes each request over a fresh HTTP/1.1 connection
(`Connection: close`) with one `sendall`, and waits for the whole answer.

The `kv` router gets the selection core (`--native fake`: `tests/router_ffi/fake_native.py`,
which costs nothing, so the row is pylon's own Python; `--native dynamo`: Dynamo 1.6.1's
`SelectionService`, which hashes the ids inside the select, while the loop waits on the blocking
`select_and_reserve`) and the tokenizer `scripts/dynamo_stack.py`'s tiny offline byte-level BPE
(or `--model-dir`) in the dialect of `--backend dynamo`, with its limits raised so that a 1 MiB
body is tokenized (`max_body_bytes` 4 MiB; `max_prompt_tokens` 16 Mi: the tiny vocabulary makes
about a token per 1.3 bytes of this text, a real one about a token per 3-4). Every request is a
different conversation (no segment cache hit): a system prompt and user/assistant turns of
~2 KiB of multilingual text (`--shape turns`), or one user message of the whole size (`--shape
one`).

Printed per mode and size, over `--repeat` requests (the median, and the max in brackets): the
longest loop hold while the request was in flight (sampler, and the longest callback with what
it was), the tokenize time (in whichever thread it ran), the prompt's token count and the
request's wall time; first, an `idle` row: the same probes over 0.3 s with no request, the
host's own noise (on a shared VM the OS runs other work on the loop's core: a few ms).

    PYTHONPATH=. .venv/bin/python scripts/bench/loop_hold.py
    PYTHONPATH=. .venv/bin/python scripts/bench/loop_hold.py --modes kv,kv-inline --shape one
    PYTHONPATH=. .venv/bin/python scripts/bench/loop_hold.py --profile   # cProfile, 1 MiB, kv
    PYTHONPATH=. .venv/bin/python scripts/bench/loop_hold.py --threshold --sizes 1024,4096,16384

`--threshold` (no HTTP) prints where the thread hop starts to pay: per body size, the tokenize
time inline and through the one-thread executor, cold and warm (segment cache hits), and the
executor's own round trip.

`kv-inline` is `kv` with `pylon.routing.kv.INLINE_TOKENIZE_BYTES` set beyond every body: every
prompt tokenized on the loop, as before the tokenizer thread. The script also runs against a tree
from before `pylon.run` (`pylon.app.start`, `build_routing(settings, ...)`, synchronous
`Router.book`): `PYTHONPATH=OLD_TREE .venv/bin/python scripts/bench/loop_hold.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import pstats
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# pylon comes from PYTHONPATH (this tree or an older one); scripts/ for dynamo_stack; this dir
# last, as its router_ffi.py (a benchmark) would shadow the package.
sys.path = [str(ROOT / "scripts"), *(p for p in sys.path if Path(p).resolve() != HERE), str(HERE)]

from procs import ProcessGroup, free_port, start_listening  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
SIZES = (1 * KiB, 64 * KiB, 256 * KiB, 1 * MiB)
MODEL = "mock-model"
CHAT_PATH = "/v1/chat/completions"
SAMPLE_SECONDS = 0.001
IDLE_SECONDS = 0.3  # the longest a 1 MiB request is in flight

# A few sentences per script: Latin with accents, CJK, Japanese, Korean, Cyrillic, Arabic,
# Hebrew, Devanagari, emoji, code; shuffled into different turns for every request.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the request waits for its worker.",
    "Größere Anfragen brauchen länger, aber die Schleife darf nicht warten.",
    "Ça coûte cher de tokeniser un mégaoctet, même pour un routeur très rapide.",
    "El modelo responde en español cuando la conversación lo pide, señor.",
    "今天天气很好，我们去公园散步，然后回家吃饭。",  # noqa: RUF001 (CJK commas, on purpose)
    "東京の空は青く、電車は時間どおりに到着します。カタカナ、ひらがな。",
    "한국어 문장은 띄어쓰기가 있어서 토큰화가 조금 다릅니다.",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "مرحبا بالعالم، هذه جملة عربية طويلة لاختبار الترميز.",
    "שלום עולם, זה משפט בעברית עם מילים רבות.",
    "यह एक हिंदी वाक्य है जो टोकन गिनने के लिए है।",
    "🙂🚀 👩‍👩‍👧‍👦 emoji with ZWJ sequences 👍🏽 and skin tones ✊🏿.",
    "def route(prompt: str) -> int:\n    return hash(prompt) % workers  # not how pylon does it",
    "Numbers: 3.14159, 2**64 = 18446744073709551616, 1e-9, 0xDEADBEEF.",
]


def words(rng: random.Random, size: int) -> str:
    """About `size` bytes of shuffled multilingual text, unique to this `rng`."""
    out: list[str] = []
    length = 0
    while length < size:
        sentence = rng.choice(SENTENCES)
        # A random number in every sentence: no two requests share a turn (the tokenizer's
        # segment cache would otherwise make repeats cheap).
        piece = f"{sentence} ({rng.randrange(1 << 30)})"
        out.append(piece)
        length += len(piece.encode()) + 1
    return " ".join(out)


def chat_body(size: int, shape: str, seed: int) -> bytes:
    """A chat completion request of `size` bytes or a few less, ending on a user turn."""
    rng = random.Random(seed)
    head: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "stream": False}
    if shape == "one":
        messages = [{"role": "user", "content": words(rng, size - 120)}]
    else:
        messages = [{"role": "system", "content": words(rng, 600)}]
        used = len(_encode({**head, "messages": messages}))
        while (room := size - used - 40) > 0:  # 40: a message's keys and quotes
            role = "user" if messages[-1]["role"] != "user" else "assistant"
            messages.append({"role": role, "content": words(rng, min(2 * KiB, room))})
            used += len(_encode(messages[-1])) + 1
        messages[-1]["role"] = "user"
    body = _encode({**head, "messages": messages})
    while len(body) > size:  # trim the last message from its end
        excess = len(body) - size
        messages[-1]["content"] = messages[-1]["content"][: -max(1, excess // 4)]
        body = _encode({**head, "messages": messages})
    return body


def _encode(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# --- the loop probes ---------------------------------------------------------------------


@dataclass
class Window:
    """The longest holds seen since `LoopProbes.begin`."""

    sampler: float = 0.0  # seconds the sampler woke late, at most
    callback: float = 0.0  # seconds of the longest single callback
    what: str = ""  # that callback


class LoopProbes:
    """The sampler task and the callback timer (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, time_callbacks: bool) -> None:
        self._loop = loop
        self.window = Window()
        self._task: asyncio.Task[None] | None = None
        self._restore: Callable[[], None] | None = None
        if time_callbacks:
            self._restore = self._wrap_handles()

    def _wrap_handles(self) -> Callable[[], None]:
        handle = asyncio.events.Handle
        original = handle._run
        clock = time.perf_counter
        probes = self

        def timed_run(self: asyncio.Handle) -> None:
            started = clock()
            original(self)
            spent = clock() - started
            if spent > probes.window.callback:
                probes.window.callback = spent
                probes.window.what = _describe(self)

        handle._run = timed_run  # type: ignore[method-assign]

        def restore() -> None:
            handle._run = original  # type: ignore[method-assign]

        return restore

    def start(self) -> None:
        self._task = self._loop.create_task(self._sample())

    async def _sample(self) -> None:
        clock = time.perf_counter
        while True:
            started = clock()
            await asyncio.sleep(SAMPLE_SECONDS)
            late = clock() - started - SAMPLE_SECONDS
            if late > self.window.sampler:
                self.window.sampler = late

    def begin(self) -> None:
        self.window = Window()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._restore is not None:
            self._restore()


def _describe(handle: asyncio.Handle) -> str:
    callback = getattr(handle, "_callback", None)
    task = getattr(callback, "__self__", None)
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__name__)}"
    return str(getattr(callback, "__qualname__", repr(callback)))


# --- the tokenizer, timed ----------------------------------------------------------------


@dataclass
class Tokenized:
    seconds: float
    tokens: int
    on_loop: bool


@dataclass
class TimedTokenizer:
    """The real tokenizer, recording how long each `prompt_tokens` took and on which thread."""

    inner: Any
    loop_thread: int
    calls: list[Tokenized] = field(default_factory=list)

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        started = time.perf_counter()
        tokens: list[int] | None = self.inner.prompt_tokens(path, body)
        spent = time.perf_counter() - started
        on_loop = threading.get_ident() == self.loop_thread
        self.calls.append(Tokenized(spent, len(tokens or ()), on_loop))
        return tokens

    @property
    def has_chat_template(self) -> bool:
        return bool(self.inner.has_chat_template)

    @property
    def directory(self) -> Path:
        return Path(self.inner.directory)


def load_tokenizer(model_dir: Path) -> Any:
    from pylon.tokenize import Tokenizer

    return Tokenizer(
        model_dir, dialect="dynamo", max_body_bytes=4 * MiB, max_prompt_tokens=16 * MiB
    )


# --- pylon, in process -------------------------------------------------------------------


def _pylon_api() -> tuple[Any, Callable[[Any], Any]]:
    """`start` and what `build_routing` takes, in this tree or one from before `pylon.run`."""
    try:
        from pylon.assemble import routing_options
        from pylon.run import start
    except ImportError:  # before the issue-16 split: pylon.app, build_routing(settings, ...)
        from pylon.app import start

        return start, lambda settings: settings
    return start, routing_options


def _native(kind: str) -> Callable[[], Any] | None:
    if kind == "dynamo":
        return None  # build_routing loads Dynamo's own
    from tests.router_ffi.fake_native import FakeNative

    fake = FakeNative()
    return lambda: fake


@contextlib.asynccontextmanager
async def pylon(
    mode: str, engines: list[str], tokenizer: TimedTokenizer, native: str
) -> AsyncIterator[str]:
    """pylon in `mode` ("off", "kv", "kv-inline") in front of `engines`; yields its URL."""
    from pylon.routing.build import build_routing
    from pylon.settings import load_settings

    start, routing_input = _pylon_api()
    base: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "backend": "dynamo",
        "log_level": "warning",
        "model": [MODEL],
    }
    if mode == "off":
        settings = load_settings({**base, "upstream": engines[0]})
        async with start(settings) as running:
            yield running.url
        return
    dead = free_port()  # a KV-event endpoint no one publishes on: the core's view stays empty
    specs = [f"url={url},kv-events=tcp://127.0.0.1:{dead},block-size=16" for url in engines]
    settings = load_settings(
        {
            **base,
            "routing": "kv",
            "worker": specs,
            "tokenizer": str(tokenizer.directory),
            "worker_health_interval": 3600.0,
        }
    )
    from pylon.observe import LogObserver

    observer = LogObserver()
    parts = await build_routing(
        routing_input(settings), observer, tokenizer=tokenizer, native=_native(native)
    )
    with _inline_tokenize(mode == "kv-inline"):
        async with start(settings, observer, wait_ready=True, routing=parts) as running:
            yield running.url


@contextlib.contextmanager
def _inline_tokenize(inline: bool) -> Iterator[None]:
    """`kv-inline`: every body at or under the inline threshold (the tree before the thread
    has no threshold: everything is inline there already)."""
    import pylon.routing.kv as kv

    before = getattr(kv, "INLINE_TOKENIZE_BYTES", None)
    if inline and before is not None:
        kv.INLINE_TOKENIZE_BYTES = 1 << 62  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if before is not None:
            kv.INLINE_TOKENIZE_BYTES = before  # type: ignore[attr-defined]


# --- the client (a thread) ---------------------------------------------------------------


def post(url: str, body: bytes, request_id: str) -> int:
    """One request on a fresh connection; returns the status once the whole answer is read."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\nx-request-id: {request_id}\r\n"
        f"x-model: {MODEL}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    return int(answer.split(b" ", 2)[1])


# --- one mode --------------------------------------------------------------------------------


@dataclass
class Sample:
    sampler: float
    callback: float
    what: str
    tokenize: float | None
    tokens: int
    on_loop: bool | None
    wall: float


@dataclass
class Row:
    mode: str
    size: int
    samples: list[Sample]


async def run_mode(
    mode: str, args: argparse.Namespace, engines: list[str], model_dir: Path
) -> list[Row]:
    loop = asyncio.get_running_loop()
    tokenizer = TimedTokenizer(load_tokenizer(model_dir), threading.get_ident())
    rows = []
    async with pylon(mode, engines, tokenizer, args.native) as url:
        probes = LoopProbes(loop, time_callbacks=args.loop == "asyncio")
        probes.start()
        try:
            rows.append(Row(mode, 0, [await idle(probes) for _ in range(args.repeat)]))
            for size in args.sizes:
                samples = []
                for index in range(args.warmup + args.repeat):
                    body = chat_body(size, args.shape, seed=size * 1000 + index)
                    tokenizer.calls.clear()
                    await asyncio.sleep(0.02)  # let the previous request's tail settle
                    probes.begin()
                    started = time.perf_counter()
                    status = await loop.run_in_executor(
                        None, post, url, body, f"lh-{mode}-{size}-{index}"
                    )
                    wall = time.perf_counter() - started
                    await asyncio.sleep(0.005)  # the exchange's end, after the answer
                    window = probes.window
                    if status != 200:
                        raise RuntimeError(f"{mode} {size} B: status {status}")
                    if index < args.warmup:
                        continue
                    tok = tokenizer.calls[0] if tokenizer.calls else None
                    samples.append(
                        Sample(
                            window.sampler,
                            window.callback,
                            window.what,
                            tok.seconds if tok else None,
                            tok.tokens if tok else 0,
                            tok.on_loop if tok else None,
                            wall,
                        )
                    )
                rows.append(Row(mode, size, samples))
        finally:
            await probes.close()
    return rows


async def idle(probes: LoopProbes) -> Sample:
    """The probes over `IDLE_SECONDS` with no request: the host's own noise (the OS scheduling
    other work on the loop's core reads as a hold too)."""
    probes.begin()
    await asyncio.sleep(IDLE_SECONDS)
    window = probes.window
    return Sample(window.sampler, window.callback, window.what, None, 0, None, IDLE_SECONDS)


async def profile_one(args: argparse.Namespace, engines: list[str], model_dir: Path) -> None:
    """cProfile of the loop thread while one 1 MiB request is in flight (`--profile`)."""
    loop = asyncio.get_running_loop()
    tokenizer = TimedTokenizer(load_tokenizer(model_dir), threading.get_ident())
    mode = args.modes[0]
    async with pylon(mode, engines, tokenizer, args.native) as url:
        for index in range(3):  # warm-up
            body = chat_body(args.sizes[-1], args.shape, seed=index)
            await loop.run_in_executor(None, post, url, body, f"warm-{index}")
        body = chat_body(args.sizes[-1], args.shape, seed=99)
        profiler = cProfile.Profile()
        profiler.enable()
        await loop.run_in_executor(None, post, url, body, "profiled")
        await asyncio.sleep(0.005)
        profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue())


async def threshold(args: argparse.Namespace, model_dir: Path) -> None:
    """`--threshold`: where the thread hop starts to pay, without HTTP: per body size, the
    tokenize time inline (the loop hold it costs), the same call through the one-thread
    executor (wall, and the loop thread's own CPU for it: `time.thread_time` across the await,
    the loop having nothing else to do), and a no-op's round trip through the executor."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    tokenizer = load_tokenizer(model_dir)
    pool = ThreadPoolExecutor(1)
    clocks = (time.perf_counter, time.thread_time)

    async def hop(fn: Callable[..., Any], *call: Any) -> tuple[float, float]:
        wall, cpu = (clock() for clock in clocks)
        await loop.run_in_executor(pool, fn, *call)
        return time.perf_counter() - wall, time.thread_time() - cpu

    await hop(int)  # the thread exists
    noop = [await hop(int) for _ in range(200)]
    print(
        f"# executor round trip (no-op): wall {_ms([w for w, _ in noop])} ms, "
        f"loop CPU {_ms([c for _, c in noop])} ms; cold = a new conversation each time, "
        "warm = the same body again (segment cache hits)"
    )
    print(
        "| body | tokens | cold inline ms | cold via thread: wall ms | loop CPU ms "
        "| warm inline ms | warm via thread: wall ms |"
    )
    print("|" + "---|" * 7)
    for size in args.sizes:
        cold_inline, cold_hop, warm_inline, warm_hop, tokens = [], [], [], [], 0
        for index in range(args.repeat):
            body = chat_body(size, args.shape, seed=size * 7 + 2 * index)
            started = time.perf_counter()
            tokens = len(tokenizer.prompt_tokens(CHAT_PATH, body) or ())
            cold_inline.append(time.perf_counter() - started)
            started = time.perf_counter()
            tokenizer.prompt_tokens(CHAT_PATH, body)
            warm_inline.append(time.perf_counter() - started)
            other = chat_body(size, args.shape, seed=size * 7 + 2 * index + 1)
            cold_hop.append(await hop(tokenizer.prompt_tokens, CHAT_PATH, other))
            warm_hop.append(await hop(tokenizer.prompt_tokens, CHAT_PATH, other))
        print(
            f"| {_size(size)} | {tokens:,} | {_ms(cold_inline)} | "
            f"{_ms([w for w, _ in cold_hop])} | {_ms([c for _, c in cold_hop])} | "
            f"{_ms(warm_inline)} | {_ms([w for w, _ in warm_hop])} |"
        )
    pool.shutdown()


# --- the report ----------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1e3:.2f} [{max(values) * 1e3:.2f}]"


def report(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"# loop hold, ms: median [max] over {args.repeat} requests; shape {args.shape}; "
        f"loop {args.loop}; native {args.native}; GIL switch interval "
        f"{sys.getswitchinterval() * 1e3:g} ms"
    )
    header = (
        "| mode | body | tokens | tokenize ms (where) | loop hold: sampler ms | "
        "longest callback ms | longest callback was | request ms |"
    )
    print(header)
    print("|" + "---|" * 8)
    for row in rows:
        samples = row.samples
        tokenized = [s.tokenize for s in samples if s.tokenize is not None]
        where = {s.on_loop for s in samples if s.on_loop is not None}
        place = "loop" if where == {True} else "thread" if where == {False} else "mixed"
        tokens = statistics.median([s.tokens for s in samples]) if tokenized else 0
        longest = max(samples, key=lambda s: s.callback)
        print(
            f"| {row.mode} | {_size(row.size)} | {tokens:,.0f} | "
            f"{_ms(tokenized) + ' (' + place + ')' if tokenized else '-'} | "
            f"{_ms([s.sampler for s in samples])} | "
            f"{_ms([s.callback for s in samples]) if args.loop == 'asyncio' else '-'} | "
            f"{longest.what if args.loop == 'asyncio' else '-'} | "
            f"{_ms([s.wall for s in samples])} |"
        )


def _size(size: int) -> str:
    if not size:
        return f"idle {IDLE_SECONDS:g} s"
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


# --- main ----------------------------------------------------------------------------------


def start_engines(group: ProcessGroup, count: int) -> list[str]:
    env_python = sys.executable
    urls = []
    for _ in range(count):
        argv = [
            env_python, "-m", "mock_dynamo", "--host", "127.0.0.1", "--port", "0",
            "--flavor", "dynamo", "--model", MODEL, "--num-tokens", "4", "--capacity", "1",
            "--log-level", "warning",
        ]  # fmt: skip
        _, port = start_listening(group, argv)
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--modes", default="kv,kv-inline,off", help="comma-separated")
    parser.add_argument(
        "--sizes", default=",".join(str(s) for s in SIZES), help="body bytes, comma-separated"
    )
    parser.add_argument("--shape", choices=("turns", "one"), default="turns")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("--native", choices=("fake", "dynamo"), default="fake")
    parser.add_argument("--model-dir", type=Path, help="a local HF model dir (default: tiny BPE)")
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval, ms (Python's default: 5): how long the loop thread waits "
        "for the GIL while another thread runs Python",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile one request instead")
    parser.add_argument(
        "--threshold", action="store_true", help="the inline/thread trade-off, no HTTP"
    )
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return args


async def amain(args: argparse.Namespace) -> None:
    from pylon.logs import configure_logging

    configure_logging("json", "warning")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from dynamo_stack import build_model_dir

            model_dir = build_model_dir(Path(tmp) / "model")
        if args.threshold:
            await threshold(args, model_dir)
            return
        group = ProcessGroup()
        try:
            engines = await asyncio.to_thread(start_engines, group, 2)
            if args.profile:
                await profile_one(args, engines, model_dir)
                return
            rows = []
            for mode in args.modes:
                rows += await run_mode(mode, args, engines, model_dir)
            report(rows, args)
        finally:
            group.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(amain(args))
    else:
        asyncio.run(amain(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Micro-benchmark: candidate upstream HTTP clients for a Python proxy, side by side.

Starts the canned upstream (separate process), then in this process drives N
requests at concurrency C through each client and reports the client process's
CPU (time.process_time) per request, non-streaming (1 KB JSON) and streaming
(20 SSE events, body consumed chunk by chunk as a relaying proxy would).

    .venv/bin/python scripts/bench/upstream_clients.py            # full
    .venv/bin/python scripts/bench/upstream_clients.py --quick    # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import aiohttp
import httptools
import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import ProcessGroup, start_listening

PATH = "/v1/chat/completions"


def request_body(stream: bool) -> bytes:
    flag = "true" if stream else "false"
    return (
        '{"model":"mock-model","messages":[{"role":"user","content":"hi"}],'
        f'"stream":{flag},"max_tokens":20}}'
    ).encode()


HEADERS = {"content-type": "application/json", "x-model": "mock-model", "x-request-id": "bench-1"}

# ---------------------------------------------------------------- raw httptools client


class _RawConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection parsed with httptools.HttpResponseParser."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[list[bytes]] | None = None
        self.chunks: list[bytes] = []
        self.reusable = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(exc or ConnectionError("upstream closed"))

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() != 200:
            self._fail(RuntimeError(f"HTTP {self.parser.get_status_code()}"))
            return
        self.reusable = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.chunks)

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def send(self, data: bytes) -> asyncio.Future[list[bytes]]:
        assert self.transport is not None
        self.chunks = []
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter


class RawPool:
    """Minimal LIFO keep-alive pool: reuse an idle connection or open a new one."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_RawConn] = []

    async def request(self, data: bytes) -> list[bytes]:
        conn = self.idle.pop() if self.idle else await self._connect()
        try:
            chunks = await conn.send(data)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        if conn.reusable:
            self.idle.append(conn)
        return chunks

    async def _connect(self) -> _RawConn:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(_RawConn, self.host, self.port)
        return proto

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


# ---------------------------------------------------------------- client adapters
# Each factory returns (do_one_request, aclose). do_one_request returns the body bytes.

Request = Callable[[bool], Awaitable[bytes]]
Client = tuple[Request, Callable[[], Awaitable[None]]]


async def make_aiohttp(port: int, concurrency: int) -> Client:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
    url = f"http://127.0.0.1:{port}{PATH}"

    async def one(stream: bool) -> bytes:
        async with session.post(url, data=request_body(stream), headers=HEADERS) as resp:
            resp.raise_for_status()
            return b"".join([c async for c in resp.content.iter_any()])

    return one, session.close


async def make_httpx(port: int, concurrency: int) -> Client:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30)

    async def one(stream: bool) -> bytes:
        req = client.stream("POST", PATH, content=request_body(stream), headers=HEADERS)
        ctx = cast(AbstractAsyncContextManager[httpx.Response], req)
        async with ctx as resp:
            resp.raise_for_status()
            return b"".join([c async for c in resp.aiter_raw()])

    return one, client.aclose


async def make_raw(port: int, concurrency: int) -> Client:
    pool = RawPool("127.0.0.1", port)
    head = f"POST {PATH} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in HEADERS.items()
    )
    wire = {
        s: f"{head}content-length: {len(request_body(s))}\r\n\r\n".encode() + request_body(s)
        for s in (False, True)
    }

    async def one(stream: bool) -> bytes:
        return b"".join(await pool.request(wire[stream]))

    async def aclose() -> None:
        pool.close()

    return one, aclose


CLIENTS: dict[str, Callable[[int, int], Awaitable[Client]]] = {
    "aiohttp": make_aiohttp,
    "httpx": make_httpx,
    "httptools-raw": make_raw,
}

# ---------------------------------------------------------------- measurement


@dataclass
class Result:
    client: str
    mode: str
    requests: int
    cpu_us_per_req: float
    cpu_us_per_event: float | None
    rps: float


async def drive(one: Request, stream: bool, total: int, concurrency: int) -> None:
    """Issue `total` requests from `concurrency` workers; verify every body."""
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            body = await one(stream)
            if (b"data: [DONE]" in body) != stream or not body:
                raise RuntimeError(f"unexpected body: {body[:120]!r}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def measure(name: str, port: int, stream: bool, args: argparse.Namespace) -> Result:
    one, aclose = await CLIENTS[name](port, args.concurrency)
    try:
        await drive(one, stream, max(args.requests // 10, args.concurrency), args.concurrency)
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await drive(one, stream, args.requests, args.concurrency)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await aclose()
    per_req = cpu * 1e6 / args.requests
    return Result(
        client=name,
        mode="stream 20 SSE" if stream else "non-stream 1KB",
        requests=args.requests,
        cpu_us_per_req=per_req,
        cpu_us_per_event=per_req / 20 if stream else None,
        rps=args.requests / wall,
    )


def table(results: list[Result]) -> str:
    base = {(r.mode): r.cpu_us_per_req for r in results if r.client == "httptools-raw"}
    lines = [
        "| client | mode | requests | req/s | client CPU-us/req | CPU-us/event | vs raw |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ev = "-" if r.cpu_us_per_event is None else f"{r.cpu_us_per_event:.1f}"
        ratio = f"{r.cpu_us_per_req / base[r.mode]:.2f}x" if base.get(r.mode) else "-"
        lines.append(
            f"| {r.client} | {r.mode} | {r.requests} | {r.rps:.0f} | "
            f"{r.cpu_us_per_req:.1f} | {ev} | {ratio} |"
        )
    return "\n".join(lines)


async def run_all(port: int, args: argparse.Namespace) -> list[Result]:
    results = []
    for stream in (False, True):
        for name in args.clients:
            res = await measure(name, port, stream, args)
            print(
                f"  {res.client:14} {res.mode:15} {res.cpu_us_per_req:8.1f} us/req", file=sys.stderr
            )
            results.append(res)
    return results


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5000, help="measured requests per row")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--clients", default=",".join(CLIENTS))
    ap.add_argument("--pace-ms", type=float, default=0.0, help="upstream inter-event delay")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--quick", action="store_true", help="1000 requests per row")
    args = ap.parse_args()
    if args.quick:
        args.requests = 1000
    args.clients = [c for c in args.clients.split(",") if c]
    unknown = set(args.clients) - set(CLIENTS)
    if unknown:
        ap.error(f"unknown clients {sorted(unknown)}; choose from {','.join(CLIENTS)}")
    return args


def main() -> int:
    args = parse_args()
    group = ProcessGroup()
    script = Path(__file__).resolve().parent / "canned_upstream.py"
    try:
        _, port = start_listening(
            group, [sys.executable, str(script), "--port", "0", "--pace-ms", f"{args.pace_ms:g}"]
        )
        runner = uvloop.run if args.loop == "uvloop" else asyncio.run
        results = runner(run_all(port, args))
    except KeyboardInterrupt:
        return 130
    finally:
        group.close()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

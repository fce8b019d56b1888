"""Cheap canned-response HTTP/1.1 upstream for proxy benchmarks.

asyncio.Protocol + httptools on uvloop, keep-alive, so that the proxy in
front of it (not this process) is the bottleneck.

* POST (or any method) -> fixed ~1 KB JSON body with Content-Length.
* If the path ends with ``/stream`` or the request body contains
  ``"stream": true`` -> 20 SSE events ``data: {...}\\n\\n`` plus
  ``data: [DONE]\\n\\n`` in chunked encoding, one chunk per event.
  ``--pace-ms`` sleeps between events (0 = unpaced, all events written at once).

Prints ``canned-upstream listening on http://HOST:PORT`` once bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
from typing import cast

import httptools
import uvloop

NUM_EVENTS = 20
_STREAM_RE = re.compile(rb'"stream"\s*:\s*true')


def _json_body() -> bytes:
    text = "canned " * 120
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "mock-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text[:800]},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": NUM_EVENTS, "total_tokens": 21},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _sse_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse_events() -> list[bytes]:
    events = []
    for i in range(NUM_EVENTS):
        obj = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "model": "mock-model",
            "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
        }
        events.append(_sse_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n"))
    events.append(_sse_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return events


JSON_BODY = _json_body()
JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(JSON_BODY), JSON_BODY)
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
SSE_EVENTS = _sse_events()
SSE_UNPACED = SSE_HEAD + b"".join(SSE_EVENTS)


class CannedProtocol(asyncio.Protocol):
    """One keep-alive connection; requests are answered in order."""

    def __init__(self, pace_s: float) -> None:
        self._pace_s = pace_s
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._tail: asyncio.Future[None] | None = None  # last paced stream in flight

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        url, body = self._url, b"".join(self._body)
        self._url, self._body = b"", []
        keep_alive = self._parser.should_keep_alive()
        stream = url.split(b"?", 1)[0].endswith(b"/stream") or bool(_STREAM_RE.search(body))
        if stream and self._pace_s > 0:
            prev = self._tail
            self._tail = asyncio.ensure_future(self._paced(prev, keep_alive))
            return
        if self._tail is not None and not self._tail.done():
            # keep response order behind a paced stream still in flight
            prev = self._tail
            self._tail = asyncio.ensure_future(self._after(prev, stream, keep_alive))
            return
        self._write(SSE_UNPACED if stream else JSON_RESPONSE, keep_alive)

    def _write(self, data: bytes, keep_alive: bool) -> None:
        if self._transport is None:
            return
        self._transport.write(data)
        if not keep_alive:
            self._transport.close()

    async def _after(self, prev: asyncio.Future[None], stream: bool, keep_alive: bool) -> None:
        await prev
        self._write(SSE_UNPACED if stream else JSON_RESPONSE, keep_alive)

    async def _paced(self, prev: asyncio.Future[None] | None, keep_alive: bool) -> None:
        if prev is not None:
            await prev
        self._write(SSE_HEAD, True)
        for event in SSE_EVENTS[:-1]:
            await asyncio.sleep(self._pace_s)
            self._write(event, True)
        await asyncio.sleep(self._pace_s)
        self._write(SSE_EVENTS[-1], keep_alive)


async def serve(host: str, port: int, pace_ms: float) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: CannedProtocol(pace_ms / 1000.0), host, port, backlog=1024
    )
    bound = server.sockets[0].getsockname()
    print(f"canned-upstream listening on http://{bound[0]}:{bound[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--pace-ms", type=float, default=0.0, help="delay between SSE events")
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.host, args.port, args.pace_ms))


if __name__ == "__main__":
    main()

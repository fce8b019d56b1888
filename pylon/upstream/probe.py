"""One bounded GET to the engine, for pylon's own questions (health gate, model discovery).

Not the request pool: a probe must not queue behind, nor take a slot from, tunnel traffic, and
must not leave a connection behind. One connection per probe (`connection: close`), the whole
exchange under one deadline, the response head bounded as the pool bounds it and the body at
`max_body` bytes. Every failure is a `FetchError` with a short `reason` (a bounded label set:
`connect`, `timeout`, `too_large`, `protocol`, `closed`) and a human `detail`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

from pylon.core.upstream import Upstream
from pylon.upstream.connection import MAX_RESPONSE_HEAD, delimited_by_close


class FetchError(Exception):
    """The probe got no complete answer; `reason` is a label, `detail` one line."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Fetched:
    status: int
    body: bytes


class Fetch(Protocol):
    """What `fetch` is, for the loops that take it injected (health gate, discovery, worker
    health checks): tests hand in a scripted engine instead."""

    async def __call__(
        self, upstream: Upstream, path: str, *, timeout: float, max_body: int
    ) -> Fetched: ...


class _Stop(Exception):
    """Stops llhttp once the answer is already decided (too large)."""


class _OneResponse(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_head_bytes",
        "_headers",
        "_max_body",
        "_parser",
        "_status",
        "_stray",
        "_until_close",
        "done",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, max_body: int) -> None:
        self.done: asyncio.Future[Fetched] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._max_body = max_body
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body = bytearray()
        self._stray = 0  # bytes since the last body piece: what llhttp may be holding
        self._until_close = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        body_before = len(self._body)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail("protocol", "the engine switched protocols")
        except httptools.HttpParserError as exc:
            self._fail("protocol", f"malformed response: {exc}")
        # Counted per read, as the pool's connections count it: httptools holds a field until
        # it ends, so one endless header line (or trailer) never reaches `on_header`.
        if len(self._body) != body_before:
            self._stray = 0
            return
        self._stray += len(data)
        if self._stray > MAX_RESPONSE_HEAD:
            self._fail("too_large", f"response head or framing over {MAX_RESPONSE_HEAD} bytes")
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self._status and self._until_close and exc is None:
            self._finish()  # a close-delimited body ends exactly here
        else:
            self._fail("closed", "the engine closed the connection before a complete answer")

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        self._headers = []
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_RESPONSE_HEAD:
            self._fail("too_large", f"response head over {MAX_RESPONSE_HEAD} bytes")
            raise _Stop
        self._headers.append((name.lower(), value))  # names as `delimited_by_close` reads them

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response; the real one follows
        self._status = status
        self._until_close = delimited_by_close(status, self._headers)

    def on_body(self, body: bytes) -> None:
        if not self._status:
            return
        self._body += body
        if len(self._body) > self._max_body:
            self._fail("too_large", f"response body over {self._max_body} bytes")
            raise _Stop

    def on_message_complete(self) -> None:
        if self._status:
            self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(Fetched(self._status, bytes(self._body)))

    def _fail(self, reason: str, detail: str) -> None:
        if not self.done.done():
            self.done.set_exception(FetchError(reason, detail))


async def fetch(upstream: Upstream, path: str, *, timeout: float, max_body: int) -> Fetched:
    """`GET <upstream><path>`: the status and body, all within `timeout` seconds.

    Raises `FetchError`; never leaves a connection open.
    """
    head = b"GET %s%s HTTP/1.1\r\nhost: %s\r\nuser-agent: pylon\r\n" % (
        upstream.base_path.encode("ascii"),
        path.encode("ascii"),
        upstream.host_header,
    )
    return await _exchange(
        upstream, head + b"accept: application/json\r\nconnection: close\r\n\r\n", timeout, max_body
    )


async def post_json(
    upstream: Upstream,
    path: str,
    body: bytes,
    *,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    timeout: float,
    max_body: int,
) -> Fetched:
    """`POST <upstream><path>` with a JSON `body` and pylon's own extra `headers` (e.g. a worker
    pin): the status and the whole response body, within `timeout` seconds. Raises
    `FetchError`; never leaves a connection open."""
    head = b"POST %s%s HTTP/1.1\r\nhost: %s\r\nuser-agent: pylon\r\n" % (
        upstream.base_path.encode("ascii"),
        path.encode("ascii"),
        upstream.host_header,
    )
    extra = b"".join(b"%s: %s\r\n" % field for field in headers)
    framing = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
    return await _exchange(upstream, head + extra + framing % len(body) + body, timeout, max_body)


async def _exchange(upstream: Upstream, request: bytes, timeout: float, max_body: int) -> Fetched:
    loop = asyncio.get_running_loop()
    protocol: _OneResponse | None = None
    try:
        async with asyncio.timeout(timeout):
            try:
                _, protocol = await loop.create_connection(
                    lambda: _OneResponse(loop, max_body), upstream.host, upstream.port
                )
            except OSError as exc:
                why = exc.strerror or exc.__class__.__name__
                raise FetchError("connect", f"cannot connect: {why}") from None
            assert protocol.transport is not None
            protocol.transport.write(request)
            return await protocol.done
    except TimeoutError:
        raise FetchError("timeout", f"no complete answer within {timeout:g} s") from None
    finally:
        if protocol is not None:
            protocol.done.cancel()  # a late failure (the abort below) has no one to tell
            if protocol.transport is not None:
                protocol.transport.abort()

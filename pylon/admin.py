"""The admin listener (`--admin-listen`): plain HTTP for the node's operators, apart from the
tunnel ports and without tunnel auth.

- `GET /metrics`: Prometheus text, or OpenMetrics when the `Accept` header asks for it.
- `GET /live`: 200 while the event loop runs (this answer is produced on it).
- `GET /ready`: 200 when `Lifecycle.readiness()` says ready, else 503 with its reason (and, for
  an engine fault, a `detail`); a drain flips it to 503 at once.
- `GET /workers` (`--routing` other than off): the worker catalogue as JSON, each worker with its
  spec, rotation, health, passive ejections, bookings and KV-event faults, and the catalogue's
  digest and source (`pylon.routing.build.Routing.workers_report`). Bounded: at most
  `pylon.routing.spec.MAX_WORKERS` workers.

Small and bounded, on httptools (the parser pylon's HTTP/1.1 listener uses): GET and HEAD only
(405 otherwise), no request body (413), a request head of at most `MAX_HEAD_BYTES` in at most
`MAX_HEADERS` fields (431, counted as the bytes arrive: one endless header line is refused, not
buffered), `REQUEST_TIMEOUT` seconds to send a request (408), idle keep-alive
connections closed after `IDLE_TIMEOUT`. Every error is an RFC 9457 JSON problem.

No client holds the loop or grows pylon's memory (a flood of pipelined `/metrics` must not
stall tunnel traffic): the parser is fed one request head at a time and one request is
answered per loop turn, reading stays paused while pipelined bytes wait, and nothing is parsed
while the transport's write buffer is over its high-water mark (`pause_writing`), so a client
that pipelines and never reads holds at most that buffer, one answer and one read. At most
`MAX_CONNECTIONS` connections at once: a new one evicts the least recently active, so that
silent connections filling the cap never make `/live` and `/ready` unanswerable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast

import httptools
import orjson
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.registry import CollectorRegistry

from pylon.lifecycle import Lifecycle
from pylon.settings import split_host_port
from pylon.startup import cannot_listen

MAX_HEAD_BYTES = 16 * 1024
# httptools buffers a header field's name and value until its line ends, so one endless line
# would be held whole (and copied on every read) before `on_header` could count it: the raw
# bytes of a head are also counted as they are fed. The slack covers what the field count
# leaves out (the request line's method and version, line ends, whitespace around values).
_HEAD_SLACK = 1024
MAX_HEADERS = 64
REQUEST_TIMEOUT = 10.0  # seconds to send a whole request, from its first byte or the last answer
IDLE_TIMEOUT = 30.0  # seconds a kept-alive connection may wait for its next request
MAX_CONNECTIONS = 64
PROBLEM_TYPE_BASE = "https://pylon.dev/problems/admin/"
ALLOWED = b"GET, HEAD"
_JSON = b"application/json"
_PROBLEM = b"application/problem+json"
_REASONS = {status.value: status.phrase.encode("ascii") for status in HTTPStatus}


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: bytes
    body: bytes
    extra: tuple[tuple[bytes, bytes], ...] = ()


def problem(status: int, code: str, detail: str) -> Answer:
    body = {
        "type": PROBLEM_TYPE_BASE + code,
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        "code": code,
    }
    extra = ((b"allow", ALLOWED),) if status == 405 else ()
    return Answer(status, _PROBLEM, orjson.dumps(body), extra)


class AdminRoutes:
    """What each path answers; pure of any I/O, so tests can call it directly."""

    def __init__(self, lifecycle: Lifecycle, registry: CollectorRegistry) -> None:
        self._lifecycle = lifecycle
        self._registry = registry
        # The routing's report for `/workers` (`pylon.run.start` sets it); None: no routing.
        self.workers: Callable[[], object] | None = None
        self._paths: dict[str, Callable[[str], Answer]] = {
            "/metrics": self.metrics,
            "/live": self.live,
            "/ready": self.ready,
            "/workers": self.workers_listing,
        }

    def answer(self, method: str, target: str, accept: str) -> Answer:
        path = target.split("?", 1)[0]
        route = self._paths.get(path)
        if route is None:
            return problem(404, "not_found", f"no admin endpoint at {path[:100]!r}")
        if method not in ("GET", "HEAD"):
            return problem(405, "method_not_allowed", f"{path} answers GET and HEAD only")
        return route(accept)

    def live(self, _accept: str) -> Answer:
        return Answer(200, _JSON, b'{"live":true}')

    def ready(self, _accept: str) -> Answer:
        ready, reason = self._lifecycle.readiness()
        detail = self._lifecycle.readiness_detail()
        answer: dict[str, object] = {"ready": ready, "reason": reason}
        if detail is not None:
            answer["detail"] = detail
        body = orjson.dumps(answer)
        return Answer(200 if ready else 503, _JSON, body)

    def workers_listing(self, _accept: str) -> Answer:
        report = self.workers
        if report is None:
            return problem(404, "not_found", "no worker catalogue: --routing is off")
        return Answer(200, _JSON, orjson.dumps(report()))

    def metrics(self, accept: str) -> Answer:
        try:
            encoder, content_type = choose_encoder(accept)
            body = encoder(self._registry)
        except Exception:  # an Accept header the client library cannot serve: plain text
            encoder, content_type = generate_latest, "text/plain; version=0.0.4; charset=utf-8"
            body = encoder(self._registry)
        return Answer(200, content_type.encode("ascii"), body)


class _Refused(Exception):
    """Raised in a parser callback: the request was answered with a problem and a close."""


class AdminConnection(asyncio.Protocol):
    def __init__(self, server: AdminServer) -> None:
        self._server = server
        self._routes = server.routes
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self._closing = False
        self._url = b""
        self._accept = b""
        self._head_bytes = 0
        self._head_fed = 0  # raw bytes of the current request head fed so far
        self._headers = 0
        # Bytes received and not fed to the parser yet: `_buffer[_fed:]` (before them, up to 3
        # bytes already fed, to find a head's end that a read split).
        self._buffer = b""
        self._fed = 0
        self._answered = False  # the last feed completed a request (and answered it)
        self._writing_paused = False
        self._next: asyncio.Handle | None = None  # the next `_advance`, a loop turn later

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server.add(self)
        self._arm(REQUEST_TIMEOUT)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        # The last 3 bytes fed stay: a head's end split across two reads is still found.
        keep = max(self._fed - 3, 0)
        self._buffer = self._buffer[keep:] + data if self._buffer else data
        self._fed -= keep
        if self._next is None:  # else the `_advance` already due takes these bytes in turn
            self._advance()

    def _advance(self) -> None:
        """Feed the parser up to the end of one request head and answer it; what was pipelined
        behind it waits, with reading paused, for the next loop turn (and for the write buffer
        to drain below its high-water mark)."""
        self._next = None
        transport = self._transport
        if transport is None or self._closing:
            return
        self._answered = False
        while not self._answered and not self._writing_paused and not self._closing:
            if not self._feed_one():
                break
        if self._closing:
            return
        if self._fed < len(self._buffer):
            transport.pause_reading()
            if not self._writing_paused:
                self._next = self._loop.call_soon(self._advance)
        else:
            tail = self._buffer[-3:]
            self._buffer, self._fed = tail, len(tail)
            if not self._writing_paused:
                transport.resume_reading()

    def _feed_one(self) -> bool:
        """Feed the next piece: through the next end of a head, or all that is buffered when
        no head ends in it (a partial head, or a body, which is refused). False: nothing left."""
        buffer, start = self._buffer, self._fed
        if start >= len(buffer):
            return False
        end = buffer.find(b"\r\n\r\n", max(start - 3, 0))  # ends past `start` if found
        stop = len(buffer) if end < 0 else end + 4
        self._fed = stop
        try:
            self._parser.feed_data(buffer[start:stop])
        except httptools.HttpParserCallbackError:
            pass  # a callback answered and closed
        except httptools.HttpParserUpgrade:
            self._send(problem(400, "malformed_request", "protocol upgrade is not supported"), True)
        except httptools.HttpParserError as exc:
            self._send(problem(400, "malformed_request", f"malformed HTTP/1.1: {exc}"), True)
        if self._in_request and not self._closing:
            # Pieces start where the last head ended: these are the bytes of this head.
            self._head_fed += stop - start
            if self._head_fed > MAX_HEAD_BYTES + _HEAD_SLACK:
                detail = f"request head over {MAX_HEAD_BYTES} bytes"
                self._send(problem(431, "headers_too_large", detail), True)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        if self._next is not None:
            self._next.cancel()
        self._buffer = b""
        self._server.remove(self)

    def pause_writing(self) -> None:
        """The client is not reading its answers: parse nothing more until it does."""
        self._writing_paused = True
        if self._transport is not None and not self._closing:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._transport is not None and not self._closing and self._next is None:
            self._next = self._loop.call_soon(self._advance)

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        self._in_request = True
        self._url = b""
        self._accept = b""
        self._head_bytes = 0
        self._head_fed = 0
        self._headers = 0
        self._arm(REQUEST_TIMEOUT)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        self._headers += 1
        if self._headers > MAX_HEADERS:
            self._refuse(431, "headers_too_large", f"more than {MAX_HEADERS} header fields")
        if name.lower() == b"accept":
            self._accept = value if not self._accept else self._accept + b"," + value

    def on_body(self, body: bytes) -> None:
        self._refuse(413, "body_not_allowed", "admin requests take no body")

    def on_message_complete(self) -> None:
        self._in_request = False
        method = self._parser.get_method().decode("ascii", "replace")
        target = self._url.decode("latin-1")
        try:
            answer = self._routes.answer(method, target, self._accept.decode("latin-1"))
        except Exception as exc:  # a bug (a collector that failed): answered, never a hang
            answer = problem(500, "internal_error", f"{type(exc).__name__} while answering")
        keep_alive = bool(self._parser.should_keep_alive())
        self._answered = True
        self._server.touch(self)
        self._send(answer, not keep_alive, head_only=method == "HEAD")
        if keep_alive and not self._closing:
            self._arm(IDLE_TIMEOUT)

    # --- internals ---
    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, "headers_too_large", f"request head over {MAX_HEAD_BYTES} bytes")

    def _refuse(self, status: int, code: str, detail: str) -> None:
        self._send(problem(status, code, detail), True)
        raise _Refused

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None:
            return
        if self._closing or transport.get_write_buffer_size():
            # A client that does not read its answers does not get to hold them: end it now.
            self.close()
        elif self._in_request:
            detail = f"the request did not arrive within {REQUEST_TIMEOUT} s"
            self._send(problem(408, "request_timeout", detail), True)
        else:
            self._closing = True
            transport.close()

    @property
    def buffered(self) -> int:
        transport = self._transport
        written = transport.get_write_buffer_size() if transport is not None else 0
        return written + len(self._buffer) - self._fed

    def close(self) -> None:
        """End the connection at once, whatever it was doing."""
        self._closing = True
        if self._transport is not None:
            self._transport.abort()

    def _send(self, answer: Answer, close: bool, head_only: bool = False) -> None:
        transport = self._transport
        if transport is None or self._closing:
            return
        lines = [
            b"HTTP/1.1 %d %s" % (answer.status, _REASONS.get(answer.status, b"")),
            b"content-type: " + answer.content_type,
            b"content-length: %d" % len(answer.body),
            b"cache-control: no-store",
        ]
        lines += [name + b": " + value for name, value in answer.extra]
        if close:
            lines.append(b"connection: close")
        transport.write(b"\r\n".join(lines) + b"\r\n\r\n")
        if not head_only:
            transport.write(answer.body)
        if close:
            self._closing = True
            transport.close()  # after the answer is written; `_timed_out` ends a stuck one
            self._arm(REQUEST_TIMEOUT)


class AdminServer:
    """The listening socket and its connections (at most `MAX_CONNECTIONS`, the least recently
    active evicted first)."""

    def __init__(self, routes: AdminRoutes) -> None:
        self.routes = routes
        # Least recently active first (connected, or last answered): the one a new one evicts.
        self._connections: dict[AdminConnection, None] = {}
        self._server: asyncio.AbstractServer | None = None
        self.address = ""
        self.evicted = 0

    def add(self, connection: AdminConnection) -> None:
        """Take `connection`; at the cap, the least recently active one is closed for it.
        Refusing the new one instead would let silent connections starve the probes."""
        while len(self._connections) >= MAX_CONNECTIONS:
            oldest = next(iter(self._connections))
            del self._connections[oldest]
            self.evicted += 1
            oldest.close()
        self._connections[connection] = None

    def touch(self, connection: AdminConnection) -> None:
        """`connection` just completed a request: the last to be evicted now."""
        if connection in self._connections:
            del self._connections[connection]
            self._connections[connection] = None

    def remove(self, connection: AdminConnection) -> None:
        self._connections.pop(connection, None)

    async def start(self, listen: str) -> str:
        """Bind `listen` (HOST:PORT); returns the bound address. A failure to bind is a
        `StartupError` naming the flag (pylon refuses to start without its admin listener)."""
        host, port = split_host_port(listen)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: AdminConnection(self), host, port, reuse_address=True
            )
        except OSError as exc:
            raise cannot_listen("--admin-listen", listen, exc) from None
        bound = self._server.sockets[0].getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        return self.address

    async def start_unix(self, path: str) -> str:
        """Listen on the Unix socket `path` instead (a supervised process: its supervisor
        scrapes it, `pylon.supervisor`; the directory keeps it to the supervisor's user)."""
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_unix_server(lambda: AdminConnection(self), path)
        except OSError as exc:
            raise cannot_listen("--admin-listen", path, exc) from None
        self.address = path
        return path

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()

    @property
    def connections(self) -> int:
        return len(self._connections)

    def buffered(self) -> int:
        """Bytes the connections hold now: answers not yet sent, requests not yet parsed."""
        return sum(connection.buffered for connection in self._connections)

"""The admin listener (`--admin-listen`): plain HTTP for the node's operators, apart from the
tunnel ports and without tunnel auth.

- `GET /metrics`: Prometheus text, or OpenMetrics when the `Accept` header asks for it.
- `GET /live`: 200 while the event loop runs (this answer is produced on it).
- `GET /ready`: 200 when `Lifecycle.readiness()` says ready, else 503 with its reason; a drain
  flips it to 503 at once.

Small and bounded, on httptools (the parser pylon's HTTP/1.1 listener uses): GET and HEAD only
(405 otherwise), no request body (413), a request head of at most `MAX_HEAD_BYTES` in at most
`MAX_HEADERS` fields (431), `REQUEST_TIMEOUT` seconds to send a request (408), idle keep-alive
connections closed after `IDLE_TIMEOUT`, at most `MAX_CONNECTIONS` at once (503). Every error
is an RFC 9457 JSON problem. Answers are computed at once, on the loop, so pipelined requests
are answered in order; a client that stops reading has reading paused until it catches up.
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
        self._paths: dict[str, Callable[[str], Answer]] = {
            "/metrics": self.metrics,
            "/live": self.live,
            "/ready": self.ready,
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
        body = orjson.dumps({"ready": ready, "reason": reason})
        return Answer(200 if ready else 503, _JSON, body)

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
        self._headers = 0

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if not self._server.add(self):
            self._send(problem(503, "too_many_connections", "too many admin connections"), True)
            return
        self._arm(REQUEST_TIMEOUT)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            pass  # a callback answered and closed
        except httptools.HttpParserUpgrade:
            self._send(problem(400, "malformed_request", "protocol upgrade is not supported"), True)
        except httptools.HttpParserError as exc:
            self._send(problem(400, "malformed_request", f"malformed HTTP/1.1: {exc}"), True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        self._server.remove(self)

    def pause_writing(self) -> None:
        if self._transport is not None and not self._closing:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        if self._transport is not None and not self._closing:
            self._transport.resume_reading()

    # --- httptools callbacks ---
    def on_message_begin(self) -> None:
        self._in_request = True
        self._url = b""
        self._accept = b""
        self._head_bytes = 0
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
    """The listening socket and its connections (at most `MAX_CONNECTIONS`)."""

    def __init__(self, routes: AdminRoutes) -> None:
        self.routes = routes
        self._connections: set[AdminConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self.address = ""

    def add(self, connection: AdminConnection) -> bool:
        if len(self._connections) >= MAX_CONNECTIONS:
            return False
        self._connections.add(connection)
        return True

    def remove(self, connection: AdminConnection) -> None:
        self._connections.discard(connection)

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

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()

    @property
    def connections(self) -> int:
        return len(self._connections)

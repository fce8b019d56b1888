"""Fakes for testing pylon's seams through the seams: no socket, no wall clock.

As aioquic's `FakeQuicConnection`, httpcore's mock streams and mitmproxy's playbooks do, each
fake has the surface of the part it stands in for and records what it was told, so a test
drives one part from both of its sides:

- `ClockedLoop`: the running loop with a clock the test moves (`advance`): the timers set on it
  fire in time order, at once, without sleeping.
- `ScriptedEngine`: a real `UpstreamConnection` over a `FakeTransport`. The test plays the
  engine's answer (head, body pieces, end, close, or any raw bytes) through the real llhttp
  parser into the real `Attempt`, and reads what pylon wrote to the engine.
- `FakePool`: the upstream pool as the proxy uses it (`AttemptPool`), every attempt on a
  `ScriptedEngine`.
- `RecordingSink`: a `ResponseSink` that keeps the response, with back-pressure to switch on.
- `Moments`: the one log every recording subscriber writes to, so a test reads in which order
  the exchange told each subscriber each moment. `RecordingBooking`, `RecordingRouter`,
  `RecordingQueue` (the real queue gate, its entries recorded), `RecordingTracer` and
  `RecordingObserver` write to it.
- `FakeFraming`, `FakeProxy`, `ScriptedAdmission`: the stream table's sides.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from pylon.core.contract import TunnelRequest, parse_request
from pylon.core.errors import ErrorCode, PylonError, UpstreamError
from pylon.core.head import RequestHead
from pylon.core.hooks import ExchangeHooks
from pylon.core.http import Header
from pylon.core.intake import AdmittedRequest
from pylon.core.plan import ForwardPlan
from pylon.core.queue import QueueDecision, QueueEntry, QueueGate, QueueTable
from pylon.core.record import RequestRecord
from pylon.core.retry import RetryMark
from pylon.core.upstream import Upstream
from pylon.observe import Observer
from pylon.proxy.exchange import Exchange
from pylon.proxy.forwarding import AttemptPool
from pylon.proxy.sink import ResponseSink
from pylon.routing import Booking, NoWorker, Router
from pylon.server.streams import Framing, Stream
from pylon.tracing import ExchangeSpan, ExchangeTracer
from pylon.upstream import Attempt, UpstreamConnectError
from pylon.upstream.connection import UpstreamConnection

UPSTREAM = Upstream.from_url("http://engine.test:8000")
SSE_HEAD: tuple[Header, ...] = (
    (b"content-type", b"text/event-stream"),
    (b"transfer-encoding", b"chunked"),
)


async def settle(rounds: int = 10) -> None:
    """Let every task that can run, run (yields to the loop; no time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


# --- time -----------------------------------------------------------------------------------------


class Timer:
    """What `ClockedLoop.call_at` returns: the part of `asyncio.TimerHandle` pylon uses."""

    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]):
        self.when = when
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ClockedLoop:
    """The running event loop, with a clock only the test moves.

    `time`, `call_at` and `call_later` run on the test's clock; futures and tasks are the real
    loop's. Hand it wherever pylon takes a loop for its clock (the stream table, the exchange,
    the watchdog): `advance` then fires every timer due, in time order, with the clock reading
    each timer's own time while it runs.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, now: float = 1000.0) -> None:
        self._loop = loop
        self._now = now
        self._timers: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()  # ties fire in the order they were set

    def time(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Timer:
        timer = Timer(when, callback, args)
        heapq.heappush(self._timers, (when, next(self._order), timer))
        return timer

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        return self.call_at(self._now + delay, callback, *args)

    def create_future(self) -> asyncio.Future[Any]:
        return self._loop.create_future()

    def create_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self._loop.create_task(coro)

    def advance(self, seconds: float) -> None:
        """Move the clock on by `seconds`, firing each timer due by then."""
        until = self._now + seconds
        while self._timers and self._timers[0][0] <= until:
            when, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self._now = max(self._now, when)
            timer.callback(*timer.args)
        self._now = until

    @property
    def armed(self) -> list[float]:
        """When the timers still set will fire, earliest first."""
        return sorted(when for when, _, timer in self._timers if not timer.cancelled)


# --- the engine side ------------------------------------------------------------------------------


class FakeTransport:
    """The pylon end of an engine socket: what was written, and whether reading was paused."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.reading = True
        self.pauses = 0  # how often reading was paused (back-pressure toward the engine)
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.reading = False
        self.pauses += 1

    def resume_reading(self) -> None:
        self.reading = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default  # no socket: the delayed-ACK push is skipped


class ScriptedEngine:
    """One engine connection whose engine side the test plays, byte by byte if it likes.

    A real `UpstreamConnection` over a `FakeTransport`: what the test sends goes through the
    real llhttp parser into the real `Attempt` the proxy reads.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, upstream: Upstream = UPSTREAM):
        self.transport = FakeTransport()
        self.connection = UpstreamConnection(loop, upstream)
        self.connection.connection_made(self.transport)  # type: ignore[arg-type]

    def begin(self, plan: ForwardPlan) -> Attempt:
        return self.connection.begin(plan)

    @property
    def request(self) -> bytes:
        """Everything pylon wrote to the engine on this connection."""
        return bytes(self.transport.written)

    def send(self, data: bytes) -> None:
        """Raw response bytes, as one read from the socket."""
        self.connection.data_received(data)

    def respond(self, status: int = 200, headers: Sequence[Header] = SSE_HEAD) -> None:
        """The response head (default: an event stream in chunked coding)."""
        self.send(response_head(status, headers))

    def chunk(self, piece: bytes) -> None:
        """One piece of a chunked body (one read, so the attempt gets exactly `piece`)."""
        assert piece, "an empty chunk would end the body"
        self.send(b"%x\r\n%s\r\n" % (len(piece), piece))

    def end(self) -> None:
        """The end of a chunked body."""
        self.send(b"0\r\n\r\n")

    def close(self, exc: Exception | None = None) -> None:
        """The engine closed the connection (`exc`: it broke)."""
        self.connection.connection_lost(exc)


def response_head(status: int, headers: Sequence[Header]) -> bytes:
    lines = [b"HTTP/1.1 %d X\r\n" % status]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    return b"".join(lines) + b"\r\n"


def whole_response(
    status: int, body: bytes, headers: Sequence[Header] = ((b"content-type", b"application/json"),)
) -> bytes:
    """A response with a content-length body, as bytes."""
    return response_head(status, [*headers, (b"content-length", b"%d" % len(body))]) + body


class FakePool:
    """The upstream pool as the proxy uses it (`AttemptPool`): every attempt runs on a
    `ScriptedEngine` the test plays, taken from `idle` (a kept-alive connection) or opened."""

    def __init__(self, clock: ClockedLoop, loop: asyncio.AbstractEventLoop) -> None:
        self._clock = clock
        self._loop = loop
        self.idle: list[ScriptedEngine] = []  # what `send_idle` hands out, newest last
        # Kept-alive connections another request hands over to `send` while it waits at the
        # connection cap (as `UpstreamPool` does), `fresh` or not; first in, first out.
        self.handed: list[ScriptedEngine] = []
        self.refusals: list[UpstreamConnectError] = []  # what `send` raises first, in order
        self.sends: list[bool] = []  # `fresh` of every `send`
        self.finished: list[tuple[Attempt, bool]] = []  # (attempt, its connection kept)
        self._written: asyncio.Queue[ScriptedEngine] = asyncio.Queue()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._clock  # type: ignore[return-value]

    def send_idle(self, plan: ForwardPlan) -> Attempt | None:
        if not self.idle:
            return None
        engine = self.idle.pop()
        engine.connection.reused = True
        return self._begin(engine, plan)

    async def send(self, plan: ForwardPlan, *, fresh: bool = False) -> Attempt:
        self.sends.append(fresh)
        if self.refusals:
            raise self.refusals.pop(0)
        if self.handed:
            engine = self.handed.pop(0)
            engine.connection.reused = True
            return self._begin(engine, plan)
        assert plan.upstream is not None, "a plan is routed before it is sent"
        return self._begin(ScriptedEngine(self._loop, plan.upstream), plan)

    def finish(self, attempt: Attempt) -> None:
        kept = attempt.connection.end_attempt()
        if not kept:
            attempt.connection.abort()
        self.finished.append((attempt, kept))

    def _begin(self, engine: ScriptedEngine, plan: ForwardPlan) -> Attempt:
        attempt = engine.begin(plan)
        self._written.put_nowait(engine)
        return attempt

    async def written(self) -> ScriptedEngine:
        """The engine the next attempt was written to (waits for it)."""
        async with asyncio.timeout(5):  # a guard against a hung test, not a clock it reads
            return await self._written.get()

    @property
    def unwritten(self) -> bool:
        """No attempt was written that the test has not taken with `written`."""
        return self._written.empty()


_pool: type[AttemptPool] = FakePool


# --- the client side ------------------------------------------------------------------------------


class RecordingSink:
    """A `ResponseSink` that keeps the response.

    `events` is what the proxy did, in order ("start", "write", "drain", "end", "abort");
    `paused` is the back-pressure the test switches on, and `drain` waits until `resume`.
    """

    def __init__(self) -> None:
        self.events: list[str] = []
        self.status: int | None = None
        self.headers: list[Header] = []
        self.content_length: int | None = None
        self.writes: list[bytes] = []
        self.paused = False
        self._resumed = asyncio.Event()

    def start(self, status: int, headers: Sequence[Header], content_length: int | None) -> None:
        self.events.append("start")
        self.status = status
        self.headers = list(headers)
        self.content_length = content_length

    def write(self, data: bytes) -> None:
        self.events.append("write")
        self.writes.append(data)

    async def drain(self) -> None:
        self.events.append("drain")
        while self.paused:
            self._resumed.clear()
            await self._resumed.wait()

    def end(self) -> None:
        self.events.append("end")

    def abort(self) -> None:
        self.events.append("abort")

    def resume(self) -> None:
        """The client read again: `drain` returns."""
        self.paused = False
        self._resumed.set()

    @property
    def body(self) -> bytes:
        return b"".join(self.writes)

    def header(self, name: bytes) -> bytes | None:
        values = [value for field, value in self.headers if field == name]
        assert len(values) <= 1, f"{name!r} sent {len(values)} times"
        return values[0] if values else None

    def problem(self) -> dict[str, Any]:
        """The problem pylon answered with, as one complete response."""
        assert self.events == ["start", "write", "end"], self.events
        assert self.header(b"content-type") == b"application/problem+json"
        assert self.content_length == len(self.body)
        problem: dict[str, Any] = json.loads(self.body)
        return problem

    def sse_error(self) -> dict[str, Any]:
        """The `error` member of the terminal `event: error` a stream was ended with."""
        last = self.writes[-1]
        assert last.startswith(b"event: error\ndata: ") and last.endswith(b"\n\n"), last
        error: dict[str, Any] = json.loads(last[len(b"event: error\ndata: ") : -2])["error"]
        return error


_sink: type[ResponseSink] = RecordingSink


# --- the exchange's subscribers -------------------------------------------------------------------


class Moments:
    """The one log every recording subscriber writes to: `who.moment` in the order told."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, who: str, moment: str) -> None:
        self.lines.append(f"{who}.{moment}")

    def of(self, who: str) -> list[str]:
        """What one subscriber heard, in order."""
        prefix = who + "."
        return [line[len(prefix) :] for line in self.lines if line.startswith(prefix)]


class RecordingHooks(ExchangeHooks):
    """Writes each moment it hears to `log` as `who.moment` (with the outcome of the terminal
    one, the count of an output, the code of a rejection)."""

    def __init__(self, log: Moments, who: str) -> None:
        self._log = log
        self._who = who

    def dispatched(self, record: RequestRecord) -> None:
        self._log.add(self._who, "dispatched")

    def response_head(self, record: RequestRecord) -> None:
        self._log.add(self._who, f"response_head:{record.status}")

    def first_output(self, record: RequestRecord) -> None:
        self._log.add(self._who, "first_output")

    def output(self, record: RequestRecord, count: int) -> None:
        self._log.add(self._who, f"output({count})")

    def complete(self, record: RequestRecord) -> None:
        self._log.add(self._who, f"complete:{record.outcome}")

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self._log.add(self._who, f"rejected:{error.code.value}")


class RecordingBooking(RecordingHooks):
    """A booking on one upstream that records every moment it hears."""

    quiet = False
    body = None

    def __init__(
        self, log: Moments, upstream: Upstream, counts_output: bool, who: str = "booking"
    ) -> None:
        super().__init__(log, who)
        self.upstream = upstream
        self.worker = upstream.label
        self.headers: tuple[Header, ...] = ((b"x-worker-pin", b"7"),)
        self.counts_output = counts_output


_booking: type[Booking] = RecordingBooking


class RecordingRouter:
    """Books every request on `upstream` (or refuses with `refuse`) and keeps what it was
    asked."""

    def __init__(
        self,
        log: Moments,
        upstream: Upstream = UPSTREAM,
        *,
        counts_output: bool = True,
        refuse: NoWorker | None = None,
    ) -> None:
        self._log = log
        self._upstream = upstream
        self._counts_output = counts_output
        self.refuse = refuse
        self.plans: list[ForwardPlan] = []
        # Where `elsewhere` books a request its worker could not take, in turn (none left:
        # no other worker); each such booking records as `booking2`, `booking3`, ...
        self.others: list[Upstream] = []
        self.moved: list[tuple[ForwardPlan, str]] = []  # (plan, the failed booking's worker)

    async def book(self, plan: ForwardPlan) -> Booking:
        self.plans.append(plan)
        if self.refuse is not None:
            raise self.refuse
        return RecordingBooking(self._log, self._upstream, self._counts_output)

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        self.moved.append((plan, failed.worker))
        if not self.others:
            return None
        who = f"booking{len(self.moved) + 1}"
        return RecordingBooking(self._log, self.others.pop(0), self._counts_output, who)


_router: type[Router] = RecordingRouter


class RecordingEntry(RecordingHooks):
    """A real `QueueEntry`, recorded: each moment is written to the log, then told to it."""

    def __init__(self, log: Moments, entry: QueueEntry) -> None:
        super().__init__(log, "queue")
        self.entry = entry

    @property
    def decision(self) -> QueueDecision | None:
        return self.entry.decision

    def dispatched(self, record: RequestRecord) -> None:
        super().dispatched(record)
        self.entry.dispatched(record)

    def response_head(self, record: RequestRecord) -> None:
        super().response_head(record)
        self.entry.response_head(record)

    def first_output(self, record: RequestRecord) -> None:
        super().first_output(record)
        self.entry.first_output(record)

    def output(self, record: RequestRecord, count: int) -> None:
        super().output(record, count)
        self.entry.output(record, count)

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.entry.complete(record)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        super().rejected(record, error)
        self.entry.rejected(record, error)


class RecordingQueue:
    """The real queue gate (`QueueGate`), each entry it makes recorded as it hears the
    exchange (`RecordingEntry`)."""

    def __init__(self, log: Moments, queue: QueueGate) -> None:
        self._log = log
        self._queue = queue
        self.entries: list[RecordingEntry] = []

    @property
    def table(self) -> QueueTable:
        return self._queue.table

    def admit(self, request: TunnelRequest, body_size: int, stream: bool) -> RecordingEntry:
        entry = RecordingEntry(self._log, self._queue.admit(request, body_size, stream))
        self.entries.append(entry)
        return entry

    def refusal(self, decision: QueueDecision, request_id: str | None) -> PylonError:
        return self._queue.refusal(decision, request_id)


class RecordingSpan(RecordingHooks):
    trace = None  # the client's trace context goes to the engine unchanged


_span: type[ExchangeSpan] = RecordingSpan


class RecordingTracer:
    """Starts a recording span per booked request."""

    def __init__(self, log: Moments) -> None:
        self._log = log
        self.started: list[str | None] = []  # the worker each span was started for

    def start(
        self, request: TunnelRequest, plan: ForwardPlan, record: RequestRecord
    ) -> RecordingSpan:
        self.started.append(record.worker)
        return RecordingSpan(self._log, "span")

    def close(self) -> None:
        return None


_tracer: type[ExchangeTracer] = RecordingTracer


class RecordingObserver(RecordingHooks):
    """The process's observer, recorded: the exchange's moments and the other request events
    go to the log as `observer.*`; connection events are kept in `transport_events`."""

    def __init__(self, log: Moments) -> None:
        super().__init__(log, "observer")
        self.transport_events: list[tuple[str, str, dict[str, Any]]] = []
        self.crashes: list[BaseException | None] = []

    def admitted(self, record: RequestRecord) -> None:
        self._log.add("observer", "admitted")

    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
        self._log.add("observer", f"queue_gate:{decision.result.value}")

    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        self._log.add("observer", f"upstream_status:{record.status}:{mark.reason}")

    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        when = "after_head" if after_head else "before_head"
        self._log.add("observer", f"upstream_failed:{error.code.value}:{when}")

    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        self._log.add("observer", f"crashed:{type(exc).__name__}")
        self.crashes.append(exc)

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        self.transport_events.append((kind, protocol, fields))

    def process_event(self, kind: str, /, **fields: Any) -> None:
        return None

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.transport_events]


_observer: type[Observer] = RecordingObserver


# --- the stream table's sides ---------------------------------------------------------------------


class FakeFraming:
    """A transport's framing as the stream table sees it: every sink it hands out, and the
    order of what the table did with its streams in `answers` ("response:1", "reject:2",
    "done:1", "crashed:1")."""

    def __init__(self) -> None:
        self.answers: list[str] = []
        self.responses: dict[int, RecordingSink] = {}
        self.rejects: dict[int, RecordingSink] = {}

    def response_sink(self, stream: Stream, request: AdmittedRequest) -> ResponseSink:
        self.answers.append(f"response:{stream.id}")
        sink = self.responses[stream.id] = RecordingSink()
        return sink

    def reject_sink(self, stream: Stream) -> ResponseSink:
        self.answers.append(f"reject:{stream.id}")
        sink = self.rejects[stream.id] = RecordingSink()
        return sink

    def stream_done(self, stream: Stream, crashed: bool) -> None:
        self.answers.append(f"{'crashed' if crashed else 'done'}:{stream.id}")


_framing: type[Framing] = FakeFraming


class Handling:
    """One `FakeProxy.handle` call: what it was handed, and the test's control of its end."""

    def __init__(
        self, exchange: Exchange, request: AdmittedRequest, body: bytes, done: asyncio.Future[None]
    ) -> None:
        self.exchange = exchange
        self.request = request
        self.body = body
        self.done = done  # set a result to end the task, an exception to crash it
        self.cancelled_with: str | None = None  # the reason the table cancelled it with

    def finish(self) -> None:
        self.done.set_result(None)


class FakeProxy:
    """What the stream table uses of the proxy (`open`, `observer`, `handle`): real exchanges
    on the test's clock, and each `handle` running until the test ends it."""

    def __init__(self, observer: Observer, clock: ClockedLoop) -> None:
        self.observer = observer
        self._clock = clock
        self.calls: list[Handling] = []
        self._handled: asyncio.Queue[Handling] = asyncio.Queue()

    def open(self, transport: str, stream_id: int, now: float) -> Exchange:
        return Exchange(transport, stream_id, now, self.observer, self._clock)  # type: ignore[arg-type]

    async def handle(self, exchange: Exchange, request: AdmittedRequest, body: bytes) -> None:
        handling = Handling(exchange, request, body, self._clock.create_future())
        self.calls.append(handling)
        self._handled.put_nowait(handling)
        try:
            await handling.done
        except asyncio.CancelledError as cancel:
            handling.cancelled_with = str(cancel.args[0]) if cancel.args else None
            raise

    async def handled(self) -> Handling:
        """The next request the table handed to the proxy (waits for its task to start)."""
        async with asyncio.timeout(5):  # a guard against a hung test, not a clock it reads
            return await self._handled.get()


REFUSE = b"x-test-refuse"


class ScriptedAdmission:
    """Admission that runs the real contract, and refuses a head that carries `x-test-refuse`
    (as tunnel auth or the lifecycle would)."""

    def admit(self, head: RequestHead) -> AdmittedRequest:
        request = parse_request(head.method, head.target, head.headers, head.names)
        if any(name == REFUSE for name, _ in head.headers):
            raise UpstreamError(
                "pylon is starting", code=ErrorCode.NOT_READY, request_id=request.request_id
            )
        return request

"""A connection's request streams, the same for every transport: intake, task, cancel, crash,
stall watcher and the rapid-reset guard.

A transport's framing reports what its protocol delivered (`header_block` for an HTTP/2 or
HTTP/3 header block, `head` for a head it read itself, `data`, `trailers`, `end`, `malformed`,
`cancel`), and says how to answer (`Framing`). The table runs each request's `RequestIntake`,
starts one proxy task per forwarded request (HTTP/1.1 one at a time, in order), answers
rejections with pylon's problem response, cancels tasks with a reason the proxy logs, reports
crashes, and times out bodies that stop arriving. It holds no protocol state itself.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pylon.core.contract import check_header_block, request_id_of
from pylon.core.errors import ErrorCode, PylonError, UpstreamError
from pylon.core.flood import RateGuard
from pylon.core.head import RequestHead, pseudo_head
from pylon.core.http import Header
from pylon.core.intake import (
    RECEIVING,
    Admission,
    AdmittedRequest,
    Decision,
    Forward,
    IngressLimits,
    IntakeError,
    Reject,
    RequestIntake,
)
from pylon.lifecycle import Lifecycle
from pylon.proxy import Proxy, ResponseSink
from pylon.proxy.exchange import Exchange
from pylon.server.budget import BodyBudget
from pylon.timers import Deadline

# Why a request's task was cancelled; the proxy logs it as the request's outcome.
CLIENT_RESET = "client_reset"
CLIENT_GONE = "client_disconnected"
SHUTDOWN = "shutdown"


class Stream:
    """One request on a connection, from its head to the end of its task."""

    __slots__ = ("exchange", "held", "id", "intake", "is_head", "task")

    def __init__(self, stream_id: int, intake: RequestIntake, exchange: Exchange) -> None:
        self.id = stream_id
        self.intake = intake
        self.exchange = exchange  # the request's record and its way out
        self.is_head = False  # a HEAD request: its response, pylon's own included, has no body
        self.task: asyncio.Task[None] | None = None
        self.held = 0  # request-body bytes taken from the budgets for this stream

    @property
    def request(self) -> AdmittedRequest | None:
        return self.intake.request


@dataclass(frozen=True, slots=True)
class Ingress:
    """What every connection of every transport shares: built once, injected."""

    # Its field types are imported at run time, not for type checking only: a mypyc build
    # (docs/mypyc-notes.md) evaluates a dataclass's annotations when the module is imported.

    proxy: Proxy
    admission: Admission
    limits: IngressLimits
    lifecycle: Lifecycle
    budget: BodyBudget  # request-body bytes held across the process


class Framing(Protocol):
    """What the table needs from a transport to answer a stream."""

    def response_sink(self, stream: Stream, request: AdmittedRequest) -> ResponseSink:
        """The sink for the proxy's response to an admitted request."""
        ...

    def reject_sink(self, stream: Stream) -> ResponseSink:
        """The sink for pylon's own problem response; the rest of the request is not read."""
        ...

    def stream_done(self, stream: Stream, crashed: bool) -> None:
        """The stream's task ended (`crashed`: with an exception, already reported)."""
        ...


class StreamTable:
    def __init__(
        self,
        protocol: str,
        framing: Framing,
        ingress: Ingress,
        loop: asyncio.AbstractEventLoop,
        *,
        serial: bool = False,
    ) -> None:
        limits = ingress.limits
        self.protocol = protocol
        self._framing = framing
        self._proxy = ingress.proxy
        self._observer = ingress.proxy.observer
        self._admission = ingress.admission
        self._limits = limits
        self._loop = loop
        self._streams: dict[int, Stream] = {}
        self._tasks = 0
        # HTTP/1.1 answers requests one at a time and in order (RFC 9112 9.3.2).
        self._serial = serial
        # Decisions waiting for the response before them (serial only): a rejection of a
        # pipelined request is answered in its turn too, never into the middle of another.
        self._ready: collections.deque[tuple[Stream, Forward | Reject]] = collections.deque()
        self._stall_watch = Deadline(loop, self._check_stalls)
        self._resets = RateGuard(limits.max_stream_resets, limits.flood_window)
        self._budget = ingress.budget
        self._held = 0  # request-body bytes this connection holds

    # --- what the framing reports ---
    def open(self, stream_id: int) -> Stream:
        """A new request stream; its head follows (`head` or `malformed`)."""
        now = self._loop.time()
        intake = RequestIntake(self._limits, now)
        exchange = Exchange(self.protocol, stream_id, now, self._observer, self._loop)
        stream = Stream(stream_id, intake, exchange)
        self._streams[stream_id] = stream
        return stream

    def header_block(self, stream_id: int, fields: Sequence[Header], ended: bool) -> Stream:
        """A new request's header block (HTTP/2, HTTP/3): open its stream, check the block
        against the header limits, read its head from the pseudo-header fields and hand it on
        (`head`); a block that breaks a rule makes the request `malformed`."""
        stream = self.open(stream_id)
        limits = self._limits
        try:
            check_header_block(fields, limits.max_headers, limits.max_header_bytes)
            head = pseudo_head(fields)
        except PylonError as error:
            self.malformed(stream_id, error, fields)
            return stream
        self.head(stream, head, ended)
        return stream

    def head(self, stream: Stream, head: RequestHead, ended: bool) -> None:
        stream.is_head = head.method == b"HEAD"
        try:
            try:  # (`pylon.core.intake.admit`, inlined: once per request)
                admitted: AdmittedRequest | PylonError = self._admission.admit(head)
            except PylonError as error:
                admitted = error
            decision = stream.intake.receive_head(head, admitted, ended, self._loop.time())
        except IntakeError as exc:
            self._broken(stream, exc)
            return
        request = stream.intake.request
        if request is not None:
            stream.exchange.admitted(request)
        if decision is None:
            self._stall_watch.arm(self._limits.stall_timeout)
        else:
            self._decide(stream, decision)

    def malformed(
        self, stream_id: int, error: PylonError, fields: Sequence[Header] | None = None
    ) -> None:
        """The framing found the request malformed, or gave up on it (a head that never came).

        `fields`: the raw header block, when there is one, so the answer and the log line still
        carry the request's id although the contract never ran.
        """
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if error.request_id is None and fields is not None:
            error.request_id = request_id_of(fields)
        stream.exchange.identified(error.request_id)
        try:
            decision = stream.intake.receive_malformed(error)
        except IntakeError as exc:
            self._broken(stream, exc)
            return
        self._decide(stream, decision)

    def data(self, stream_id: int, data: bytes, ended: bool) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # answered already (or unknown): the rest of its body is dropped
        if data and not self._hold(stream, len(data)):
            self.malformed(stream_id, self._over_budget())
            return
        try:
            decision = stream.intake.receive_data(data, ended, self._loop.time())
        except IntakeError as exc:
            self._broken(stream, exc)
            return
        self._decide(stream, decision)

    def trailers(self, stream_id: int, fields: Sequence[Header]) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        try:
            decision = stream.intake.receive_trailers(fields, self._loop.time())
        except IntakeError as exc:
            self._broken(stream, exc)
            return
        self._decide(stream, decision)

    def end(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        try:
            decision = stream.intake.receive_end(self._loop.time())
        except IntakeError as exc:
            self._broken(stream, exc)
            return
        self._decide(stream, decision)

    def cancel(self, stream_id: int, reason: str) -> None:
        """The stream is over for the client (reset, connection lost): stop its work."""
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        stream.intake.reset()
        if stream.task is None:
            self._release(stream)  # else the task still holds the body; released when it ends
        task = stream.task
        if task is not None and not task.done():
            task.cancel(reason)
            self._observer.transport_event(
                "stream_cancelled",
                self.protocol,
                stream_id=stream_id,
                request_id=stream.exchange.request_id,
                reason=reason,
            )
        self._ready = collections.deque(item for item in self._ready if item[0] is not stream)

    def peer_reset(self, stream_id: int) -> bool:
        """The client reset a stream. True when that trips the rapid-reset guard (CVE-2023-44487):
        only resets of live requests count, so a peer cannot be punished for our own resets."""
        live = stream_id in self._streams
        self.cancel(stream_id, CLIENT_RESET)
        return live and self._resets.hit(self._loop.time())

    def cancel_all(self, reason: str) -> None:
        for stream_id in list(self._streams):
            self.cancel(stream_id, reason)
        self._stall_watch.cancel()

    def forget(self, stream_id: int) -> None:
        """The framing is done with a stream whose answer is complete."""
        stream = self._streams.get(stream_id)
        if stream is not None and (stream.task is None or stream.task.done()):
            del self._streams[stream_id]

    # --- state, for the framing ---
    def get(self, stream_id: int) -> Stream | None:
        return self._streams.get(stream_id)

    def __len__(self) -> int:
        return len(self._streams)

    def request_id(self, stream_id: int) -> str | None:
        """The id of a stream's request, when known: every log line about a request names it."""
        stream = self._streams.get(stream_id)
        return stream.exchange.request_id if stream is not None else None

    @property
    def queued(self) -> bool:
        """A forwarded request waits for the response before it (serial only)."""
        return bool(self._ready)

    @property
    def busy(self) -> bool:
        """A response is being produced or waits its turn."""
        return self._tasks > 0 or bool(self._ready)

    # --- internals ---
    def _broken(self, stream: Stream, exc: IntakeError) -> None:
        # The framing delivered something impossible: a bug, or a peer breaking framing rules
        # the framing did not catch. Drop the stream rather than guess.
        self._observer.transport_event(
            "stream_state_error",
            self.protocol,
            stream_id=stream.id,
            request_id=stream.exchange.request_id,
            detail=str(exc),
        )
        self.cancel(stream.id, "protocol_error")

    def _decide(self, stream: Stream, decision: Decision) -> None:
        if decision is None:
            return
        if self._serial and (self._tasks or self._ready):
            self._ready.append((stream, decision))
        elif isinstance(decision, Reject):
            self._reject(stream, decision.error)
        else:
            self._start(stream, decision)

    def _reject(self, stream: Stream, error: PylonError) -> None:
        self._release(stream)
        stream.exchange.reject(self._framing.reject_sink(stream), error)
        self._streams.pop(stream.id, None)

    def _start(self, stream: Stream, forward: Forward) -> None:
        exchange = stream.exchange
        exchange.sink = self._framing.response_sink(stream, forward.request)
        task = self._loop.create_task(self._proxy.handle(exchange, forward.request, forward.body))
        stream.task = task
        self._tasks += 1
        # A small object, not a closure over `self`: no reference cycle per request.
        task.add_done_callback(_TaskDone(self, stream))

    def _task_done(self, stream: Stream, task: asyncio.Task[None]) -> None:
        self._tasks -= 1
        self._release(stream)
        crashed = not task.cancelled() and task.exception() is not None
        if crashed:
            stream.exchange.crashed(task.exception())
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
        self._framing.stream_done(stream, crashed)
        self._run_ready()

    def _hold(self, stream: Stream, size: int) -> bool:
        """Take `size` body bytes from the connection's and the process's budgets."""
        if self._held + size > self._limits.max_connection_body_bytes:
            return False
        if not self._budget.take(size):
            return False
        self._held += size
        stream.held += size
        return True

    def _release(self, stream: Stream) -> None:
        if stream.held:
            self._budget.give(stream.held)
            self._held -= stream.held
            stream.held = 0

    def _over_budget(self) -> PylonError:
        if self._held >= self._limits.max_connection_body_bytes // 2:
            where = (
                f"this connection's request bodies ({self._limits.max_connection_body_bytes} bytes)"
            )
        else:
            where = f"the request bodies pylon holds at once ({self._budget.limit} bytes)"
        return UpstreamError(
            f"no room to buffer this request body: it would exceed {where}",
            code=ErrorCode.BODY_BUDGET_EXCEEDED,
        )

    def _run_ready(self) -> None:
        while self._ready and not self._tasks:
            stream, decision = self._ready.popleft()
            if isinstance(decision, Reject):
                self._reject(stream, decision.error)
            else:
                self._start(stream, decision)

    def _check_stalls(self) -> None:
        now = self._loop.time()
        next_deadline: float | None = None
        for stream in list(self._streams.values()):
            intake = stream.intake
            if intake.state is not RECEIVING:
                continue
            decision = intake.tick(now)
            if decision is not None:
                self._observer.transport_event(
                    "client_timeout",
                    self.protocol,
                    timer="body",
                    stream_id=stream.id,
                    request_id=stream.exchange.request_id,
                )
                self._decide(stream, decision)
                continue
            deadline = intake.deadline()
            if deadline is not None and (next_deadline is None or deadline < next_deadline):
                next_deadline = deadline
        if next_deadline is not None:
            self._stall_watch.arm(max(0.0, next_deadline - now))


class _TaskDone:
    __slots__ = ("_stream", "_table")

    def __init__(self, table: StreamTable, stream: Stream) -> None:
        self._table = table
        self._stream = stream

    def __call__(self, task: asyncio.Task[None]) -> None:
        self._table._task_done(self._stream, task)

"""One request's way out, as one object: the `Exchange` owns the request's record (its only
writer) and emits the request's moments once each, in order, to everything that subscribed.

Envoy keeps one `StreamInfo` per request and llm-d's request-control plugins hear one hook set
per request; here the exchange is both. The stream table opens it with the stream and tells it
what the intake learnt (`admitted`, `identified`); the proxy tells it what happened on the way
out (`planned`, `booked`, `dispatched`, ...). Every part that lives as long as the request
subscribes to the one hook set of `pylon.core.record.ExchangeHooks` instead of being told each
moment by hand: the queue entry (at the queue gate), the booking (once booked), the span (once
started), and the process's observers (logs, metrics) hear every moment last.

Moments and their order are in `pylon.core.record`; the attempts on upstream connections are
`pylon.upstream.Attempt`s (`attempt`, the current one; `record.attempts` counts them).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pylon.core.record import ExchangeHooks, RequestRecord
from pylon.core.usage import FROM_ESTIMATE, FROM_GATEWAY, FROM_USAGE, usage_at_end
from pylon.proxy.sink import ResponseSink, send_problem
from pylon.timers import Deadline
from pylon.upstream import Attempt, UpstreamTimeout

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.intake import AdmittedRequest
    from pylon.core.plan import ForwardPlan
    from pylon.core.queue import QueueDecision
    from pylon.core.retry import RetryMark
    from pylon.observe import Observer
    from pylon.routing import Booking


class Exchange:
    """One request from its stream's head to its end (see the module docstring).

    `sink`: where the response goes (set when the intake decided); `plan`: what goes to the
    engine (the routed plan, once booked); `attempt`: the current upstream attempt; `watchdog`:
    the engine-side clock of the current attempt.
    """

    __slots__ = (
        "_ended",
        "_hooks",
        "_loop",
        "_observer",
        "_output",
        "attempt",
        "plan",
        "record",
        "sink",
        "watchdog",
    )

    def __init__(
        self, record: RequestRecord, observer: Observer, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.record = record
        self._observer = observer
        self._loop = loop
        self._hooks: list[ExchangeHooks] = []  # per-request subscribers, in the order they joined
        self._output: list[ExchangeHooks] = []  # those of them that count output
        self._ended = False
        self.sink: ResponseSink | None = None
        self.plan: ForwardPlan | None = None
        self.attempt: Attempt | None = None
        self.watchdog: Watchdog | None = None

    # --- the way in (the stream table) ---
    def admitted(self, request: AdmittedRequest) -> None:
        """The intake admitted the request's head."""
        record = self.record
        record.request_id = request.request_id
        record.model = getattr(request, "model", None)
        record.method = request.method
        record.path = request.target.partition("?")[0]
        self._observer.admitted(record)

    def identified(self, request_id: str | None) -> None:
        """The request's id, read from a head the intake could not admit."""
        if self.record.request_id is None:
            self.record.request_id = request_id

    def reject(self, sink: ResponseSink, error: PylonError) -> None:
        """Answer with pylon's own problem; the engine never sees the request. Terminal."""
        record = self.record
        if error.request_id is None:
            error.request_id = record.request_id
        elif record.request_id is None:
            record.request_id = error.request_id
        send_problem(sink, error)
        record.status = error.status
        record.outcome = error.code.value
        record.done_at = self._loop.time()
        if self._ended:
            return
        self._ended = True
        for hook in self._hooks:
            hook.rejected(record, error)
        self._observer.rejected(record, error)

    # --- the way out (the proxy) ---
    def planned(self, plan: ForwardPlan, gateway_input_tokens: int | None) -> None:
        """The planner's plan: what was stripped, the engine priority pylon writes, and the
        gateway's input-token count."""
        record = self.record
        record.stripped = plan.stripped
        record.engine_priority = plan.priority.value
        if gateway_input_tokens is not None:
            record.input_tokens = gateway_input_tokens
            record.input_tokens_source = FROM_GATEWAY

    def subscribe(self, hooks: ExchangeHooks, counts_output: bool = False) -> None:
        """`hooks` hears every moment from now on; `counts_output`: `output` too."""
        self._hooks.append(hooks)
        if counts_output:
            self._output.append(hooks)

    def queue_decided(self, decision: QueueDecision) -> None:
        """The queue gate decided on a request that carried the gateway's expectation."""
        self._observer.queue_gate(self.record, decision)

    def booked(self, booking: Booking) -> None:
        """The router booked a worker for the request (released when the exchange ends)."""
        self.record.worker = booking.worker
        if not booking.quiet:  # a booking with nothing to account hears nothing
            self.subscribe(booking, booking.counts_output)

    def dispatched(self, attempt: Attempt) -> None:
        """`attempt` was written to the engine; the first one is the exchange's dispatch."""
        self.attempt = attempt
        record = self.record
        record.attempts += 1
        if record.attempts > 1:
            return  # a retry of a stale connection: the request was dispatched already
        record.dispatched_at = self._loop.time()
        for hook in self._hooks:
            hook.dispatched(record)
        self._observer.dispatched(record)

    def response_head(self, status: int, mark: RetryMark | None) -> None:
        """The engine's response head arrived; `mark`: its retry marking (an error status)."""
        record = self.record
        record.status = status
        if mark is not None:
            self._observer.upstream_status(record, mark)
        record.first_byte_at = self._loop.time()
        for hook in self._hooks:
            hook.response_head(record)
        self._observer.response_head(record)

    def first_output(self, ends_prefill: bool) -> None:
        """Prefill is over; `ends_prefill`: it ended a successful one (a throughput sample)."""
        record = self.record
        record.first_output_at = self._loop.time()
        record.ends_prefill = ends_prefill
        for hook in self._hooks:
            hook.first_output(record)
        self._observer.first_output(record)

    @property
    def counts_output(self) -> bool:
        """Whether any subscriber wants `output` (else the relay does not count per block)."""
        return bool(self._output)

    def output(self, count: int) -> None:
        """`count` more output events were relayed (from the first output on)."""
        record = self.record
        for hook in self._output:
            hook.output(record, count)

    def failed(self, error: PylonError, outcome: str, after_head: bool) -> None:
        """The engine could not be reached, timed out or broke the exchange: `outcome` is how
        the record says it; `after_head`: the client already had a head."""
        record = self.record
        record.outcome = outcome
        if not after_head:
            record.status = error.status
        self._observer.upstream_failed(record, error, after_head)

    def ended_by(self, outcome: str) -> None:
        """How the exchange ended, when it was not an engine failure (`ok`, a client that left
        or stopped reading, a shutdown)."""
        self.record.outcome = outcome

    def count_tokens(self, previous: bytes, last: bytes, events: int | None) -> None:
        """The response's token counts: the engine's usage when its end (`previous` + `last`,
        the last two pieces relayed) carries one, else (a stream) the `events` relayed."""
        record = self.record
        usage = usage_at_end(previous, last)
        if usage is not None:
            given, made = usage
            if given is not None:
                record.input_tokens, record.input_tokens_source = given, FROM_USAGE
            if made is not None:
                record.output_tokens, record.output_tokens_source = made, FROM_USAGE
                return
        if events is not None:
            record.output_tokens, record.output_tokens_source = events, FROM_ESTIMATE

    def complete(self) -> None:
        """The exchange is over, however it ended (the record's outcome says how). Terminal;
        a second call, or one after `reject`, does nothing."""
        if self._ended:
            return
        self._ended = True
        record = self.record
        record.done_at = self._loop.time()
        for hook in self._hooks:
            hook.complete(record)
        self._observer.complete(record)

    def crashed(self, exc: BaseException | None) -> None:
        """A bug: pylon failed to handle the request (the stream is reset or closed)."""
        self._observer.crashed(self.record, exc)


class Watchdog(Deadline):
    """The engine-side clock of an exchange: when it expires, the attempt it watches fails with
    the armed reason.

    Re-arming per event only stores a float (see `Deadline`), so the gap timeout is nearly free.
    """

    __slots__ = ("_attempt", "_reason")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._attempt: Attempt | None = None
        self._reason = ""

    def attach(self, attempt: Attempt) -> None:
        self._attempt = attempt

    def expired(self) -> None:
        if self._attempt is not None:
            self._attempt.fail(UpstreamTimeout(self._reason))

    def arm_for(self, seconds: float, reason: str) -> None:
        self._reason = reason
        self.arm(seconds)

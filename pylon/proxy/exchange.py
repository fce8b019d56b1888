"""One request's way out, as one object: the `Exchange` is the request's record (the
`RequestRecord` every observer reads) and its only writer, and it emits the request's moments
once each, in order, to everything that subscribed.

Envoy keeps one `StreamInfo` per request and llm-d's request-control plugins hear one hook set
per request; here the exchange is both. The stream table opens it with the stream and tells it
what the intake learnt (`admitted`, `identified`, `reject`); the proxy tells it what happened on
the way out (`planned`, `booked`, `dispatched`, ...). Every part that lives as long as the
request subscribes to the one hook set of `pylon.core.hooks.ExchangeHooks` instead of being
told each moment by hand: the queue entry (at the queue gate), the booking (once booked), the
span (once started); the process's observers (logs, metrics) hear every moment last. Hooks get
the exchange typed as its `RequestRecord`: they read it, only the exchange writes it.

Moments and their order are in `pylon.core.record`; the attempts on upstream connections are
`pylon.upstream.Attempt`s (`attempt`, the current one; `attempts` counts them).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pylon.core.hooks import ExchangeHooks
from pylon.core.record import RequestRecord
from pylon.core.usage import FROM_ESTIMATE, FROM_GATEWAY, FROM_USAGE, usage_at_end
from pylon.proxy.sink import ResponseSink, send_problem
from pylon.timers import Deadline
from pylon.upstream import Attempt, UpstreamTimeout

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.intake import AdmittedRequest
    from pylon.core.plan import ForwardPlan
    from pylon.core.queue import QueueDecision, QueueEntry
    from pylon.core.retry import RetryMark
    from pylon.observe import Observer
    from pylon.routing import Booking


class Exchange(RequestRecord):
    """One request from its stream's head to its end (see the module docstring).

    Set on the way, each before anything reads it (so none is optional): `sink`, where the
    response goes (when the intake decided); `plan`, what goes to the engine (the routed plan,
    once booked); `attempt`, the current upstream attempt. `clock()`: the engine-side clock.
    """

    __slots__ = (
        "_ended",
        "_hooks",
        "_loop",
        "_observer",
        "_output",
        "attempt",
        "counts_output",
        "plan",
        "sink",
        "watchdog",
    )
    sink: ResponseSink
    plan: ForwardPlan
    attempt: Attempt

    def __init__(
        self,
        transport: str,
        stream_id: int,
        head_at: float,
        observer: Observer,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        # `RequestRecord.__init__`, inlined (once per request; a test holds the two equal).
        self.transport = transport
        self.stream_id = stream_id
        self.head_at = head_at
        self.dispatched_at = self.first_byte_at = self.first_output_at = self.done_at = None
        self.attempts = self.bytes_received = self.bytes_sent = 0
        self.ends_prefill = False
        self.request_id = self.model = self.worker = self.engine_priority = None
        self.method = self.path = self.outcome = ""
        self.status = 0
        self.stripped = ()
        self.input_tokens = self.output_tokens = None
        self.input_tokens_source = self.output_tokens_source = ""
        self._observer = observer
        self._loop = loop
        # Per-request subscribers in the order they joined, and those that count output.
        # Tuples: most requests have one subscriber or two, and a tuple is built only then.
        self._hooks: tuple[ExchangeHooks, ...] = ()
        self._output: tuple[ExchangeHooks, ...] = ()
        # Whether any subscriber hears `output` (else the relay does not count per block).
        self.counts_output = False
        self._ended = False
        self.watchdog: Watchdog | None = None  # the engine-side clock, once made (`clock`)

    # --- the way in (the stream table) ---
    def admitted(self, request: AdmittedRequest) -> None:
        """The intake admitted the request's head."""
        self.request_id = request.request_id
        self.model = getattr(request, "model", None)
        self.method = request.method
        self.path = request.target.partition("?")[0]
        self._observer.admitted(self)

    def identified(self, request_id: str | None) -> None:
        """The request's id, read from a head the intake could not admit."""
        if self.request_id is None:
            self.request_id = request_id

    def reject(self, sink: ResponseSink, error: PylonError) -> None:
        """Answer with pylon's own problem; the engine never sees the request. Terminal."""
        if error.request_id is None:
            error.request_id = self.request_id
        elif self.request_id is None:
            self.request_id = error.request_id
        if self.model is None:
            self.model = error.model  # refused at admission after `x-model` parsed
        self.bytes_sent += send_problem(sink, error)
        self.status = error.status
        self.outcome = error.code.value
        self.done_at = self._loop.time()
        if self._ended:
            return
        self._ended = True
        for hook in self._hooks:
            hook.rejected(self, error)
        self._observer.rejected(self, error)

    # --- the way out (the proxy) ---
    def planned(
        self,
        plan: ForwardPlan,
        body_size: int,
        gateway_input_tokens: int | None,
        entry: QueueEntry | None = None,
    ) -> None:
        """The planner's plan: what was stripped, the engine priority pylon writes, the
        gateway's input-token count; the size of the body the client sent; and the request's
        queue entry, which subscribes."""
        self.bytes_received = body_size
        self.stripped = plan.stripped
        self.engine_priority = plan.priority.value
        if gateway_input_tokens is not None:
            self.input_tokens = gateway_input_tokens
            self.input_tokens_source = FROM_GATEWAY
        if entry is not None:
            self._hooks += (entry,)

    def subscribe(self, hooks: ExchangeHooks, counts_output: bool = False) -> None:
        """`hooks` hears every moment from now on; `counts_output`: `output` too."""
        self._hooks += (hooks,)
        if counts_output:
            self._output += (hooks,)
            self.counts_output = True

    def queue_decided(self, decision: QueueDecision) -> None:
        """The queue gate decided on a request that carried the gateway's expectation."""
        self._observer.queue_gate(self, decision)

    def booked(self, booking: Booking) -> None:
        """The router booked a worker for the request (released when the exchange ends)."""
        self.worker = booking.worker
        self.outcome = "ok"  # until something else ends it
        if not booking.quiet:  # a booking with nothing to account hears nothing
            self.subscribe(booking, booking.counts_output)

    def rebooked(self, booking: Booking, other: Booking, error: PylonError) -> None:
        """`booking`'s worker could not be reached (`error`): the engine never saw the request.
        That booking is released as not served (its terminal moment, `rejected`: it stops
        hearing this exchange), the failed try counts as an attempt, and `other`, a booking on
        another worker, takes its place."""
        if not booking.quiet:
            self._hooks = tuple(hook for hook in self._hooks if hook is not booking)
            output = self._output = tuple(hook for hook in self._output if hook is not booking)
            self.counts_output = bool(output)
            booking.rejected(self, error)
        self.attempts += 1
        self.booked(other)

    def dispatched(self, attempt: Attempt) -> None:
        """The first attempt was written to the engine: the exchange's dispatch (after a move to
        another worker, the first one written)."""
        self.attempt = attempt
        self.attempts += 1
        self.dispatched_at = self._loop.time()
        for hook in self._hooks:
            hook.dispatched(self)
        self._observer.dispatched(self)

    def retried(self, attempt: Attempt) -> None:
        """Another attempt was written (the first went into a stale connection): not a second
        dispatch, the same request once more."""
        self.attempt = attempt
        self.attempts += 1

    def response_head(self, status: int, mark: RetryMark | None) -> None:
        """The engine's response head arrived; `mark`: its retry marking (an error status)."""
        self.status = status
        if mark is not None:
            self._observer.upstream_status(self, mark)
        self.first_byte_at = self._loop.time()
        for hook in self._hooks:
            hook.response_head(self)
        self._observer.response_head(self)

    def first_output(self, ends_prefill: bool) -> None:
        """Prefill is over; `ends_prefill`: it ended a successful one (a throughput sample)."""
        self.first_output_at = self._loop.time()
        self.ends_prefill = ends_prefill
        for hook in self._hooks:
            hook.first_output(self)
        self._observer.first_output(self)

    def output(self, count: int) -> None:
        """`count` more output events were relayed (from the first output on)."""
        for hook in self._output:
            hook.output(self, count)

    def failed(self, error: PylonError, outcome: str, after_head: bool) -> None:
        """The engine could not be reached, timed out or broke the exchange: `outcome` is how
        the record says it; `after_head`: the client already had a head."""
        self.outcome = outcome
        if not after_head:
            self.status = error.status
        self._observer.upstream_failed(self, error, after_head)

    def ended_by(self, outcome: str) -> None:
        """How the exchange ended, when it was not an engine failure (a client that left or
        stopped reading, a shutdown)."""
        self.outcome = outcome

    def sent(self, size: int) -> None:
        """`size` more bytes of response body went to the client (told once per response, by
        whatever sent it: a relay when it ends, however it ends, or a problem answer)."""
        self.bytes_sent += size

    def count_tokens(self, previous: bytes, last: bytes, events: int | None) -> None:
        """The response's token counts: the engine's usage when its end (`previous` + `last`,
        the last two pieces relayed) carries one, else (a stream) the `events` relayed."""
        usage = usage_at_end(previous, last)
        if usage is not None:
            given, made = usage
            if given is not None:
                self.input_tokens, self.input_tokens_source = given, FROM_USAGE
            if made is not None:
                self.output_tokens, self.output_tokens_source = made, FROM_USAGE
                return
        if events is not None:
            self.output_tokens, self.output_tokens_source = events, FROM_ESTIMATE

    def clock(self) -> Watchdog:
        """The engine-side clock (the first-output, gap and head timeouts), made when first
        needed: a small whole response that comes with its head never needs one."""
        watchdog = self.watchdog
        if watchdog is None:
            watchdog = self.watchdog = Watchdog(self)
        return watchdog

    def complete(self) -> None:
        """The exchange is over, however it ended (`outcome` says how): its clock stops.
        Terminal; a second call, or one after `reject`, does nothing."""
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.cancel()
            self.watchdog = None  # it refers back to the exchange: no cycle left for the GC
        if self._ended:
            return
        self._ended = True
        self.done_at = self._loop.time()
        for hook in self._hooks:
            hook.complete(self)
        self._observer.complete(self)

    def crashed(self, exc: BaseException | None) -> None:
        """A bug: pylon failed to handle the request (the stream is reset or closed)."""
        self._observer.crashed(self, exc)


class Watchdog(Deadline):
    """The engine-side clock of an exchange: when it expires, the exchange's current attempt
    fails with the armed reason (before any attempt, there is nothing to fail).

    Re-arming per event only stores a float (see `Deadline`), so the gap timeout is nearly free.
    """

    __slots__ = ("_exchange", "_reason")

    def __init__(self, exchange: Exchange) -> None:
        super().__init__(exchange._loop)
        self._exchange = exchange
        self._reason = ""

    def expired(self) -> None:
        attempt: Attempt | None = getattr(self._exchange, "attempt", None)  # unset: none yet
        if attempt is not None:
            attempt.fail(UpstreamTimeout(self._reason))

    def arm_for(self, seconds: float, reason: str) -> None:
        self._reason = reason
        # `Deadline.arm`, inlined: the relay re-arms once per block (per token, streaming).
        deadline = self._loop.time() + seconds
        self._deadline = deadline
        handle = self._handle
        if handle is None or self._due > deadline:
            if handle is not None:
                handle.cancel()
            self._schedule(deadline)

"""`Proxy.handle` through its seams, with no socket and no wall clock: a fake pool whose
attempts run on scripted engine connections (the real parser and `Attempt`), a recording sink,
router, booking, span and observer, the real planner and the real queue gate (its entries
recorded), and a clock the test moves.

What is pinned: every moment reaches every subscriber exactly once and in order (the queue
entry, the booking, the span, then the process's observer), and the exact sequence, answer and
outcome of every way an exchange can end.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.contract import HEALTH_PATH, HealthRequest, parse_request
from pylon.core.errors import ErrorCode
from pylon.core.intake import AdmittedRequest
from pylon.core.plan import Planner
from pylon.core.queue import GONE, QueueGate, QueuePolicy, QueueTable
from pylon.core.retry import RETRY_AFTER_MS, RETRY_REASON, RETRYABLE, RetryPolicy
from pylon.core.upstream import Upstream
from pylon.proxy import Proxy, RelayLimits
from pylon.proxy.exchange import Exchange
from pylon.routing import NoWorker
from pylon.upstream import UpstreamBusy, UpstreamConnectError

from .fakes import (
    SSE_HEAD,
    UPSTREAM,
    ClockedLoop,
    FakePool,
    Moments,
    RecordingObserver,
    RecordingQueue,
    RecordingRouter,
    RecordingSink,
    RecordingTracer,
    ScriptedEngine,
    response_head,
    settle,
    whole_response,
)
from .helpers import tunnel

LIMITS = RelayLimits(
    first_output_timeout=30.0,
    output_gap_timeout=5.0,
    max_sse_event_bytes=1024,
    client_send_timeout=10.0,
)

# Its queue gate is a recording fake (`RecordingQueue`), which the compiled proxy's typed
# slot refuses: the compiled build runs the proxy with the real gate everywhere else.
pytestmark = pytest.mark.interpreted

STREAM = b'{"model":"m","stream":true}'
WHOLE = b'{"model":"m"}'
# The exchange's own subscribers in the order they join (the queue gate, the booking, the
# span), then the process's observer, which hears every moment last.
EVERYONE = ("queue", "booking", "span", "observer")


MOMENTS = ("dispatched", "response_head:200", "first_output", "complete:ok")


def told(*moments: str) -> list[str]:
    """Each moment, told to every subscriber in turn, before the next moment."""
    return [f"{who}.{moment}" for moment in moments for who in EVERYONE]


def event(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"delta": {"content": text}}]}) + b"\n\n"


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


class Harness:
    """One proxy on fakes, and the one request it handles."""

    def __init__(
        self,
        *,
        retry: RetryPolicy | None = None,
        relay: RelayLimits = LIMITS,
        no_worker: NoWorker | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self.clock = ClockedLoop(loop)
        self.log = Moments()
        self.pool = FakePool(self.clock, loop)
        self.router = RecordingRouter(self.log, refuse=no_worker)
        self.observer = RecordingObserver(self.log)
        adapter = build_adapter("vllm", AdapterOptions(3600), derive=True)
        self.gate = QueueGate(QueueTable(1000.0), QueuePolicy(), adapter)
        self.queue = RecordingQueue(self.log, self.gate)
        self.tracer = RecordingTracer(self.log)
        self.proxy = Proxy(
            planner=Planner(adapter),
            router=self.router,
            pool=self.pool,
            observer=self.observer,
            relay=relay,
            retry=retry or RetryPolicy(),
            queue=self.queue,  # type: ignore[arg-type]
            tracer=self.tracer,
        )
        self.sink = RecordingSink()

    def start(
        self, body: bytes = STREAM, request: AdmittedRequest | None = None
    ) -> tuple[Exchange, asyncio.Task[None]]:
        """What the stream table does with a dispatched request."""
        request = request or tunnel()
        exchange = Exchange("h2", 1, self.clock.time(), self.observer, self.clock)  # type: ignore[arg-type]
        exchange.admitted(request)
        exchange.sink = self.sink
        return exchange, self.loop.create_task(self.proxy.handle(exchange, request, body))

    def queue_is_empty(self) -> bool:
        """Every queue entry left the table (the snapshot counts nothing in any phase)."""
        return all(
            (model.pending, model.prefill, model.decode) == (0, 0, 0)
            for model in self.gate.table.snapshot()
        )

    def kept(self) -> list[bool]:
        """For each attempt the proxy finished: whether its connection could be kept."""
        return [kept for _, kept in self.pool.finished]


# --- success --------------------------------------------------------------------------------------


async def test_a_stream_tells_every_subscriber_every_moment_once_in_order() -> None:
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.respond()
    for piece in (event("a"), event("b"), USAGE + DONE):
        engine.chunk(piece)
        await settle()
    engine.end()
    await task

    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output"),
        "booking.output(1)",  # one per relayed block, from the first output on
        "booking.output(1)",
        "booking.output(1)",  # the usage event; [DONE] is not output
        *told("complete:ok"),
    ]
    assert h.sink.events == ["start", "write", "write", "write", "end"]
    assert h.sink.body == event("a") + event("b") + USAGE + DONE
    assert h.sink.status == 200 and h.sink.header(b"x-request-id") == b"req-1"
    assert (exchange.status, exchange.outcome, exchange.attempts) == (200, "ok", 1)
    assert exchange.worker == h.tracer.started[0] == "engine.test:8000"
    assert (exchange.input_tokens, exchange.output_tokens) == (3, 2)  # the engine's usage
    clock = (exchange.head_at, exchange.dispatched_at, exchange.first_byte_at)
    assert clock == (1000.0, 1000.0, 1000.0) and exchange.done_at == 1000.0
    assert h.kept() == [True] and h.queue_is_empty()
    # What the engine got: the routed plan, bound for the booked worker with its pin.
    request, plan = engine.request, exchange.plan
    assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: engine.test:8000\r\n")
    assert b"\r\nx-worker-pin: 7\r\n" in request and request.endswith(b"\r\n\r\n" + plan.body)


async def test_a_whole_response_tells_every_moment_once_and_counts_no_output() -> None:
    h = Harness()
    exchange, task = h.start(WHOLE)
    engine = await h.pool.written()
    body = b'{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":9}}'
    engine.send(whole_response(200, body))
    await task

    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output", "complete:ok"),
    ]
    assert h.sink.events == ["start", "write", "end"] and h.sink.body == body
    assert h.sink.content_length == len(body)
    assert exchange.ends_prefill  # a successful whole response: its head ends the prefill
    assert (exchange.input_tokens, exchange.output_tokens) == (4, 9)
    assert h.kept() == [True] and h.queue_is_empty()


async def test_an_engine_error_status_is_relayed_with_its_retry_marking() -> None:
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    body = b'{"error":"busy"}'
    upstream_retryable = (b"x-stargate-upstream-retryable", b"true")
    engine.send(whole_response(503, body, [upstream_retryable, (b"retry-after", b"2")]))
    await task

    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched"),
        "observer.upstream_status:503:upstream_admission_rejected",
        *told("response_head:503", "first_output", "complete:ok"),
    ]
    assert not exchange.ends_prefill  # an error's head ends no prefill worth measuring
    assert h.sink.status == 503 and h.sink.body == body
    assert h.sink.header(RETRYABLE) == b"true"
    assert h.sink.header(RETRY_REASON) == b"upstream_admission_rejected"
    assert h.sink.header(RETRY_AFTER_MS) == b"2000"
    assert h.sink.header(b"x-stargate-upstream-retryable") is None  # the engine's own: dropped


async def test_a_health_request_has_no_queue_entry_and_no_span() -> None:
    h = Harness()
    health = parse_request(b"GET", HEALTH_PATH, [(b"host", b"gw")])
    assert isinstance(health, HealthRequest)
    exchange, task = h.start(b"", request=health)
    engine = await h.pool.written()
    engine.send(whole_response(200, b"ok"))
    await task

    assert engine.request.startswith(b"GET " + HEALTH_PATH + b" HTTP/1.1\r\n")
    assert h.log.lines == [
        "observer.admitted",
        *[f"{who}.{moment}" for moment in MOMENTS for who in ("booking", "observer")],
    ]
    assert h.queue.entries == [] and h.tracer.started == [] and h.sink.body == b"ok"
    assert (exchange.path, exchange.model, exchange.outcome) == ("/health", None, "ok")


@settings(max_examples=40, deadline=None)
@example(texts=["ab", "c"], cuts=set(range(1, 400)))  # a byte at a time
@given(
    texts=st.lists(st.text(max_size=12), min_size=1, max_size=5),
    cuts=st.sets(st.integers(min_value=1, max_value=2000), max_size=30),
)
async def test_the_response_bytes_may_arrive_cut_anywhere(texts: list[str], cuts: set[int]) -> None:
    """The parser seam: the engine's whole HTTP response (head, chunked coding, events), cut
    at any points, reaches the client as the same events, each moment once."""
    events = b"".join(event(text) for text in texts) + DONE
    raw = response_head(200, SSE_HEAD) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events)
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    start = 0
    for cut in [*sorted(cut for cut in cuts if cut < len(raw)), len(raw)]:
        engine.send(raw[start:cut])
        start = cut
        await settle(3)
    await task

    assert h.sink.body == events
    assert exchange.outcome == "ok" and exchange.output_tokens == len(texts)
    moments = h.log.of("booking")
    assert moments[:3] == ["dispatched", "response_head:200", "first_output"]
    assert moments[-1] == "complete:ok"
    outputs = [int(line[len("output(") : -1]) for line in moments if line.startswith("output(")]
    assert sum(outputs) == len(texts)
    assert h.log.of("observer") == [
        "admitted",
        "dispatched",
        "response_head:200",
        "first_output",
        "complete:ok",
    ]


# --- the engine cannot be reached -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "retryable_policy", "code", "retryable", "reason"),
    [
        (UpstreamConnectError("refused"), False, "upstream_unavailable", b"false", None),
        (UpstreamConnectError("refused"), True, "upstream_unavailable", b"true", None),
        (UpstreamBusy("all busy"), False, "upstream_busy", b"true", b"upstream_busy"),
    ],
)
async def test_a_connect_failure_is_a_503_problem_and_the_exchange_completes(
    failure: UpstreamConnectError,
    retryable_policy: bool,
    code: str,
    retryable: bytes,
    reason: bytes | None,
) -> None:
    h = Harness(retry=RetryPolicy(local_connect_failures_retryable=retryable_policy))
    h.pool.refusals.append(failure)
    exchange, task = h.start()
    await task

    problem = h.sink.problem()
    assert (h.sink.status, problem["code"], problem["request_id"]) == (503, code, "req-1")
    assert h.sink.header(RETRYABLE) == retryable
    # A refused connection is marked as the operator says; busy as its code says.
    assert h.sink.header(RETRY_REASON) == (reason or b"local_connect_failure")
    # Booked and gated, never dispatched: no `rejected` (that is for pylon's answers before
    # any booking), and `complete` ends it.
    assert h.log.lines == [
        "observer.admitted",
        f"observer.upstream_failed:{code}:before_head",
        *told(f"complete:{code}"),
    ]
    assert (exchange.status, exchange.outcome, exchange.attempts) == (503, code, 0)
    assert exchange.dispatched_at is None and h.pool.finished == [] and h.queue_is_empty()


async def test_a_worker_that_cannot_be_reached_moves_the_request_and_its_booking() -> None:
    h = Harness()
    other = Upstream.from_url("http://worker2.test:8000")
    h.router.others.append(other)
    h.pool.refusals.append(UpstreamConnectError("cannot connect to engine: refused"))
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.respond()
    engine.chunk(event("a") + DONE)
    engine.end()
    await task

    # The second attempt went to the other worker, with the other booking's pin, once.
    assert [plan.upstream for plan, _ in h.router.moved] == [None]  # the unrouted plan
    assert h.router.moved[0][1] == UPSTREAM.label
    assert engine.connection.upstream == other and h.pool.sends == [False, False]
    assert b"x-worker-pin: 7" in engine.request and engine.request.count(b"x-worker-pin") == 1
    assert (exchange.attempts, exchange.worker, exchange.outcome) == (2, other.label, "ok")
    # The first booking is released as not served; the second hears the exchange from its
    # dispatch on, in the first one's place.
    assert h.log.of("booking") == ["rejected:upstream_unavailable"]
    assert h.log.of("booking2") == [*MOMENTS[:3], "output(1)", "complete:ok"]
    assert h.log.of("observer")[:2] == ["admitted", "dispatched"]
    assert h.sink.status == 200 and h.queue_is_empty()


async def test_a_stale_connection_whose_retry_cannot_connect_moves_without_a_second_dispatch() -> (
    None
):
    h = Harness()
    other = Upstream.from_url("http://worker2.test:8000")
    h.router.others.append(other)
    h.pool.idle.append(ScriptedEngine(h.loop))
    h.pool.refusals.append(UpstreamConnectError("cannot connect to engine: refused"))
    exchange, task = h.start()
    stale = await h.pool.written()
    stale.close()  # the engine never read it; the new connection to it is refused
    engine = await h.pool.written()
    assert engine.connection.upstream == other
    engine.respond()
    engine.chunk(event("a") + DONE)
    engine.end()
    await task

    assert h.pool.sends == [True, False]
    # The stale try, the refused connection, the try on the other worker: one dispatch.
    assert exchange.attempts == 3 and h.log.of("observer").count("dispatched") == 1
    assert h.log.of("booking") == ["dispatched", "rejected:upstream_unavailable"]
    assert h.log.of("booking2") == ["response_head:200", "first_output", "output(1)", "complete:ok"]
    assert h.sink.status == 200 and h.queue_is_empty()


async def test_a_request_no_other_worker_can_take_is_answered_unreached() -> None:
    h = Harness(retry=RetryPolicy(local_connect_failures_retryable=True))
    h.router.others.append(Upstream.from_url("http://worker2.test:8000"))
    h.pool.refusals += [UpstreamConnectError("refused"), UpstreamConnectError("refused too")]
    exchange, task = h.start()
    await task

    # Moved once, never twice: the second refusal is the answer.
    assert len(h.router.moved) == 1
    assert (h.sink.status, h.sink.problem()["code"]) == (503, "upstream_unavailable")
    assert h.sink.header(RETRYABLE) == b"true"
    assert h.log.of("booking") == ["rejected:upstream_unavailable"]
    assert h.log.of("booking2") == ["complete:upstream_unavailable"]
    assert exchange.attempts == 1 and h.queue_is_empty()


async def test_a_busy_pool_is_not_moved() -> None:
    h = Harness()
    h.router.others.append(Upstream.from_url("http://worker2.test:8000"))
    h.pool.refusals.append(UpstreamBusy("all busy"))
    _, task = h.start()
    await task
    assert h.router.moved == [] and h.sink.problem()["code"] == "upstream_busy"


# --- a kept-alive connection the engine had just closed -------------------------------------------


async def test_a_stale_connection_gets_a_second_attempt_of_the_same_dispatch() -> None:
    h = Harness()
    h.pool.idle.append(ScriptedEngine(h.loop))
    exchange, task = h.start()
    stale = await h.pool.written()
    assert stale.connection.reused
    stale.close()  # before a single response byte: the engine never read the request
    fresh = await h.pool.written()
    fresh.respond()
    fresh.chunk(event("a") + DONE)
    fresh.end()
    await task

    assert h.pool.sends == [True]  # the second attempt on a new connection, never an idle one
    assert fresh.request == stale.request  # the same request, once more
    assert exchange.attempts == 2 and exchange.attempt.connection is fresh.connection
    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output"),  # one dispatch
        "booking.output(1)",
        *told("complete:ok"),
    ]
    assert h.kept() == [False, True] and h.sink.body == event("a") + DONE


async def test_a_second_stale_break_is_not_retried_again() -> None:
    h = Harness()
    h.pool.idle.append(ScriptedEngine(h.loop))
    # At the connection cap the retry may get a kept-alive connection handed over: stale or
    # not, a second break ends the exchange.
    h.pool.handed.append(ScriptedEngine(h.loop))
    exchange, task = h.start()
    (await h.pool.written()).close()
    (await h.pool.written()).close()
    await task

    assert h.pool.sends == [True] and h.pool.unwritten
    assert exchange.attempts == 2 and h.sink.problem()["code"] == "upstream_protocol_error"
    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched"),
        "observer.upstream_failed:upstream_protocol_error:before_head",
        *told("complete:upstream_protocol_error"),
    ]


async def test_a_kept_alive_connection_that_answered_a_byte_is_not_retried() -> None:
    h = Harness()
    h.pool.idle.append(ScriptedEngine(h.loop))
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.send(b"HTTP/1.1 2")  # the engine read the request: sending it again is not safe
    engine.close()
    await task

    assert h.pool.sends == [] and exchange.attempts == 1
    assert (h.sink.status, exchange.outcome) == (502, "upstream_protocol_error")


# --- the engine fails before its head -------------------------------------------------------------


async def test_no_head_within_the_first_output_timeout_is_a_504() -> None:
    h = Harness()
    exchange, task = h.start()
    await h.pool.written()
    h.clock.advance(LIMITS.first_output_timeout - 0.5)
    await settle()
    assert not task.done()
    h.clock.advance(0.5)
    await task

    problem = h.sink.problem()
    assert (h.sink.status, problem["code"]) == (504, "upstream_timeout")
    assert problem["detail"] == "no response head in time"
    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched"),
        "observer.upstream_failed:upstream_timeout:before_head",
        *told("complete:upstream_timeout"),
    ]
    assert (exchange.status, exchange.first_byte_at) == (504, None)
    assert h.kept() == [False] and h.queue_is_empty() and h.clock.armed == []


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(response_head(200, SSE_HEAD)[:30], id="closed-inside-the-head"),
        pytest.param(b"SPDY/9 200 OK\r\n\r\n", id="malformed-head"),
    ],
)
async def test_an_engine_that_breaks_before_its_head_is_a_502(answer: bytes) -> None:
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.send(answer)
    engine.close()
    await task

    assert (h.sink.status, h.sink.problem()["code"]) == (502, "upstream_protocol_error")
    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched"),
        "observer.upstream_failed:upstream_protocol_error:before_head",
        *told("complete:upstream_protocol_error"),
    ]
    assert exchange.attempts == 1 and h.kept() == [False] and h.queue_is_empty()


# --- the engine fails after its head --------------------------------------------------------------


async def test_a_stream_broken_after_the_head_ends_with_an_sse_error_event() -> None:
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.respond()
    engine.chunk(event("a"))
    await settle()
    engine.close()
    await task

    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output"),
        "booking.output(1)",
        "observer.upstream_failed:upstream_protocol_error:after_head",
        *told("complete:upstream_protocol_error"),
    ]
    error = h.sink.sse_error()
    assert (error["code"], error["request_id"]) == ("upstream_protocol_error", "req-1")
    assert h.sink.events == ["start", "write", "write", "end"]
    assert exchange.status == 200  # the client already had the head
    assert exchange.output_tokens == 1  # counted also when the stream is cut short
    assert h.kept() == [False] and h.queue_is_empty()


async def test_a_whole_body_broken_after_the_head_cuts_the_response() -> None:
    h = Harness()
    exchange, task = h.start(WHOLE)
    engine = await h.pool.written()
    engine.send(whole_response(200, b"x" * 100)[:-90])  # the head and 10 bytes of 100
    await settle()
    engine.close()
    await task

    assert h.sink.events == ["start", "write", "abort"]  # no end: the client sees a cut
    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output"),
        "observer.upstream_failed:upstream_protocol_error:after_head",
        *told("complete:upstream_broken_mid_body"),
    ]
    assert exchange.status == 200 and h.kept() == [False]


async def test_an_event_over_the_size_limit_ends_the_stream_and_the_connection() -> None:
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.respond()
    engine.chunk(b"data: " + b"x" * LIMITS.max_sse_event_bytes)  # no end in sight
    await task

    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200"),  # no output ever came
        "observer.upstream_failed:upstream_protocol_error:after_head",
        *told("complete:upstream_protocol_error"),
    ]
    assert h.sink.sse_error()["code"] == "upstream_protocol_error"
    assert h.sink.events == ["start", "write", "end"]
    assert h.kept() == [False]  # the rest of the event is unread: the connection is done
    assert exchange.first_output_at is None


# --- the client ends it ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [
        (("client_reset",), "client_reset"),
        (("client_disconnected",), "client_disconnected"),
        (("shutdown",), "shutdown"),
        ((), "cancelled"),
    ],
)
async def test_a_cancelled_exchange_ends_with_the_transports_reason(
    reason: tuple[str, ...], outcome: str
) -> None:
    h = Harness()
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.respond()
    engine.chunk(event("a"))
    await settle()
    task.cancel(*reason)
    with pytest.raises(asyncio.CancelledError):
        await task

    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output"),
        "booking.output(1)",
        *told(f"complete:{outcome}"),
    ]
    assert exchange.outcome == outcome and exchange.done_at is not None
    assert h.kept() == [False]  # the engine is told by the closed connection
    assert h.queue_is_empty() and h.clock.armed == []


async def test_a_cancel_before_the_head_completes_the_exchange_once() -> None:
    h = Harness()
    exchange, task = h.start()
    await h.pool.written()
    task.cancel("client_reset")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert h.log.lines == ["observer.admitted", *told("dispatched", "complete:client_reset")]
    assert (exchange.outcome, exchange.status, exchange.first_byte_at) == ("client_reset", 0, None)
    assert h.kept() == [False] and h.queue_is_empty()


async def test_a_client_that_stops_reading_ends_the_exchange_as_stalled() -> None:
    h = Harness(relay=RelayLimits(30.0, 5.0, 1024, client_send_timeout=0.0))
    h.sink.paused = True  # and it never drains
    exchange, task = h.start()
    engine = await h.pool.written()
    engine.respond()
    engine.chunk(event("a"))
    await task

    assert h.sink.events == ["start", "write", "drain", "abort"]
    assert h.log.lines == [
        "observer.admitted",
        *told("dispatched", "response_head:200", "first_output"),
        "booking.output(1)",
        *told("complete:client_send_timeout"),
    ]
    assert (exchange.outcome, exchange.status) == ("client_send_timeout", 200)
    assert h.kept() == [False]  # the engine request stops with its connection


# --- pylon answers before any engine sees the request ---------------------------------------------


async def test_a_queue_gate_refusal_is_a_429_and_the_entry_never_enters_the_table() -> None:
    h = Harness()
    h.gate.admit(tunnel((b"x-input-tokens", b"10000")), 0, True)  # 10 s of work ahead
    expecting = tunnel((b"x-stargate-expected-queue-ms", b"0"), (b"x-input-tokens", b"1"))
    exchange, task = h.start(request=expecting)
    await task

    problem = h.sink.problem()
    assert (h.sink.status, problem["code"]) == (429, "queue_estimate_mismatch")
    assert h.sink.header(RETRYABLE) == b"true"
    assert h.log.lines == [
        "observer.admitted",
        "observer.queue_gate:rejected",
        "queue.rejected:queue_estimate_mismatch",  # only the entry had subscribed
        "observer.rejected:queue_estimate_mismatch",
    ]
    (entry,) = h.queue.entries
    assert entry.entry.phase == GONE
    (model,) = h.gate.table.snapshot()
    assert model.pending == 1  # the one ahead of it, and only that one
    assert h.router.plans == [] and h.pool.sends == [] and h.pool.unwritten
    assert (exchange.status, exchange.outcome) == (429, "queue_estimate_mismatch")


async def test_no_worker_is_a_503_rejection_that_releases_the_queue_entry() -> None:
    h = Harness(no_worker=NoWorker("no worker in rotation"))
    exchange, task = h.start()
    assert h.gate.table.snapshot() == []  # (the entry is made inside the task)
    await task

    problem = h.sink.problem()
    assert (h.sink.status, problem["code"]) == (503, "no_worker")
    assert problem["detail"] == "no worker in rotation"
    assert h.sink.header(RETRYABLE) == b"true"
    assert h.log.lines == [
        "observer.admitted",
        "queue.rejected:no_worker",
        "observer.rejected:no_worker",
    ]
    assert len(h.router.plans) == 1 and h.pool.sends == [] and h.pool.unwritten
    assert h.queue.entries[0].entry.phase == GONE and h.queue_is_empty()
    assert (exchange.status, exchange.outcome) == (503, "no_worker")


async def test_a_planner_refusal_is_a_400_rejection_before_the_queue_gate() -> None:
    h = Harness()
    exchange, task = h.start(b'{"model":"another"}')
    await task

    problem = h.sink.problem()
    assert (h.sink.status, problem["code"]) == (400, ErrorCode.MODEL_MISMATCH.value)
    assert h.log.lines == ["observer.admitted", "observer.rejected:model_mismatch"]
    assert h.queue.entries == [] and h.router.plans == [] and h.pool.unwritten
    assert exchange.done_at is not None and exchange.outcome == "model_mismatch"

"""`StreamTable` through its seams, with no socket and no wall clock: a fake framing (it hands
out recording sinks and notes what the table did with each stream), a fake proxy whose tasks
run until the test ends them, admission that runs the real contract, and a clock the test
moves (the table takes its loop: here a `ClockedLoop`, so the stall watcher fires on demand).

What is pinned: head, data and end feed one dispatch into one proxy task; rejections go to the
reject sink; HTTP/1.1's serial mode answers in order (a rejection of a pipelined request waits
its turn); cancel reasons reach the task; the body budgets of the connection and the process
are taken as bytes arrive and given back on every path; the stall watcher answers 408.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.core.errors import ErrorCode
from pylon.core.head import RequestHead, malformed
from pylon.core.http import Header
from pylon.core.intake import IngressLimits
from pylon.lifecycle import Lifecycle
from pylon.server.budget import BodyBudget
from pylon.server.streams import (
    CLIENT_GONE,
    CLIENT_RESET,
    SHUTDOWN,
    Ingress,
    Stream,
    StreamTable,
)

from .fakes import (
    REFUSE,
    ClockedLoop,
    FakeFraming,
    FakeProxy,
    Moments,
    RecordingObserver,
    ScriptedAdmission,
    settle,
)

# Its proxy is a fake (`FakeProxy`), which the compiled stream table's typed slot refuses.
pytestmark = pytest.mark.interpreted

LIMITS = IngressLimits(
    max_header_bytes=4096,
    max_headers=20,
    max_body_bytes=100,
    max_connection_body_bytes=150,
    stall_timeout=10.0,
    idle_timeout=60.0,
    max_streams=8,
    max_quic_streams=8,
    h2_stream_window=65535,
    max_stream_resets=2,
    max_control_frames=10,
    flood_window=1.0,
)


def request_head(stream_id: int, *extra: Header, length: int | None = None) -> RequestHead:
    fields = [
        (b"host", b"gw"),
        (b"x-request-id", b"r-%d" % stream_id),
        (b"x-model", b"m"),
        *extra,
    ]
    if length is not None:
        fields.append((b"content-length", b"%d" % length))
    return RequestHead(b"POST", b"/v1/chat/completions", fields, length)


class Connection:
    """One connection's stream table on fakes."""

    def __init__(
        self,
        *,
        serial: bool = False,
        budget: BodyBudget | None = None,
        clock: ClockedLoop | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.clock = clock or ClockedLoop(loop)
        self.log = Moments()
        self.observer = RecordingObserver(self.log)
        self.proxy = FakeProxy(self.observer, self.clock)
        self.framing = FakeFraming()
        self.budget = budget or BodyBudget(10_000)
        proxy: Any = self.proxy  # what the table uses of a `Proxy`
        ingress = Ingress(proxy, ScriptedAdmission(), LIMITS, Lifecycle(), self.budget)
        loop_for_its_clock: Any = self.clock
        protocol = "http1" if serial else "h2"
        self.table = StreamTable(protocol, self.framing, ingress, loop_for_its_clock, serial=serial)

    def head(
        self, stream_id: int, *extra: Header, length: int | None = None, ended: bool = False
    ) -> Stream:
        stream = self.table.open(stream_id)
        self.table.head(stream, request_head(stream_id, *extra, length=length), ended)
        return stream


# --- head, data, end: one dispatch ----------------------------------------------------------------


@pytest.mark.parametrize("ending", ["data", "end", "trailers"])
async def test_head_data_and_end_feed_one_dispatch_into_one_proxy_task(ending: str) -> None:
    c = Connection()
    stream = c.head(1, length=5)
    c.table.data(1, b"ab", False)
    if ending == "data":
        c.table.data(1, b"cde", True)
    else:
        c.table.data(1, b"cde", False)
        if ending == "end":
            c.table.end(1)
        else:
            c.table.trailers(1, [(b"x-checksum", b"1")])
    handling = await c.proxy.handled()

    assert (handling.body, handling.request.request_id) == (b"abcde", "r-1")
    assert handling.exchange is stream.exchange
    assert handling.exchange.sink is c.framing.responses[1]
    assert c.framing.answers == ["response:1"] and c.table.busy
    assert c.budget.used == 5  # the proxy's task holds the body
    handling.finish()
    await settle()
    assert c.framing.answers == ["response:1", "done:1"]
    assert len(c.table) == 0 and not c.table.busy and c.budget.used == 0
    assert c.log.lines == ["observer.admitted"] and len(c.proxy.calls) == 1


async def test_a_head_that_ends_the_request_dispatches_at_once() -> None:
    c = Connection()
    c.head(1, ended=True)
    handling = await c.proxy.handled()
    assert handling.body == b"" and c.framing.answers == ["response:1"]


@settings(max_examples=50, deadline=None)
@given(body=st.binary(max_size=100), cuts=st.sets(st.integers(1, 99), max_size=20))
async def test_the_body_arrives_whole_however_it_was_cut(body: bytes, cuts: set[int]) -> None:
    c = Connection()
    c.head(1, length=len(body))
    start = 0
    for cut in sorted(cut for cut in cuts if cut < len(body)):
        c.table.data(1, body[start:cut], False)
        assert c.budget.used == cut  # taken as the bytes arrive
        start = cut
    c.table.data(1, body[start:], True)
    handling = await c.proxy.handled()
    assert handling.body == body
    handling.finish()
    await settle()
    assert c.budget.used == 0


# --- pylon's own answers --------------------------------------------------------------------------


async def test_a_refused_head_is_answered_on_the_reject_sink_and_the_body_dropped() -> None:
    c = Connection()
    c.head(1, (REFUSE, b"1"), length=4)
    c.table.data(1, b"body", True)  # the rest of a request pylon answered: not read

    problem = c.framing.rejects[1].problem()
    assert (c.framing.rejects[1].status, problem["code"]) == (503, "not_ready")
    assert problem["request_id"] == "r-1"
    assert c.framing.answers == ["reject:1"] and c.proxy.calls == []
    assert c.log.lines == ["observer.rejected:not_ready"]
    assert len(c.table) == 0 and c.budget.used == 0


async def test_a_malformed_request_keeps_its_id_from_the_raw_fields() -> None:
    c = Connection()
    c.table.open(1)
    c.table.malformed(1, malformed("bad field"), [(b"x-request-id", b"r-raw")])
    problem = c.framing.rejects[1].problem()
    assert (problem["code"], problem["request_id"]) == ("malformed_request", "r-raw")
    assert c.log.lines == ["observer.rejected:malformed_request"]


async def test_a_body_over_the_limit_is_a_413_and_its_bytes_are_given_back() -> None:
    c = Connection()
    c.head(1)
    c.table.data(1, b"x" * 60, False)
    assert c.budget.used == 60
    c.table.data(1, b"x" * 41, False)  # 101 > max_body_bytes
    assert c.framing.rejects[1].problem()["code"] == "body_too_large"
    assert c.budget.used == 0 and c.proxy.calls == []


# --- HTTP/1.1: one at a time, in order ------------------------------------------------------------


async def test_serial_mode_answers_pipelined_requests_in_order_rejections_too() -> None:
    c = Connection(serial=True)
    c.head(1, ended=True)
    first = await c.proxy.handled()
    c.head(2, (REFUSE, b"1"), ended=True)  # refused: but its answer waits its turn
    c.head(3, ended=True)
    await settle()
    assert c.framing.answers == ["response:1"] and c.table.queued
    assert 2 not in c.framing.rejects and len(c.proxy.calls) == 1

    first.finish()
    third = await c.proxy.handled()
    assert c.framing.answers == ["response:1", "done:1", "reject:2", "response:3"]
    assert c.framing.rejects[2].problem()["code"] == "not_ready"
    assert third.request.request_id == "r-3" and not c.table.queued
    third.finish()
    await settle()
    assert c.framing.answers[-1] == "done:3" and not c.table.busy


async def test_without_serial_mode_a_rejection_is_answered_at_once() -> None:
    c = Connection()
    c.head(1, ended=True)
    first = await c.proxy.handled()
    c.head(3, (REFUSE, b"1"), ended=True)
    assert c.framing.answers == ["response:1", "reject:3"]
    first.finish()
    await settle()


async def test_a_queued_request_that_is_cancelled_never_starts() -> None:
    c = Connection(serial=True)
    c.head(1, ended=True)
    first = await c.proxy.handled()
    c.head(2, length=3)
    c.table.data(2, b"abc", True)
    assert c.table.queued and c.budget.used == 3
    c.table.cancel(2, CLIENT_GONE)
    assert not c.table.queued and c.budget.used == 0
    first.finish()
    await settle()
    assert c.framing.answers == ["response:1", "done:1"] and len(c.proxy.calls) == 1


# --- cancel ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", [CLIENT_RESET, CLIENT_GONE, SHUTDOWN])
async def test_a_cancel_reaches_the_proxy_task_with_its_reason(reason: str) -> None:
    c = Connection()
    stream = c.head(1, length=2)
    c.table.data(1, b"ab", True)
    handling = await c.proxy.handled()
    c.table.cancel(1, reason)
    assert c.budget.used == 2  # the task still holds the body until it ends
    await settle()

    assert handling.cancelled_with == reason
    assert stream.task is not None and stream.task.cancelled()
    assert c.framing.answers == ["response:1", "done:1"]  # cancelled is not crashed
    assert c.observer.transport_events == [
        ("stream_cancelled", "h2", {"stream_id": 1, "request_id": "r-1", "reason": reason})
    ]
    assert c.budget.used == 0 and len(c.table) == 0


async def test_cancel_all_cancels_every_stream_and_the_stall_watcher() -> None:
    c = Connection()
    c.head(1, ended=True)
    c.head(3, length=10)  # still receiving: the stall watcher runs for it
    first = await c.proxy.handled()
    assert c.clock.armed
    c.table.cancel_all(SHUTDOWN)
    await settle()
    assert first.cancelled_with == SHUTDOWN
    assert c.clock.armed == [] and len(c.table) == 0


async def test_only_resets_of_live_streams_count_toward_the_rapid_reset_guard() -> None:
    c = Connection()
    assert not c.table.peer_reset(99)  # unknown: not a live request
    tripped = []
    for stream_id in (1, 3, 5):
        c.head(stream_id, length=10)
        tripped.append(c.table.peer_reset(stream_id))
    assert tripped == [False, False, True]  # max_stream_resets=2 per window


async def test_a_framing_that_breaks_the_intakes_rules_cancels_the_stream() -> None:
    c = Connection()
    c.head(1, ended=True)
    handling = await c.proxy.handled()
    c.table.data(1, b"more", False)  # data after the end: impossible from a sane framing
    await settle()
    assert handling.cancelled_with == "protocol_error"
    assert c.observer.kinds() == ["stream_state_error", "stream_cancelled"]


async def test_a_crashed_task_is_reported_and_its_stream_done() -> None:
    c = Connection()
    c.head(1, length=2)
    c.table.data(1, b"ab", True)
    handling = await c.proxy.handled()
    handling.done.set_exception(RuntimeError("a bug"))
    await settle()
    assert c.framing.answers == ["response:1", "crashed:1"]
    assert c.log.lines == ["observer.admitted", "observer.crashed:RuntimeError"]
    assert c.budget.used == 0


# --- the body budgets -----------------------------------------------------------------------------


async def test_the_connection_budget_refuses_a_body_it_has_no_room_for() -> None:
    c = Connection()  # 150 bytes of bodies per connection
    c.head(1, length=80)
    c.table.data(1, b"x" * 80, True)
    first = await c.proxy.handled()
    c.head(3, length=80)
    c.table.data(3, b"y" * 40, False)
    assert c.budget.used == 120
    c.table.data(3, b"y" * 40, False)  # 160 > 150
    problem = c.framing.rejects[3].problem()
    assert (c.framing.rejects[3].status, problem["code"]) == (503, "body_budget_exceeded")
    assert "this connection's request bodies (150 bytes)" in problem["detail"]
    assert c.budget.used == 80  # the refused stream's 40 given back; the first still held
    first.finish()
    await settle()
    assert c.budget.used == 0


async def test_the_process_budget_is_shared_by_every_connection() -> None:
    budget = BodyBudget(100)
    clock = ClockedLoop(asyncio.get_running_loop())
    a, b = Connection(budget=budget, clock=clock), Connection(budget=budget, clock=clock)
    a.head(1, length=80)
    a.table.data(1, b"x" * 80, False)
    b.head(1, length=30)
    b.table.data(1, b"y" * 30, False)  # 110 > 100, though b's connection holds nothing
    problem = b.framing.rejects[1].problem()
    assert problem["code"] == ErrorCode.BODY_BUDGET_EXCEEDED.value
    assert "the request bodies pylon holds at once (100 bytes)" in problem["detail"]
    assert budget.used == 80
    a.table.cancel(1, CLIENT_GONE)  # not dispatched yet: given back at once
    assert budget.used == 0


@pytest.mark.parametrize(
    "path", ["done", "crashed", "cancelled-in-task", "cancelled-before", "stalled", "too-large"]
)
async def test_the_budgets_are_given_back_on_every_path(path: str) -> None:
    c = Connection()
    c.head(1, length=50)
    c.table.data(1, b"x" * 30, False)
    assert c.budget.used == 30
    if path == "cancelled-before":
        c.table.cancel(1, CLIENT_RESET)
    elif path == "stalled":
        c.clock.advance(LIMITS.stall_timeout)
    elif path == "too-large":
        c.table.data(1, b"x" * 71, False)
    else:
        c.table.data(1, b"x" * 20, True)
        handling = await c.proxy.handled()
        assert c.budget.used == 50
        if path == "done":
            handling.finish()
        elif path == "crashed":
            handling.done.set_exception(RuntimeError("a bug"))
        else:
            c.table.cancel(1, CLIENT_RESET)
    await settle()
    assert c.budget.used == 0 and len(c.table) == 0
    # And the connection's whole budget is there again: 150 bytes held at once fit.
    c.head(3, length=100)
    c.table.data(3, b"z" * 100, False)
    c.head(5, length=50)
    c.table.data(5, b"z" * 50, False)
    assert c.framing.rejects.keys() <= {1} and c.budget.used == 150


# --- the stall watcher ----------------------------------------------------------------------------


async def test_a_body_that_stops_arriving_is_answered_408() -> None:
    c = Connection()
    c.head(1, length=10)
    c.table.data(1, b"abc", False)
    c.clock.advance(LIMITS.stall_timeout - 0.5)
    assert 1 not in c.framing.rejects
    c.clock.advance(0.5)

    problem = c.framing.rejects[1].problem()
    assert (c.framing.rejects[1].status, problem["code"]) == (408, "request_timeout")
    assert problem["request_id"] == "r-1"
    assert c.observer.transport_events == [
        ("client_timeout", "h2", {"timer": "body", "stream_id": 1, "request_id": "r-1"})
    ]
    assert c.budget.used == 0 and c.proxy.calls == []


async def test_the_stall_clock_counts_from_the_last_progress_of_each_stream() -> None:
    c = Connection()
    c.head(1, length=10)
    c.clock.advance(4.0)
    c.head(3, length=10)  # its clock starts 4 s later
    c.clock.advance(4.0)
    c.table.data(1, b"a", False)  # progress at 8 s: stream 1 is due at 18 s
    c.clock.advance(4.0)  # 12 s: stream 3 (due at 14 s) and stream 1 still fine
    assert c.framing.answers == []
    c.clock.advance(2.0)  # 14 s
    assert c.framing.answers == ["reject:3"]
    c.clock.advance(4.0)  # 18 s
    assert c.framing.answers == ["reject:3", "reject:1"]
    assert c.clock.armed == []  # no stream left to watch


async def test_a_dispatched_request_is_no_longer_watched() -> None:
    c = Connection()
    c.head(1, length=1)
    c.table.data(1, b"a", True)
    handling = await c.proxy.handled()
    c.clock.advance(LIMITS.stall_timeout * 5)  # the engine may take its time
    assert c.framing.answers == ["response:1"] and handling.cancelled_with is None
    handling.finish()
    await settle()

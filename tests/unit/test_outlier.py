"""Passive health without sockets: the outlier rule on a clock of the test's own (`now` passed
in, never read), and the fleet's rotation it feeds through the bookings' moments."""

from __future__ import annotations

import pytest

from pylon.core.errors import ErrorCode, UpstreamError
from pylon.core.record import RequestRecord
from pylon.routing.fleet import Fleet, WorkerBooking
from pylon.routing.outlier import (
    BROKEN,
    CONNECT_FAILURE,
    STATUS_5XX,
    TIMEOUT,
    Ejection,
    Held,
    OutlierDetector,
    OutlierOptions,
    OutlierState,
    failure_of_outcome,
    failure_of_status,
)
from pylon.routing.passive import PassiveHealth
from pylon.routing.round_robin import RoundRobinRouter
from pylon.routing.spec import parse_worker_spec
from tests.observers import EventObserver

OPTIONS = OutlierOptions(
    consecutive=3, base_ejection=10.0, max_ejection=35.0, max_ejected_share=0.5
)


def fail(
    detector: OutlierDetector, state: OutlierState, times: int, now: float, in_rotation: int = 4
) -> list[Ejection | Held | None]:
    return [detector.failure(state, STATUS_5XX, now, in_rotation) for _ in range(times)]


def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    detector, state = OutlierDetector(OPTIONS, 4), OutlierState()
    assert fail(detector, state, 2, now=0.0) == [None, None]
    detector.success(state)
    assert fail(detector, state, 2, now=1.0) == [None, None]  # two again, not four
    ejection = detector.failure(state, CONNECT_FAILURE, 2.0, 4)
    assert ejection == Ejection(CONNECT_FAILURE, 3, 10.0, 12.0, 1)
    assert state.ejected and detector.ejected == 1
    # Answers from requests still in flight change nothing while it is out.
    assert fail(detector, state, 5, now=3.0) == [None] * 5 and detector.ejected == 1


def test_it_returns_after_its_backoff_on_probation_and_the_backoff_grows() -> None:
    detector, state = OutlierDetector(OPTIONS, 4), OutlierState()
    fail(detector, state, 3, now=0.0)
    assert not detector.due(state, 9.999)
    assert detector.due(state, 10.0)
    detector.returned(state)
    assert not state.ejected and state.probation and detector.ejected == 0
    # On probation, its first failure ejects it again, for twice as long...
    assert detector.failure(state, TIMEOUT, 20.0, 4) == Ejection(TIMEOUT, 1, 20.0, 40.0, 2)
    detector.returned(state)
    assert detector.failure(state, BROKEN, 50.0, 4) == Ejection(BROKEN, 1, 35.0, 85.0, 3)  # capped
    detector.returned(state)
    # ...and a success forgives it: the next ejection starts from the base again.
    detector.success(state)
    assert not state.probation
    assert fail(detector, state, 3, now=100.0)[-1] == Ejection(STATUS_5XX, 3, 10.0, 110.0, 1)


@pytest.mark.parametrize(
    ("size", "share", "cap"),
    [(1, 0.5, 0), (2, 0.1, 1), (2, 1.0, 1), (3, 0.5, 1), (4, 0.5, 2), (10, 0.25, 2), (10, 1.0, 9)],
)
def test_the_share_ejected_at_once_is_capped_never_the_whole_fleet(
    size: int, share: float, cap: int
) -> None:
    options = OutlierOptions(3, 10.0, 100.0, share)
    detector = OutlierDetector(options, size)
    assert detector.cap == cap
    assert detector.enabled == (cap > 0)
    states = [OutlierState() for _ in range(size)]
    if cap == 0:  # one worker: never ejected by its answers
        assert fail(detector, states[0], 10, now=0.0) == [None] * 10
        return
    for state in states[:cap]:
        assert isinstance(fail(detector, state, 3, now=0.0)[-1], Ejection)
    held = states[cap]
    verdicts = fail(detector, held, 5, now=1.0, in_rotation=size - cap)
    assert verdicts[:2] == [None, None]
    assert verdicts[2] == Held(STATUS_5XX, 3, cap, cap)
    assert verdicts[3:] == [None, None]  # reported once
    assert not held.ejected and detector.ejected == cap
    # One returns: the next failure of the held worker may eject it.
    detector.returned(states[0])
    assert isinstance(detector.failure(held, STATUS_5XX, 2.0, size - cap + 1), Ejection)


def test_the_last_worker_in_rotation_is_never_ejected() -> None:
    detector, state = OutlierDetector(OPTIONS, 4), OutlierState()
    assert fail(detector, state, 3, now=0.0, in_rotation=1)[-1] == Held(STATUS_5XX, 3, 0, 2)


def test_zero_failures_turns_it_off() -> None:
    detector = OutlierDetector(OutlierOptions(0, 10.0, 10.0, 1.0), 4)
    state = OutlierState()
    assert not detector.enabled and fail(detector, state, 100, now=0.0) == [None] * 100


def test_what_counts_as_a_failure() -> None:
    assert [failure_of_status(s) for s in (200, 404, 429, 499, 503)] == [None] * 5
    assert [failure_of_status(s) for s in (500, 502, 504, 599)] == [STATUS_5XX] * 4
    assert failure_of_outcome("upstream_unavailable") == CONNECT_FAILURE
    assert failure_of_outcome("upstream_protocol_error") == BROKEN
    assert failure_of_outcome("upstream_timeout") == TIMEOUT
    for outcome in ("ok", "upstream_busy", "client_disconnected", "shutting_down", ""):
        assert failure_of_outcome(outcome) is None


# --- the bookings feed the fleet's one rotation -----------------------------------------------


def fleet_of(size: int) -> Fleet:
    specs = [parse_worker_spec(f"url=http://w{i}:1") for i in range(size)]
    fleet = Fleet.from_specs(specs, None)
    for worker in fleet.workers:
        fleet.set_in_rotation(worker, True)  # the active checks admit them all
    return fleet


def answered(booking: WorkerBooking, status: int) -> None:
    record = RequestRecord("http1", 1, 0.0)
    record.status = status
    record.first_byte_at = 0.0
    record.outcome = "ok"
    booking.response_head(record)
    booking.complete(record)


async def test_bookings_eject_a_failing_worker_from_the_rotation_routers_read() -> None:
    fleet = fleet_of(3)
    events = EventObserver()
    fleet.passive = PassiveHealth(fleet, OPTIONS, events)
    changes: list[int] = []
    fleet.on_change(lambda: changes.append(len(fleet.in_rotation)))
    bad = fleet.workers[1]
    router = RoundRobinRouter(fleet)
    for _ in range(3):
        answered(WorkerBooking(bad, "round-robin", fleet.passive), 500)
    assert [w.label for w in fleet.in_rotation] == ["http://w0:1", "http://w2:1"]
    assert changes == [2] and bad.checks_pass and not bad.in_rotation
    assert bad.ejections == {STATUS_5XX: 1}
    assert fleet.views()[1].ejected and fleet.views()[1].ejections == {STATUS_5XX: 1}
    [event] = events.of("worker_outlier_ejected")
    assert event == {
        "worker": "http://w1:1",
        "reason": STATUS_5XX,
        "failures": 3,
        "ejected_for_s": 10.0,
        "ejections": 1,
        "active": 1,  # ejected at its head: the request that tipped it is still in flight
    }
    # The routers never choose it while it is out.
    chosen = {(await router.book(None)).worker for _ in range(6)}  # type: ignore[arg-type]
    assert chosen == {"http://w0:1", "http://w2:1"}
    # An active check's pass does not bring it back before its time.
    fleet.set_in_rotation(bad, True)
    assert not bad.in_rotation
    await fleet.passive.aclose()


async def test_an_unanswered_exchange_is_judged_by_its_outcome() -> None:
    fleet = fleet_of(2)
    fleet.passive = PassiveHealth(fleet, OPTIONS, EventObserver())
    worker = fleet.workers[0]
    error = UpstreamError("refused", code=ErrorCode.UPSTREAM_UNAVAILABLE)
    record = RequestRecord("http1", 1, 0.0)
    # Released as not served (the exchange moved elsewhere): a connect failure.
    WorkerBooking(worker, "round-robin", fleet.passive).rejected(record, error)
    record.outcome = "upstream_timeout"  # no head in time
    WorkerBooking(worker, "round-robin", fleet.passive).complete(record)
    record.outcome = "client_disconnected"  # not the worker's doing
    WorkerBooking(worker, "round-robin", fleet.passive).complete(record)
    assert worker.outlier.failures == 2 and worker.active == 0
    record.outcome = "upstream_protocol_error"
    WorkerBooking(worker, "round-robin", fleet.passive).complete(record)
    assert not worker.in_rotation and worker.ejections == {BROKEN: 1}
    await fleet.passive.aclose()


def test_a_fleet_without_passive_health_only_counts() -> None:
    fleet = fleet_of(2)
    booking = WorkerBooking(fleet.workers[0], "round-robin", None)
    answered(booking, 500)
    assert fleet.workers[0].active == 0 and fleet.workers[0].in_rotation


async def test_a_good_head_is_judged_when_its_response_is_over() -> None:
    fleet = fleet_of(3)
    fleet.passive = PassiveHealth(fleet, OPTIONS, EventObserver())
    worker = fleet.workers[0]

    def ended(status: int, outcome: str) -> None:
        record = RequestRecord("http1", 1, 0.0)
        record.status, record.first_byte_at, record.outcome = status, 0.0, outcome
        booking = WorkerBooking(worker, "round-robin", fleet.passive)
        booking.response_head(record)
        booking.complete(record)

    ended(200, "upstream_broken_mid_body")  # a cut body
    ended(200, "client_disconnected")  # the client left: neither
    ended(404, "upstream_timeout")  # its output stopped
    assert worker.outlier.failures == 2
    ended(200, "ok")  # a whole response forgives
    assert worker.outlier.failures == 0
    ended(200, "upstream_protocol_error")  # an event stream ended short
    ended(500, "ok")  # counted once, at its head
    ended(200, "upstream_broken_mid_body")
    assert not worker.in_rotation and worker.ejections == {BROKEN: 1}
    await fleet.passive.aclose()

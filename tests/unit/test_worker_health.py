"""The routers' choices and the workers' health state, without sockets: a scripted fetch plays
each worker's health answers, one `check_once()` per round (no clock involved)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.core.plan import ForwardPlan
from pylon.core.priority import NO_WRITE
from pylon.core.record import RequestRecord
from pylon.core.upstream import Upstream
from pylon.routing import NoWorker
from pylon.routing.fleet import INSTANCE_PIN_HEADER, Fleet, Worker
from pylon.routing.health import HealthChecker, HealthCheckOptions, listed_instances
from pylon.routing.least_loaded import LeastLoadedRouter, least_loaded
from pylon.routing.round_robin import RoundRobinRouter
from pylon.routing.spec import parse_worker_spec
from pylon.upstream.probe import Fetched, FetchError
from tests.observers import EventObserver

RECORD = RequestRecord("http1", 1, 0.0)  # what the exchange hands its booking at its end
PLAN = ForwardPlan("POST", "/v1/completions", (), b"{}", "r", "m", False, (), NO_WRITE)
FRONTEND = Upstream.from_url("http://127.0.0.1:8000")


def fleet_of(*specs: str) -> Fleet:
    return Fleet.from_specs([parse_worker_spec(spec) for spec in specs], FRONTEND)


class Answers:
    """Each target's next health answer: a status, or a FetchError reason."""

    def __init__(self) -> None:
        self.now: dict[str, int | str] = {}
        self.bodies: dict[str, bytes] = {}
        self.asked: list[str] = []

    async def __call__(
        self, target: Upstream, path: str, *, timeout: float, max_body: int
    ) -> Fetched:
        self.asked.append(f"{target.label}{path}")
        answer = self.now.get(target.label, 200)
        if isinstance(answer, str):
            raise FetchError(answer, f"cannot connect: {answer}")
        return Fetched(answer, self.bodies.get(target.label, b"{}"))


CHECKS = HealthCheckOptions("/health", interval=1.0, timeout=1.0, eject_after=3, readmit_after=2)


def checker(
    fleet: Fleet, answers: Answers, observer: Any, options: HealthCheckOptions = CHECKS
) -> HealthChecker:
    return HealthChecker(fleet, options, observer=observer, fetch=answers)


async def test_passing_checks_never_bring_back_a_worker_its_answers_ejected() -> None:
    """One rotation, two voices: the checks pass, passive health holds it out; each can take
    it out, and it is back only when both let it."""
    fleet = fleet_of("url=http://a:1", "url=http://b:1")
    answers, events = Answers(), EventObserver()
    checks = checker(fleet, answers, events)
    await checks.check_once()
    worker = fleet.workers[0]
    fleet.set_ejected(worker, True)  # what passive health does
    for _ in range(3):
        await checks.check_once()
    assert not worker.in_rotation and worker.checks_pass
    assert [w.label for w in fleet.in_rotation] == ["http://b:1"]
    assert events.of("worker_readmitted") == []  # no line per passed check
    answers.now["a:1"] = 503
    for _ in range(3):
        await checks.check_once()
    assert not worker.checks_pass and len(events.of("worker_ejected")) == 1
    fleet.set_ejected(worker, False)  # its ejection is over: the checks still hold it out
    assert not worker.in_rotation
    answers.now["a:1"] = 200
    for _ in range(2):
        await checks.check_once()
    assert worker.in_rotation and len(fleet.in_rotation) == 2


async def test_admission_at_start_ejection_after_n_and_readmission_after_m() -> None:
    fleet = fleet_of("url=http://a:1", "url=http://b:1")
    answers, events = Answers(), EventObserver()
    checks = checker(fleet, answers, events)
    answers.now["b:1"] = "connect"
    await checks.check_once()
    assert [w.label for w in fleet.in_rotation] == ["http://a:1"]  # admitted by its first pass
    assert fleet.workers[1].last_result == "cannot connect: connect"
    answers.now["a:1"] = 503
    for _ in range(2):
        await checks.check_once()
        assert fleet.workers[0].in_rotation  # two failures are not three
    await checks.check_once()
    assert fleet.in_rotation == ()
    ejected = events.of("worker_ejected")
    assert ejected == [
        {
            "worker": "http://a:1",
            "failures": 3,
            "detail": "3 health checks failed in a row; last: status 503",
            "active": 0,
        }
    ]
    answers.now["a:1"] = 200
    await checks.check_once()
    assert not fleet.workers[0].in_rotation  # one pass is not two
    answers.now["a:1"] = 500
    await checks.check_once()  # a failure resets the passes
    answers.now["a:1"] = 204
    await checks.check_once()
    assert not fleet.workers[0].in_rotation
    await checks.check_once()
    assert fleet.workers[0].in_rotation
    assert events.of("worker_readmitted") == [{"worker": "http://a:1", "passes": 2}]
    answers.now["b:1"] = 200
    await checks.check_once()  # never admitted before: its first pass admits it
    assert [e["worker"] for e in events.of("worker_admitted")] == ["http://a:1", "http://b:1"]
    assert answers.asked.count("a:1/health") == checks.rounds


async def test_instance_workers_share_one_frontend_probe_and_its_instance_list() -> None:
    fleet = fleet_of("instance-id=7", "instance-id=18446744073709551615", "url=http://a:1")
    answers, events = Answers(), EventObserver()
    checks = checker(fleet, answers, events, replace(CHECKS, eject_after=1))
    answers.bodies["127.0.0.1:8000"] = orjson.dumps(
        {
            "status": "healthy",
            "instances": [
                {"endpoint": "generate", "instance_id": 18446744073709551615},
                {"endpoint": "clear_kv_blocks", "instance_id": 7},  # another endpoint
            ],
        }
    )
    await checks.check_once()
    assert answers.asked.count("127.0.0.1:8000/health") == 1
    assert [w.label for w in fleet.in_rotation] == [
        "instance-id=18446744073709551615",
        "http://a:1",
    ]
    assert fleet.workers[0].last_result == "not listed in the frontend's /health instances"
    answers.now["127.0.0.1:8000"] = "timeout"
    await checks.check_once()
    assert [w.label for w in fleet.in_rotation] == ["http://a:1"]
    assert fleet.workers[1].last_result == "frontend: cannot connect: timeout"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{}", None),
        (b"not json", None),
        (b"[]", None),
        (b'{"instances": "x"}', None),
        (b'{"instances": []}', frozenset()),
        (
            b'{"instances": [{"instance_id": 1}, {"instance_id": -1}, {"instance_id": true},'
            b' {"instance_id": 2, "endpoint": "generate"}, 3, {"instance_id": 4,'
            b' "endpoint": "other"}]}',
            frozenset({1, 2}),
        ),
    ],
)
def test_listed_instances(body: bytes, expected: frozenset[int] | None) -> None:
    assert listed_instances(body) == expected


def test_instance_workers_are_dispatched_to_the_frontend_with_the_pin() -> None:
    fleet = fleet_of("instance-id=18446744073709551615", "url=http://a:1/base")
    pinned, own = fleet.workers
    assert pinned.upstream == FRONTEND
    assert pinned.headers == ((INSTANCE_PIN_HEADER, b"18446744073709551615"),)
    assert own.upstream == Upstream("a", 1, "/base") and own.headers == ()


def admit_all(fleet: Fleet) -> None:
    for worker in fleet.workers:
        fleet.set_in_rotation(worker, True)


async def test_round_robin_cycles_the_admitted_and_refuses_when_none_is() -> None:
    fleet = fleet_of("url=http://a:1", "url=http://b:1", "url=http://c:1")
    router = RoundRobinRouter(fleet)
    with pytest.raises(NoWorker, match="none of the 3 workers is in rotation now"):
        await router.book(PLAN)
    admit_all(fleet)
    bookings = [await router.book(PLAN) for _ in range(4)]
    assert [b.worker for b in bookings] == ["http://a:1", "http://b:1", "http://c:1", "http://a:1"]
    assert fleet.active_by_worker() == {"http://a:1": 2, "http://b:1": 1, "http://c:1": 1}
    fleet.set_in_rotation(fleet.workers[1], False)
    assert {(await router.book(PLAN)).worker for _ in range(4)} == {"http://a:1", "http://c:1"}
    for booking in bookings:
        booking.complete(RECORD)
        booking.complete(RECORD)  # a second release is a no-op
    assert fleet.workers[1].active == 0


async def test_least_loaded_picks_the_fewest_and_breaks_ties_in_turn() -> None:
    fleet = fleet_of("url=http://a:1", "url=http://b:1", "url=http://c:1")
    admit_all(fleet)
    router = LeastLoadedRouter(fleet)
    first = [await router.book(PLAN) for _ in range(3)]  # all idle: in turn
    assert [b.worker for b in first] == ["http://a:1", "http://b:1", "http://c:1"]
    first[1].complete(RECORD)
    assert (await router.book(PLAN)).worker == "http://b:1"  # the only one with fewer
    for booking in first:
        booking.complete(RECORD)
    # Now a=0, b=1, c=0, the cursor past b: c, then a, then all at 1: from the cursor, b.
    assert [(await router.book(PLAN)).worker for _ in range(3)] == [
        "http://c:1",
        "http://a:1",
        "http://b:1",
    ]


@given(st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=8), st.integers(0, 20))
def test_least_loaded_is_a_minimum_and_the_first_from_the_cursor(
    loads: list[int], start: int
) -> None:
    workers = [
        Worker(parse_worker_spec(f"url=http://w:{i + 1}"), i, FRONTEND, ())
        for i in range(len(loads))
    ]
    for worker, load in zip(workers, loads, strict=True):
        worker.active = load
    chosen = least_loaded(tuple(workers), start)
    assert loads[chosen] == min(loads)
    order = [(start + step) % len(loads) for step in range(len(loads))]
    assert chosen == next(i for i in order if loads[i] == min(loads))


async def test_the_fleet_gate_waits_for_an_admission() -> None:
    fleet = fleet_of("url=http://a:1")
    assert not await fleet.wait_in_rotation(0.0)
    answers = Answers()
    checks = checker(fleet, answers, EventObserver())
    await checks.check_once()
    assert await fleet.wait_in_rotation(0.0)
    assert fleet.discovery_upstream() == Upstream("a", 1, "")

"""The health gate and the discovery poller, on a fake clock with scripted engine answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from pylon.bringup import EngineNotReady, EngineWatch, HealthGate, ModelDiscovery, health_paths
from pylon.core.upstream import Upstream
from pylon.lifecycle import Lifecycle
from pylon.models import ModelCatalog
from pylon.upstream.probe import Fetched, FetchError
from tests.observers import EventObserver

TARGET = Upstream.from_url("http://127.0.0.1:8000")
Answer = Fetched | FetchError | Callable[[], Fetched]


@dataclass
class FakeEngine:
    """Answers each GET from a script per path (the last answer repeats); a probe takes
    `latency` seconds of fake time (or its whole timeout when the answer is a timeout)."""

    script: dict[str, list[Answer]]
    latency: float = 0.01
    now: float = 100.0
    asked: list[tuple[str, float]] = field(default_factory=list)  # (path, timeout)
    slept: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    async def fetch(self, target: Upstream, path: str, *, timeout: float, max_body: int) -> Fetched:
        assert target is TARGET and max_body > 0
        self.asked.append((path, timeout))
        answers = self.script.get(path, [Fetched(404, b"")])
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, FetchError) and answer.reason == "timeout":
            self.now += timeout
            raise answer
        self.now += self.latency
        if isinstance(answer, FetchError):
            raise answer
        return answer() if callable(answer) else answer


def gate(engine: FakeEngine, observer: EventObserver, **kw: Any) -> HealthGate:
    settings: dict[str, Any] = {"wait": 2.0, "interval": 0.5, "timeout": 1.0, **kw}
    paths = settings.pop("paths", health_paths(()))
    return HealthGate(
        TARGET,
        paths,
        observer=observer,
        fetch=engine.fetch,
        clock=engine.clock,
        sleep=engine.sleep,
        **settings,
    )


OK = Fetched(200, b"{}")
REFUSED = FetchError("connect", "cannot connect: Connection refused")
TIMEOUT = FetchError("timeout", "no complete answer within 1 s")


def test_health_paths_are_the_configured_ones_then_the_defaults() -> None:
    assert health_paths(()) == ("/health", "/v1/health/ready")
    assert health_paths(("/ready", "/health")) == ("/ready", "/health", "/v1/health/ready")


async def test_the_first_path_that_answers_2xx_passes_in_order() -> None:
    engine = FakeEngine({"/health": [Fetched(503, b"")], "/v1/health/ready": [Fetched(204, b"")]})
    observer = EventObserver()
    paths = health_paths(("/custom",))
    assert await gate(engine, observer, paths=paths).run() == "/v1/health/ready"
    assert [path for path, _ in engine.asked] == ["/custom", "/health", "/v1/health/ready"]
    healthy = observer.of("engine_healthy")[0]
    assert healthy["path"] == "/v1/health/ready" and healthy["status"] == 204
    assert healthy["rounds"] == 1
    probes = observer.of("engine_health_probe")
    assert [(p["path"], p["result"]) for p in probes] == [
        ("/custom", "status 404"),
        ("/health", "status 503"),
    ]


async def test_rounds_repeat_at_the_interval_until_a_path_passes() -> None:
    engine = FakeEngine({"/health": [REFUSED, Fetched(500, b""), OK]})
    observer = EventObserver()
    assert await gate(engine, observer).run() == "/health"
    assert [path for path, _ in engine.asked] == [
        "/health",
        "/v1/health/ready",
        "/health",
        "/v1/health/ready",
        "/health",
    ]
    assert engine.slept == [0.5, 0.5]
    assert observer.of("engine_healthy")[0]["rounds"] == 3


async def test_the_wait_running_out_fails_with_the_last_answer_of_each_path() -> None:
    engine = FakeEngine({"/health": [Fetched(503, b"")], "/v1/health/ready": [REFUSED]})
    observer = EventObserver()
    started = engine.now
    with pytest.raises(EngineNotReady) as failed:
        await gate(engine, observer, wait=2.0).run()
    reason = str(failed.value)
    assert "\n" not in reason
    assert "/health: status 503" in reason
    assert "/v1/health/ready: cannot connect: Connection refused" in reason
    assert "the engine at 127.0.0.1:8000 " in reason
    assert "--upstream-health-wait 2 s" in reason
    # Bounded: nothing ran past the wait (plus one probe's latency).
    assert engine.now - started <= 2.0 + engine.latency
    (line,) = observer.of("engine_health_gate_failed")
    assert line["detail"] == reason
    assert line["last"] == {
        "/health": "status 503",
        "/v1/health/ready": "cannot connect: Connection refused",
    }


async def test_each_probe_is_bounded_by_the_wait_left() -> None:
    engine = FakeEngine({"/health": [TIMEOUT], "/v1/health/ready": [TIMEOUT]})
    with pytest.raises(EngineNotReady, match="no complete answer within 1 s"):
        await gate(engine, EventObserver(), wait=1.5, timeout=1.0).run()
    timeouts = [timeout for _, timeout in engine.asked]
    assert timeouts[0] == 1.0 and timeouts[1] == pytest.approx(0.5)
    assert len(timeouts) == 2  # the wait was spent: no second round


async def test_a_probe_cut_short_by_the_wait_keeps_the_paths_earlier_answer() -> None:
    # Round 1 asks both paths (refused, fast); round 2's /health gets only the wait that is
    # left and times out on it: pylon's own deadline, not the engine's answer.
    engine = FakeEngine({"/health": [REFUSED, TIMEOUT], "/v1/health/ready": [REFUSED]}, latency=0.2)
    with pytest.raises(EngineNotReady) as failed:
        await gate(engine, EventObserver(), wait=1.0, interval=0.5, timeout=1.0).run()
    timeouts = [timeout for _, timeout in engine.asked]
    assert timeouts[-1] < 1.0  # the last probe was cut to the wait left
    assert "/health: cannot connect: Connection refused" in str(failed.value)
    assert "no complete answer" not in str(failed.value)


async def test_a_wait_of_zero_is_one_round() -> None:
    engine = FakeEngine({"/health": [TIMEOUT], "/v1/health/ready": [REFUSED]})
    with pytest.raises(EngineNotReady, match=r"\(1 round of probes"):
        await gate(engine, EventObserver(), wait=0.0, timeout=1.0).run()
    assert engine.asked == [("/health", 1.0), ("/v1/health/ready", 1.0)]
    assert engine.slept == []


def models(*ids: str) -> Fetched:
    return Fetched(200, orjson.dumps({"object": "list", "data": [{"id": i} for i in ids]}))


def discovery(engine: FakeEngine, observer: EventObserver) -> tuple[ModelDiscovery, ModelCatalog]:
    catalog = ModelCatalog()
    poller = ModelDiscovery(
        catalog,
        TARGET,
        interval=5.0,
        timeout=2.0,
        observer=observer,
        fetch=engine.fetch,
        clock=engine.clock,
        sleep=engine.sleep,
    )
    return poller, catalog


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (REFUSED, "connect"),
        (TIMEOUT, "timeout"),
        (FetchError("too_large", "response body over 1048576 bytes"), "too_large"),
        (Fetched(500, b""), "status"),
        (Fetched(200, b"{not json"), "invalid"),
        (Fetched(200, b'{"data": [{"id": ""}]}'), "invalid"),
    ],
)
async def test_a_failed_poll_keeps_the_last_good_set(answer: Answer, reason: str) -> None:
    engine = FakeEngine({"/v1/models": [models("a", "b"), answer, models("b")]})
    observer = EventObserver()
    poller, catalog = discovery(engine, observer)
    assert await poller.poll()
    assert not await poller.poll()
    assert catalog.published == {"a", "b"}
    failed = observer.of("model_discovery_poll")[1]
    assert failed["outcome"] == "failed" and failed["reason"] == reason and failed["models"] == 2
    assert failed["detail"]
    assert await poller.poll()
    assert catalog.published == {"b"}


async def test_a_bug_in_a_poll_is_reported_and_discovery_goes_on() -> None:
    def broken() -> Fetched:
        raise RuntimeError("boom")

    engine = FakeEngine({"/v1/models": [broken, models("a")]})
    observer = EventObserver()
    poller, catalog = discovery(engine, observer)
    assert not await poller.poll()
    failed = observer.of("model_discovery_poll")[0]
    # This bug and no other: the fake engine's own checks fail as AssertionErrors, which the
    # poll would report the same way.
    assert (failed["reason"], failed["detail"]) == ("error", "RuntimeError: boom")
    assert await poller.poll() and catalog.published == {"a"}


async def test_polls_report_changes_then_the_poll() -> None:
    engine = FakeEngine({"/v1/models": [models("a"), models("a", "b"), models(), models("a")]})
    observer = EventObserver()
    poller, catalog = discovery(engine, observer)
    for _ in range(4):
        await poller.poll()
    changes = [
        (kind, fields["model"], fields["generation"])
        for kind, fields in observer.events
        if kind in ("model_published", "model_retired")
    ]
    assert changes == [
        ("model_published", "a", 1),
        ("model_published", "b", 1),
        ("model_retired", "a", 1),
        ("model_retired", "b", 1),
        ("model_published", "a", 2),
    ]
    assert all(f["source"] == "discovery" for k, f in observer.events if k.startswith("model_p"))
    polls = observer.of("model_discovery_poll")
    assert [p["models"] for p in polls] == [1, 2, 0, 1]
    assert all(p["outcome"] == "ok" and p["reason"] is None for p in polls)
    assert observer.kinds()[-1] == "model_discovery_poll"
    assert catalog.generation("a") == 2


async def test_run_sleeps_the_interval_between_polls() -> None:
    engine = FakeEngine({"/v1/models": [models("a")]})
    observer = EventObserver()
    poller, _ = discovery(engine, observer)

    async def stop_after_three(seconds: float) -> None:
        await engine.sleep(seconds)
        if len(engine.slept) > 3:
            raise StopAsyncIteration

    poller._sleep = stop_after_three
    with pytest.raises(StopAsyncIteration):
        await poller.run()
    assert engine.slept == [5.0] * 4
    assert len(observer.of("model_discovery_poll")) == 3


async def test_a_long_wait_is_reported_every_ten_seconds_with_the_last_answers() -> None:
    """A dead engine at start: an `engine_waiting` line (a warning, so it shows at the default
    level) every 10 s of the wait with the time waited and each path's last answer, not one
    per probe round (120 rounds here)."""
    engine = FakeEngine({"/health": [REFUSED], "/v1/health/ready": [REFUSED]})
    observer = EventObserver()
    with pytest.raises(EngineNotReady):
        await gate(engine, observer, wait=60.0).run()
    waiting = observer.of("engine_waiting")
    assert len(waiting) == 5  # at 10, 20, 30, 40, 50 s; the failure line says the rest
    assert [round(line["waited_s"] / 10) for line in waiting] == [1, 2, 3, 4, 5]
    assert all(10 * n <= line["waited_s"] < 10 * n + 1 for n, line in enumerate(waiting, 1))
    assert waiting[0]["wait_s"] == 60.0 and waiting[0]["rounds"] > 10
    assert waiting[0]["last"] == (
        "/health: cannot connect: Connection refused; "
        "/v1/health/ready: cannot connect: Connection refused"
    )
    assert len(observer.of("engine_health_probe")) > 100  # those are debug lines


async def test_the_engine_watch_sets_and_clears_the_engine_fault() -> None:
    engine = FakeEngine({"/health": [OK, REFUSED, REFUSED, REFUSED, OK]})
    observer = EventObserver()
    lifecycle = Lifecycle()
    lifecycle.mark_ready()
    lifecycle.models.apply(["m"])
    changes: list[tuple[bool, str, str | None]] = []
    lifecycle.on_readiness(lambda *change: changes.append(change))
    watch = EngineWatch(
        TARGET,
        "/health",
        lifecycle,
        interval=1.0,
        timeout=1.0,
        observer=observer,
        fetch=engine.fetch,
        sleep=engine.sleep,
    )
    await watch.check_once()  # ok
    await watch.check_once()  # one failure: not yet
    assert lifecycle.readiness() == (True, "ready") and changes == []
    await watch.check_once()  # two in a row: not ready
    assert lifecycle.readiness() == (False, "engine_unhealthy")
    detail = lifecycle.readiness_detail()
    assert detail is not None and "failed 2 health checks" in detail and "refused" in detail
    await watch.check_once()  # still down: told once
    await watch.check_once()  # back
    assert lifecycle.readiness() == (True, "ready") and lifecycle.readiness_detail() is None
    assert changes == [(False, "engine_unhealthy", detail), (True, "ready", None)]

"""The active canary's state machine, on a fake clock and a scripted engine: pass, fail, recovery
probing, runaway generations, timeouts, retirement, rounds with no worker in rotation; the pure
judge of an answer; `/ready`'s canary input in `Lifecycle`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.core.priority import PriorityWrite
from pylon.core.upstream import Upstream
from pylon.gateway.board import GatewayBoard, ModelHealth
from pylon.gateway.canary import (
    Canaries,
    CanaryOptions,
    CanaryTarget,
    fleet_target,
    judge,
    single_target,
)
from pylon.lifecycle import Lifecycle, Phase
from pylon.routing.fleet import Fleet
from pylon.upstream.probe import Fetched, FetchError
from tests.observers import EventObserver

ENGINE = Upstream.from_url("http://127.0.0.1:8000")
OPTIONS = CanaryOptions(interval=5.0, timeout=2.0, max_tokens=237, recovery_interval=1.0)
Answer = Fetched | FetchError


def completion(tokens: int | None) -> Fetched:
    body: dict[str, Any] = {"choices": [{"message": {"content": "2"}}]}
    if tokens is not None:
        body["usage"] = {"prompt_tokens": 4, "completion_tokens": tokens}
    return Fetched(200, orjson.dumps(body))


OK = completion(1)
TIMEOUT = FetchError("timeout", "no complete answer within 2 s")


@dataclass
class FakeEngine:
    """Answers each canary from a script (the last answer repeats); every sleep waits for the
    test to `wake` it, so each round is stepped by hand on a fake clock."""

    script: list[Answer]
    latency: float = 0.25
    now: float = 1000.0
    posts: list[dict[str, Any]] = field(default_factory=list)
    sleeps: asyncio.Queue[tuple[float, asyncio.Future[None]]] = field(default_factory=asyncio.Queue)
    _pending: tuple[float, asyncio.Future[None]] | None = None

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        done = asyncio.get_running_loop().create_future()
        await self.sleeps.put((seconds, done))
        await done

    async def post(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        *,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        timeout: float,
        max_body: int,
    ) -> Fetched:
        self.posts.append(
            {
                "upstream": upstream,
                "path": path,
                "body": orjson.loads(body),
                "headers": headers,
                "timeout": timeout,
            }
        )
        answer = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(answer, FetchError):
            self.now += timeout if answer.reason == "timeout" else self.latency
            raise answer
        self.now += self.latency
        return answer

    async def next_sleep(self) -> float:
        """The round ran and its task sleeps now: for how long (the sleep is held)."""
        async with asyncio.timeout(5):
            seconds, done = await self.sleeps.get()
        self._pending = (seconds, done)
        return seconds

    def wake(self) -> None:
        assert self._pending is not None
        seconds, done = self._pending
        self._pending = None
        self.now += seconds
        done.set_result(None)


@dataclass
class Rig:
    engine: FakeEngine
    board: GatewayBoard
    observer: EventObserver
    canaries: Canaries
    faults: list[tuple[str, str] | None]


def rig(script: list[Answer], options: CanaryOptions = OPTIONS, **kw: Any) -> Rig:
    engine = FakeEngine(script)
    board = GatewayBoard(reverse=False)
    observer = EventObserver()
    faults: list[tuple[str, str] | None] = []
    kw.setdefault("target", single_target(ENGINE))
    canaries = Canaries(
        options,
        board,
        observer=observer,
        on_fault=faults.append,
        post=engine.post,
        clock=engine.clock,
        sleep=engine.sleep,
        **kw,
    )
    return Rig(engine, board, observer, canaries, faults)


async def test_fail_then_recovery_probes_until_one_passes() -> None:
    r = rig([OK, Fetched(500, b'{"error": {}}'), Fetched(503, b""), OK])
    r.canaries.sync(["m"])
    try:
        assert await r.engine.next_sleep() == 5.0  # passed: the next canary in `interval`
        assert r.board.model_health("m") == ModelHealth(True)
        assert r.observer.kinds() == ["canary_passed"]
        (post,) = r.engine.posts
        assert post["path"] == "/v1/chat/completions" and post["timeout"] == 2.0
        assert post["body"] == {
            "model": "m",
            "messages": [{"role": "user", "content": "1+1="}],
            "max_tokens": 237,
            "seed": 33,
            "temperature": 0.7,
            "stream": False,
        }
        ((name, value),) = post["headers"]
        assert name == b"x-request-id" and value.startswith(b"canary-")

        r.engine.wake()
        assert await r.engine.next_sleep() == 1.0  # failed: recovery probing every second
        assert r.board.model_health("m") == ModelHealth(False, "status 500")
        failed = r.observer.of("canary_failed")
        assert failed == [
            {
                "model": "m",
                "reason": "status",
                "detail": "status 500",
                "duration_ms": 250.0,
                "upstream": ENGINE.label,
            }
        ]
        assert r.faults == [("canary_failed", "the canary of 1 model(s) fails: m (status 500)")]
        assert r.canaries.failing() == {"m": "status 500"}

        r.engine.wake()
        assert await r.engine.next_sleep() == 1.0  # still failing: one debug line, no news
        assert len(r.observer.of("canary_failed")) == 1
        (still,) = r.observer.of("canary_still_failing")
        assert still["detail"] == "status 503" and still["failed_s"] == 1.5
        assert r.board.model_health("m") == ModelHealth(False, "status 503")
        assert r.faults[-1] == ("canary_failed", "the canary of 1 model(s) fails: m (status 503)")

        r.engine.wake()
        assert await r.engine.next_sleep() == 5.0  # passed again: back to `interval`
        assert r.board.model_health("m") == ModelHealth(True)
        (recovered,) = r.observer.of("canary_recovered")
        assert recovered == {"model": "m", "failed_s": 2.75, "attempts": 2}
        assert r.faults[-1] is None
        assert r.canaries.failing() == {}
        ids = [dict(p["headers"])[b"x-request-id"] for p in r.engine.posts]
        assert len(set(ids)) == 4  # one id per canary
    finally:
        await r.canaries.aclose()


async def test_a_runaway_generation_fails_the_canary() -> None:
    r = rig([completion(237), completion(236)])
    r.canaries.sync(["m"])
    try:
        assert await r.engine.next_sleep() == 1.0
        assert r.board.model_health("m") == ModelHealth(False, "runaway")
        (failed,) = r.observer.of("canary_failed")
        assert failed["reason"] == "runaway" and "237 completion tokens" in failed["detail"]
        r.engine.wake()
        assert await r.engine.next_sleep() == 5.0  # 236 tokens: an answer, not a runaway
        assert r.board.model_health("m").healthy
    finally:
        await r.canaries.aclose()


async def test_a_timeout_fails_the_canary_after_its_timeout() -> None:
    r = rig([TIMEOUT])
    r.canaries.sync(["m"])
    try:
        assert await r.engine.next_sleep() == 1.0
        assert r.board.model_health("m") == ModelHealth(False, "timeout")
        (failed,) = r.observer.of("canary_failed")
        assert (failed["reason"], failed["duration_ms"]) == ("timeout", 2000.0)
    finally:
        await r.canaries.aclose()


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (FetchError("connect", "cannot connect: Connection refused"), "connect"),
        (FetchError("closed", "the engine closed the connection"), "closed"),
        (Fetched(200, b"{not json"), "invalid"),
        (Fetched(200, b'{"object": "list"}'), "invalid"),
        (Fetched(200, b'{"choices": [], "usage": {"completion_tokens": "many"}}'), "invalid"),
        (Fetched(404, b""), "status 404"),
    ],
)
async def test_each_failure_is_a_failed_canary(answer: Answer, reason: str) -> None:
    r = rig([answer])
    r.canaries.sync(["m"])
    try:
        assert await r.engine.next_sleep() == 1.0
        assert r.board.model_health("m") == ModelHealth(False, reason)
    finally:
        await r.canaries.aclose()


async def test_retiring_a_model_stops_its_canary_and_forgets_its_health() -> None:
    r = rig([Fetched(500, b"")])
    r.canaries.sync(["m", "n"])
    try:
        await r.engine.next_sleep()
        await r.engine.next_sleep()
        assert set(r.board.unhealthy_models()) == {"m", "n"}
        assert r.faults[-1] == (
            "canary_failed",
            "the canary of 2 model(s) fails: m (status 500), n (status 500)",
        )
        tasks = {t.get_name(): t for t in asyncio.all_tasks() if t.get_name().startswith("canary")}
        r.canaries.sync(["n"])
        await asyncio.sleep(0)
        assert tasks["canary m"].cancelled() or tasks["canary m"].done()
        assert r.canaries.models == ("n",)
        assert set(r.board.unhealthy_models()) == {"n"}  # m forgotten, not left INACTIVE
        assert r.faults[-1] == ("canary_failed", "the canary of 1 model(s) fails: n (status 500)")
        r.canaries.sync([])
        assert r.board.unhealthy_models() == {} and r.faults[-1] is None
        # Published again: a new canary, healthy until it says otherwise.
        r.engine.script[:] = [OK]
        r.canaries.sync(["m"])
        assert await r.engine.next_sleep() == 5.0
        assert r.board.model_health("m").healthy
    finally:
        await r.canaries.aclose()


async def test_no_worker_in_rotation_skips_the_round_and_keeps_health() -> None:
    chosen: list[CanaryTarget | None] = [CanaryTarget(ENGINE), None, None, CanaryTarget(ENGINE)]
    r = rig([Fetched(500, b""), OK], target=lambda: chosen.pop(0))
    r.canaries.sync(["m"])
    try:
        assert await r.engine.next_sleep() == 1.0
        r.engine.wake()
        assert await r.engine.next_sleep() == 1.0  # skipped: still failing, still probing
        assert len(r.engine.posts) == 1
        assert r.board.model_health("m") == ModelHealth(False, "status 500")
        r.engine.wake()
        await r.engine.next_sleep()
        r.engine.wake()
        assert await r.engine.next_sleep() == 5.0
        assert len(r.engine.posts) == 2 and r.board.model_health("m").healthy
    finally:
        await r.canaries.aclose()


async def test_fleet_target_rotates_across_the_workers_in_rotation() -> None:
    a = SimpleNamespace(upstream=Upstream.from_url("http://127.0.0.1:1"), headers=())
    b = SimpleNamespace(upstream=Upstream.from_url("http://127.0.0.1:2"), headers=((b"x-p", b"7"),))
    fleet = SimpleNamespace(in_rotation=(a, b))
    pick = fleet_target(cast(Fleet, fleet))
    assert [pick() for _ in range(3)] == [
        CanaryTarget(a.upstream),
        CanaryTarget(b.upstream, ((b"x-p", b"7"),)),
        CanaryTarget(a.upstream),
    ]
    fleet.in_rotation = ()
    assert pick() is None


async def test_priority_and_worker_headers_go_with_the_canary() -> None:
    pin = ((b"x-dynamo-worker-instance-id", b"12"),)
    r = rig(
        [OK],
        target=lambda: CanaryTarget(ENGINE, pin),
        priority=PriorityWrite(headers=((b"x-dynamo-request-priority", b"3600"),), value=3600),
    )
    r.canaries.sync(["m"])
    try:
        await r.engine.next_sleep()
        (post,) = r.engine.posts
        names = [name for name, _ in post["headers"]]
        assert names == [b"x-request-id", b"x-dynamo-request-priority", pin[0][0]]
        assert "priority" not in post["body"]
    finally:
        await r.canaries.aclose()
    r = rig([OK], priority=PriorityWrite(body_priority=0, value=0))
    r.canaries.sync(["m"])
    try:
        await r.engine.next_sleep()
        assert r.engine.posts[0]["body"]["priority"] == 0
    finally:
        await r.canaries.aclose()


async def test_interval_zero_runs_no_canary() -> None:
    r = rig([OK], options=CanaryOptions(interval=0))
    r.canaries.sync(["m"])
    assert r.canaries.models == ()
    await asyncio.sleep(0)
    assert r.engine.posts == [] and r.engine.sleeps.empty()


def test_options_are_checked() -> None:
    for bad in (
        {"interval": -1.0},
        {"timeout": 0.0},
        {"max_tokens": 1},
        {"recovery_interval": 0.0},
    ):
        with pytest.raises(ValueError):
            CanaryOptions(**bad)


@given(st.integers(min_value=100, max_value=599), st.binary(max_size=200))
def test_judge_never_raises_and_names_a_known_reason(status: int, body: bytes) -> None:
    reason, detail, tokens = judge(status, body, 237)
    assert reason in (None, "status", "invalid", "runaway") and detail
    if not 200 <= status < 300:
        assert reason == "status" and tokens is None


@given(st.integers(min_value=0, max_value=10_000))
def test_judge_reads_completion_tokens(tokens: int) -> None:
    reason, _, counted = judge(200, completion(tokens).body, 237)
    assert counted == tokens
    assert reason == ("runaway" if tokens >= 237 else None)


def test_judge_passes_an_answer_without_usage() -> None:
    assert judge(200, completion(None).body, 237)[0] is None


def test_readiness_follows_the_canary_after_an_engine_fault() -> None:
    lifecycle = Lifecycle(Phase.READY)
    lifecycle.models.apply(["m"])
    changes: list[tuple[bool, str, str | None]] = []
    lifecycle.on_readiness(lambda *change: changes.append(change))
    assert lifecycle.readiness() == (True, "ready")
    lifecycle.set_canary(("canary_failed", "the canary of 1 model(s) fails: m (timeout)"))
    assert lifecycle.readiness() == (False, "canary_failed")
    assert lifecycle.readiness_detail() == "the canary of 1 model(s) fails: m (timeout)"
    lifecycle.set_engine(("engine_unhealthy", "status 503"))
    assert lifecycle.readiness() == (False, "engine_unhealthy")  # the engine's fault first
    assert lifecycle.readiness_detail() == "status 503"
    lifecycle.set_engine(None)
    lifecycle.set_canary(None)
    assert lifecycle.readiness() == (True, "ready")
    assert [c[1] for c in changes] == [
        "canary_failed",
        "engine_unhealthy",
        "canary_failed",
        "ready",
    ]

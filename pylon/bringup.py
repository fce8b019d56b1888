"""Engine bring-up: the health gate, then the model set (static, or discovered and kept fresh).

Runs after the listeners are up (`pylon.run.start`); until it passes, `Lifecycle` is `STARTING`
and tunnel requests get `503 not_ready` (retryable).

1. **Health gate** (`HealthGate`, unless `--no-upstream-health-gate`): rounds of `GET` probes of
   the `--upstream-health-path` entries, then `/health`, then `/v1/health/ready`, in that order;
   the first 2xx passes. Each probe is bounded by `--upstream-health-timeout` (and by what is
   left of the wait), rounds are `--upstream-health-interval` apart, and when
   `--upstream-health-wait` runs out the gate fails with `EngineNotReady`, whose message is the
   one line saying what each path answered last (pylon then exits with status 1).
2. **Models**: `--model` publishes a static set; without it, `ModelDiscovery` polls
   `GET /v1/models` once now and then every `--model-discovery-interval` seconds
   (`pylon.models` holds the pure rules: last good set kept on a failed poll, empty list retires
   everything, a generation per appearance).
3. `Lifecycle.mark_ready()`.
4. Afterwards (`--routing off`, with the gate), `EngineWatch` keeps checking the path that
   passed, every `--upstream-health-check-interval` seconds: `ENGINE_UNHEALTHY_AFTER` failures
   in a row set the lifecycle's engine fault (`/ready` 503 `engine_unhealthy`), the next 2xx
   clears it. With a fleet, `pylon.run` feeds the fleet's in-rotation view to the lifecycle.

With `--routing` other than off (a `Fleet` of workers), the gate is the workers' own active
health checks (`pylon.routing.health`, already running): it passes as soon as one worker is
in_rotation, and fails like the single-engine gate when none is within `--upstream-health-wait`
(the line then says what each worker answered last). The other workers join as their checks
pass. Discovery asks the first worker in rotation (the replicas serve the same models).

Everything is reported to the `Observer` as process events:

- `engine_health_probe` (debug): one failed probe: `path`, `result`, `round`;
- `engine_healthy`: the gate passed: `path`, `status`, `rounds`, `waited_s`;
- `engine_waiting` (warning): the gate still waits, every `WAIT_REPORT_INTERVAL` seconds:
  `upstream`, `waited_s`, `wait_s`, `rounds`, `last` (each path's, or worker's, last answer);
- `engine_health_gate_failed` (error): the gate ran out: `detail` (the one line), `waited_s`,
  `rounds`, `last` ({path: last result});
- `model_discovery_poll` (ok: debug, failed: warning): `outcome` (`ok` or `failed`), `reason`
  on failure (`connect`, `timeout`, `closed`, `protocol`, `too_large`, `status`, `invalid`,
  `error`), `detail`, `models` (how many are published after it), `duration_ms`;
- `model_published` / `model_retired`: `model`, `generation`, `source` (`static` or
  `discovery`).

The clock, the sleep and the fetch are injected, so the loops are tested without waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pylon.lifecycle import NOT_READY_ENGINE_UNHEALTHY
from pylon.models import CatalogChange, ModelCatalog, ModelListError, parse_model_list
from pylon.upstream.probe import Fetch, FetchError, fetch

if TYPE_CHECKING:
    from pylon.core.upstream import Upstream
    from pylon.lifecycle import Lifecycle
    from pylon.observe import Observer
    from pylon.routing.health import HealthChecker

DEFAULT_HEALTH_PATHS = ("/health", "/v1/health/ready")
WAIT_REPORT_INTERVAL = 10.0  # seconds between `engine_waiting` lines while the gate waits
ENGINE_UNHEALTHY_AFTER = 2  # failed checks in a row after start-up that make pylon not ready
MODELS_PATH = "/v1/models"
MAX_HEALTH_BODY = 64 * 1024  # a health answer's body is read (to end the exchange), not kept
MAX_MODEL_LIST_BYTES = 1024 * 1024

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class BringUpOptions:
    """How bring-up gates on the engine and finds its models."""

    health_gate: bool
    """Wait for the engine's health before taking requests (`--upstream-health-gate`)."""
    health_paths: tuple[str, ...]
    """Paths the gate probes first, before `/health` and `/v1/health/ready`
    (`--upstream-health-path`)."""
    health_wait: float
    """Seconds the gate waits for a 2xx before `EngineNotReady` (`--upstream-health-wait`)."""
    health_interval: float
    """Seconds between rounds of probes (`--upstream-health-interval`)."""
    health_timeout: float
    """Seconds one probe may take (`--upstream-health-timeout`)."""
    health_check_interval: float
    """Seconds between the engine's health checks after start-up, which readiness follows
    (`--upstream-health-check-interval`; `--routing off` only)."""
    models: tuple[str, ...]
    """The static model set (`--model`); empty: discover it from `/v1/models`."""
    discovery_interval: float
    """Seconds between `/v1/models` polls (`--model-discovery-interval`)."""
    discovery_timeout: float
    """Seconds one `/v1/models` poll may take (`--model-discovery-timeout`)."""


class EngineNotReady(Exception):
    """The engine never passed its health gate; the message is the one line that says why."""


def health_paths(configured: Iterable[str]) -> tuple[str, ...]:
    """The probe order: the configured paths, then `/health`, then `/v1/health/ready`."""
    return tuple(dict.fromkeys((*configured, *DEFAULT_HEALTH_PATHS)))


class HealthGate:
    """Probe the engine's health paths until one answers 2xx, or the wait runs out."""

    def __init__(
        self,
        upstream: Upstream,
        paths: tuple[str, ...],
        *,
        wait: float,
        interval: float,
        timeout: float,
        observer: Observer,
        fetch: Fetch = fetch,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        assert paths, "at least one health path"
        self._target = upstream
        self._paths = paths
        self._wait = wait
        self._interval = interval
        self._timeout = timeout
        self._observer = observer
        self._fetch = fetch
        self._clock = clock
        self._sleep = sleep

    async def run(self) -> str:
        """The path that answered 2xx. Raises `EngineNotReady` when the wait ran out; a wait
        of 0 is one round (each path probed once)."""
        clock = self._clock or asyncio.get_running_loop().time
        started = clock()
        deadline = started + self._wait
        last: dict[str, str] = {}
        rounds = 0
        report_at = started + WAIT_REPORT_INTERVAL  # an `engine_waiting` line at most this often
        while True:
            rounds += 1
            for path in self._paths:
                left = deadline - clock()
                if rounds > 1 and left <= 0:
                    break
                # The first round always probes every path (with the full probe timeout once
                # the wait is spent), so `--upstream-health-wait 0` still asks each path once.
                budget = self._timeout if left <= 0 else min(self._timeout, left)
                try:
                    reply = await self._fetch(
                        self._target, path, timeout=budget, max_body=MAX_HEALTH_BODY
                    )
                except FetchError as exc:
                    if exc.reason == "timeout" and budget < self._timeout and path in last:
                        # Cut short by the end of the wait, not by the engine: the path's
                        # earlier answer says more about why it is not healthy.
                        break
                    result = exc.detail
                else:
                    if 200 <= reply.status < 300:
                        self._observer.process_event(
                            "engine_healthy",
                            upstream=self._target.label,
                            path=path,
                            status=reply.status,
                            rounds=rounds,
                            waited_s=round(clock() - started, 3),
                        )
                        return path
                    result = f"status {reply.status}"
                last[path] = result
                self._observer.process_event(
                    "engine_health_probe", path=path, result=result, round=rounds
                )
            left = deadline - clock()
            if left <= 0:
                break
            if clock() >= report_at:
                report_at += WAIT_REPORT_INTERVAL
                self._observer.process_event(
                    "engine_waiting",
                    upstream=self._target.label,
                    waited_s=round(clock() - started, 3),
                    wait_s=self._wait,
                    rounds=rounds,
                    last=_answers(last),
                )
            await self._sleep(min(self._interval, left))
        waited = round(clock() - started, 3)
        answers = _answers(last)
        detail = (
            f"the engine at {self._target.label} answered none of its health paths with 2xx "
            f"within --upstream-health-wait {self._wait:g} s ({rounds} "
            f"round{'s' if rounds != 1 else ''} of probes; last answers: {answers})"
        )
        self._observer.process_event(
            "engine_health_gate_failed", detail=detail, waited_s=waited, rounds=rounds, last=last
        )
        raise EngineNotReady(detail)


def _answers(last: dict[str, str]) -> str:
    return "; ".join(f"{path}: {result}" for path, result in last.items())


class EngineWatch:
    """After start-up (`--routing off`, with the health gate): the engine's health, so that
    readiness follows it. Every `interval` seconds one `GET` of the path that passed the gate,
    within `timeout`; `fail_after` failures in a row set the engine fault (`/ready` 503
    `engine_unhealthy`, with the last answer), the next 2xx clears it."""

    def __init__(
        self,
        upstream: Upstream,
        path: str,
        lifecycle: Lifecycle,
        *,
        interval: float,
        timeout: float,
        observer: Observer,
        fail_after: int = ENGINE_UNHEALTHY_AFTER,
        fetch: Fetch = fetch,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._target = upstream
        self._path = path
        self._lifecycle = lifecycle
        self._interval = interval
        self._timeout = timeout
        self._observer = observer
        self._fail_after = fail_after
        self._fetch = fetch
        self._sleep = sleep
        self.failures = 0  # failed checks in a row
        self.unhealthy = False

    async def run(self) -> None:
        """A check every `interval` seconds (the gate just passed: the first waits), until
        cancelled."""
        while True:
            await self._sleep(self._interval)
            await self.check_once()

    async def check_once(self) -> None:
        try:
            reply = await self._fetch(
                self._target, self._path, timeout=self._timeout, max_body=MAX_HEALTH_BODY
            )
        except FetchError as exc:
            self.apply(False, exc.detail)
            return
        ok = 200 <= reply.status < 300
        self.apply(ok, "ok" if ok else f"status {reply.status}")

    def apply(self, ok: bool, result: str) -> None:
        """One check's result: count it, and set or clear the engine fault when due."""
        if ok:
            self.failures = 0
            if self.unhealthy:
                self.unhealthy = False
                self._lifecycle.set_engine(None)
            return
        self.failures += 1
        self._observer.process_event(
            "engine_health_probe", path=self._path, result=result, round=self.failures
        )
        if self.failures >= self._fail_after:
            detail = (
                f"the engine at {self._target.label} failed {self.failures} health checks in "
                f"a row (GET {self._path}); last: {result}"
            )
            self.unhealthy = True
            self._lifecycle.set_engine((NOT_READY_ENGINE_UNHEALTHY, detail))


class ModelDiscovery:
    """Poll the engine's `/v1/models` into the catalog: once (`poll`), or forever (`run`).

    `upstream`: the engine, or a function naming the engine to ask now (None: none can be asked,
    and the poll fails)."""

    def __init__(
        self,
        catalog: ModelCatalog,
        upstream: Upstream | Callable[[], Upstream | None],
        *,
        interval: float,
        timeout: float,
        observer: Observer,
        fetch: Fetch = fetch,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._catalog = catalog
        self._target = upstream
        self._interval = interval
        self._timeout = timeout
        self._observer = observer
        self._fetch = fetch
        self._clock = clock
        self._sleep = sleep

    async def run(self) -> None:
        """Poll every `interval` seconds (after the poll `bring_up` made), until cancelled."""
        while True:
            await self._sleep(self._interval)
            await self.poll()

    async def poll(self) -> bool:
        """One poll; True when it succeeded (and its list is now published). A failed poll
        changes nothing: the last good set stays."""
        clock = self._clock or asyncio.get_running_loop().time
        started = clock()
        upstream = self._target() if callable(self._target) else self._target
        if upstream is None:
            return self._failed("no_worker", "no engine worker is in rotation to ask", started)
        try:
            reply = await self._fetch(
                upstream, MODELS_PATH, timeout=self._timeout, max_body=MAX_MODEL_LIST_BYTES
            )
            if not 200 <= reply.status < 300:
                return self._failed("status", f"{MODELS_PATH} answered {reply.status}", started)
            names = parse_model_list(reply.body)
        except FetchError as exc:
            return self._failed(exc.reason, exc.detail, started)
        except ModelListError as exc:
            return self._failed("invalid", str(exc), started)
        except Exception as exc:  # a bug: reported, never the end of discovery
            return self._failed("error", f"{exc.__class__.__name__}: {exc}", started)
        report_change(self._observer, self._catalog.apply(names), "discovery")
        self._report("ok", None, None, started)
        return True

    def _failed(self, reason: str, detail: str, started: float) -> bool:
        self._report("failed", reason, detail, started)
        return False

    def _report(self, outcome: str, reason: str | None, detail: str | None, started: float) -> None:
        self._observer.process_event(
            "model_discovery_poll",
            outcome=outcome,
            reason=reason,
            detail=detail,
            models=len(self._catalog.published),
            duration_ms=self._elapsed_ms(started),
        )

    def _elapsed_ms(self, started: float) -> float:
        clock = self._clock or asyncio.get_running_loop().time
        return round((clock() - started) * 1000, 3)


def report_change(observer: Observer, change: CatalogChange, source: str) -> None:
    for name, generation in change.retired:
        observer.process_event("model_retired", model=name, generation=generation, source=source)
    for name, generation in change.published:
        observer.process_event("model_published", model=name, generation=generation, source=source)


@dataclass(frozen=True, slots=True)
class BringUp:
    """What bring-up found: the health path that answered (None with the gate off), and the
    discovery loop to keep running (None with a static `--model` set)."""

    health_path: str | None
    discovery: ModelDiscovery | None


async def bring_up(
    options: BringUpOptions,
    upstream: Upstream | None,
    lifecycle: Lifecycle,
    observer: Observer,
    *,
    fetch: Fetch = fetch,
    workers: HealthChecker | None = None,
    prepare: Callable[[], Awaitable[None]] | None = None,
) -> BringUp:
    """The health gate, then the first model set, then `prepare` (work that needs the engine
    and its models before requests come, e.g. the `--kv-token-data` proof; it may raise), then
    `READY`. Raises `EngineNotReady`.

    `upstream`: the one engine (`--routing off`); `workers`: the health checks of the workers
    instead (see above; already running)."""
    health_path = None
    fleet = workers.fleet if workers is not None else None
    if options.health_gate:
        if workers is not None:
            health_path = await _fleet_gate(options.health_wait, workers, observer)
        else:
            health_path = await _engine_gate(options, _known(upstream), observer, fetch)
    discovery = None
    if options.models:
        report_change(observer, lifecycle.models.apply(options.models), "static")
    else:
        discovery = ModelDiscovery(
            lifecycle.models,
            fleet.discovery_upstream if fleet is not None else _known(upstream),
            interval=options.discovery_interval,
            timeout=options.discovery_timeout,
            observer=observer,
            fetch=fetch,
        )
        await discovery.poll()
    if prepare is not None:
        await prepare()
    lifecycle.mark_ready()
    return BringUp(health_path, discovery)


async def _engine_gate(
    options: BringUpOptions, upstream: Upstream, observer: Observer, fetch: Fetch
) -> str:
    gate = HealthGate(
        upstream,
        health_paths(options.health_paths),
        wait=options.health_wait,
        interval=options.health_interval,
        timeout=options.health_timeout,
        observer=observer,
        fetch=fetch,
    )
    return await gate.run()


def _known(upstream: Upstream | None) -> Upstream:
    assert upstream is not None, "an engine upstream or a fleet"
    return upstream


async def _fleet_gate(wait: float, workers: HealthChecker, observer: Observer) -> str:
    """Wait for the first worker in rotation; `EngineNotReady` after `wait` seconds
    (`--upstream-health-wait`; the first round of checks is always waited for, so a wait of 0
    is one round)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    path = workers.path
    fleet = workers.fleet
    await workers.first_round()  # bounded by --worker-health-timeout
    if fleet.in_rotation or await _wait_in_rotation(workers, started, wait, observer):
        in_rotation = fleet.in_rotation
        observer.process_event(
            "engine_healthy",
            upstream=in_rotation[0].label,
            path=path,
            workers_in_rotation=len(in_rotation),
            workers=len(fleet.workers),
            waited_s=round(loop.time() - started, 3),
        )
        return path
    count = len(fleet.workers)
    detail = (
        f"none of the {count} engine worker{'s' if count != 1 else ''} passed its health check "
        f"(GET {path}) within --upstream-health-wait {wait:g} s (last answers: "
        f"{fleet.describe_health()})"
    )
    last = {worker.label: worker.last_result for worker in fleet.workers}
    observer.process_event(
        "engine_health_gate_failed",
        detail=detail,
        waited_s=round(loop.time() - started, 3),
        rounds=workers.rounds,
        last=last,
    )
    raise EngineNotReady(detail)


async def _wait_in_rotation(
    workers: HealthChecker, started: float, wait: float, observer: Observer
) -> bool:
    """`Fleet.wait_in_rotation` until `started + wait`, with an `engine_waiting` line every
    `WAIT_REPORT_INTERVAL` seconds meanwhile."""
    loop = asyncio.get_running_loop()
    fleet = workers.fleet
    while True:
        left = started + wait - loop.time()
        if await fleet.wait_in_rotation(min(left, WAIT_REPORT_INTERVAL)):
            return True
        if left <= WAIT_REPORT_INTERVAL:
            return False
        observer.process_event(
            "engine_waiting",
            upstream=None,
            waited_s=round(loop.time() - started, 3),
            wait_s=wait,
            rounds=workers.rounds,
            last=fleet.describe_health(),
        )

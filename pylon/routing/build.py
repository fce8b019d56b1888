"""The routing parts of one pylon, from its `RoutingOptions`: the fleet, its health checks and
the router (for `kv`, the selection core with every worker upserted).

`pylon.run.start` calls `build_routing` for `--routing` other than off, starts the health checks
with `start()`, hands `router` to `build_core`, passes `checks` to bring-up, and closes it all
with `aclose()` at stop (the health loop ends; the `kv` router's selection core shuts down once
the requests still in flight have released their bookings). `pylon.assemble.routing_options`
builds the options from Settings.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pylon.core.upstream import Upstream
from pylon.routing import PromptTokenizer, Router
from pylon.routing.fleet import Fleet, WorkerView
from pylon.routing.health import HealthChecker, HealthCheckOptions
from pylon.routing.least_loaded import LeastLoadedRouter
from pylon.routing.outlier import OutlierOptions
from pylon.routing.passive import PassiveHealth
from pylon.routing.round_robin import RoundRobinRouter
from pylon.startup import StartupError

if TYPE_CHECKING:
    from pylon.observe import Observer
    from pylon.routing.kv import KvRouter
    from pylon.routing.remote import AuthorityLink
    from pylon.routing.spec import WorkerSpec
    from pylon.routing.token_data import TokenDataProver
    from router_ffi import RouterFfiError, SelectionCore
    from router_ffi._native import NativeFactory


@dataclass(frozen=True, slots=True)
class KvOptions:
    """The `kv` router's options, beside the workers' own (`block-size=`, `kv-events=`)."""

    overlap_weight: float | None
    """Weight of a worker's cached prefix against its load in Dynamo's selection cost (weight x
    blocks to prefill + active blocks; `--kv-overlap-weight`); None: Dynamo's default (1)."""
    token_data: bool
    """Send the frontend pylon's token ids for the models proven to render alike
    (`--kv-token-data`)."""
    probe_timeout: float
    """Seconds one `--kv-token-data` proof probe may take to answer."""


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    """What `--routing` (other than off) builds: the mode, the workers and their checks."""

    mode: Literal["round-robin", "least-loaded", "kv"]
    """How a request picks its worker (`--routing`)."""
    workers: tuple[WorkerSpec, ...]
    """The workers, in the order given (`--worker`)."""
    frontend: Upstream | None
    """The Dynamo frontend `instance-id=` workers sit behind (`--upstream`); None: none."""
    health: HealthCheckOptions
    """How each worker is checked, taken out of rotation and brought back."""
    kv: KvOptions | None = None
    """The `kv` router's options; None for the other modes."""
    outlier: OutlierOptions | None = None
    """Passive health: when the workers' real answers eject them; None: never."""


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """What the metrics read at scrape time: each worker, and the kv selects' latencies."""

    policy: str
    workers: tuple[WorkerView, ...]
    select_bounds: tuple[float, ...] = ()
    select_seconds: tuple[float, ...] | None = None  # counts per bound, +Inf, sum; None: no kv
    # A process booked at the node's authority: whether its link is up, and its counters
    # (`pylon.routing.remote.AuthorityLink.counters`); None: no authority.
    authority: tuple[bool, dict[str, int]] | None = None


@dataclass
class Routing:
    """What `--routing` built: the router, the workers and their health checks."""

    mode: str
    router: Router
    fleet: Fleet
    checks: HealthChecker
    kv: KvRouter | None = None
    link: AuthorityLink | None = None  # booked at the node's authority (`remote`)
    # `--kv-token-data`'s proofs (the kv router's, or a process booked at the authority: its own)
    token_data: TokenDataProver | None = None
    _task: asyncio.Task[None] | None = None
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def start(self) -> None:
        """Start the health loop (its first round at once) and, for `kv`, the KV-event
        stream watch."""
        if self._task is None:
            self._task = asyncio.create_task(self.checks.run(), name="pylon-worker-health")
            if self.kv is not None:
                self.kv.start()

    def snapshot(self) -> RoutingSnapshot:
        if self.link is not None:
            link = self.link
            return RoutingSnapshot(
                self.mode, self.fleet.views(), authority=(link.connected, dict(link.counters))
            )
        if self.kv is None:
            return RoutingSnapshot(self.mode, self.fleet.views())
        from pylon.routing.kv import SELECT_SECONDS_BUCKETS

        return RoutingSnapshot(
            self.mode,
            self.fleet.views(),
            SELECT_SECONDS_BUCKETS,
            tuple(self.kv.select_seconds),
        )

    def active_bookings(self) -> dict[str, int]:
        """Bookings in flight per worker label (all zero when nothing is in flight)."""
        return self.fleet.active_by_worker()

    async def aclose(self) -> None:
        """Stop the health loop, then whatever the router holds (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            await close()


async def build_routing(
    options: RoutingOptions,
    observer: Observer,
    *,
    tokenizer: PromptTokenizer | None = None,
    native: NativeFactory | None = None,
    authority: Path | None = None,
) -> Routing:
    """The routing parts for `options.mode`.

    `tokenizer`: for `kv`, the loaded `--tokenizer` (or a test's stand-in); `native`: for `kv`,
    a factory of the native selection service instead of Dynamo's (tests).
    `authority`: the Unix socket of the node's booking authority (`pylon.routing.authority`):
    the router books there, over a mirror of the fleet (`pylon.routing.remote`).
    Raises `pylon.startup.StartupError` when the `kv` parts cannot be built.
    """
    mode = options.mode
    fleet = Fleet.from_specs(options.workers, options.frontend)
    if authority is not None:
        return _remote_routing(options, fleet, observer, tokenizer, authority)
    checks = HealthChecker(fleet, options.health, observer=observer)
    closers: list[Callable[[], Awaitable[None]]] = []
    if options.outlier is not None:
        passive = PassiveHealth(fleet, options.outlier, observer)
        if passive.detector.enabled:  # off: 0 failures, or a fleet of one worker
            fleet.passive = passive
            closers.append(passive.aclose)
    if mode == "round-robin":
        return Routing(mode, RoundRobinRouter(fleet), fleet, checks, _closers=closers)
    if mode == "least-loaded":
        return Routing(mode, LeastLoadedRouter(fleet), fleet, checks, _closers=closers)
    assert options.kv is not None and tokenizer is not None, "kv needs its options and tokenizer"
    kv = await build_kv_router(options.kv, fleet, observer, tokenizer, native=native)
    return Routing(
        mode, kv, fleet, checks, kv, token_data=kv.token_data, _closers=[*closers, kv.aclose]
    )


def _remote_routing(
    options: RoutingOptions,
    fleet: Fleet,
    observer: Observer,
    tokenizer: PromptTokenizer | None,
    authority: Path,
) -> Routing:
    """The parts of a serving process booked by the node's authority: the mirror fleet, its
    rotation pushed (`RemoteChecks`), and for `--kv-token-data` this process's own proofs."""
    from pylon.routing.remote import remote_routing_parts

    prover = None
    if options.kv is not None:
        assert tokenizer is not None, "kv needs its tokenizer"
        if options.kv.token_data:
            from pylon.routing.token_data import TokenDataProver

            prover = TokenDataProver(tokenizer, fleet, observer, timeout=options.kv.probe_timeout)
    router, checks = remote_routing_parts(
        options.mode,
        fleet,
        options.health,
        authority,
        observer,
        tokenizer=tokenizer,
        token_data=prover,
    )
    return Routing(
        options.mode,
        router,
        fleet,
        checks,
        link=router.link,
        token_data=prover,
        _closers=[router.aclose],
    )


async def build_kv_router(
    options: KvOptions,
    fleet: Fleet,
    observer: Observer,
    tokenizer: PromptTokenizer,
    *,
    native: NativeFactory | None = None,
) -> KvRouter:
    """The selection core with every worker upserted, and the router over it.

    Raises `StartupError` (one line) when the core cannot start or refuses a worker."""
    from pylon.routing.kv import KvRouter
    from router_ffi import RouterFfiError

    try:
        core = await asyncio.to_thread(
            _upserted_core, fleet, options, _native_errors_to(observer), native
        )
    except RouterFfiError as exc:
        raise StartupError(f"--routing kv: {' '.join(str(exc).split())}") from None
    prover = None
    if options.token_data:
        from pylon.routing.token_data import TokenDataProver

        prover = TokenDataProver(tokenizer, fleet, observer, timeout=options.probe_timeout)
    router = KvRouter(core, fleet, tokenizer, observer, token_data=prover)
    observer.process_event(
        "kv_router_started",
        workers=[worker.label for worker in fleet.workers],
        kv_events={worker.label: list(worker.spec.kv_events) for worker in fleet.workers},
    )
    return router


def _upserted_core(
    fleet: Fleet,
    options: KvOptions,
    on_error: Callable[[RouterFfiError], None],
    native: NativeFactory | None,
) -> SelectionCore:
    """A started selection core that knows every worker (blocking: run it off the loop)."""
    from pylon.routing.kv import native_spec
    from router_ffi import SelectionCore

    core = SelectionCore(
        on_error=on_error, native=native, overlap_score_weight=options.overlap_weight
    )
    try:
        for worker in fleet.workers:
            record = core.upsert_worker(native_spec(worker))
            if not record.schedulable:
                reasons = ", ".join(record.not_schedulable_reasons) or record.lifecycle
                raise StartupError(
                    f"--worker {worker.label}: Dynamo's selection core will not schedule "
                    f"it ({reasons})"
                )
    except BaseException:
        core.shutdown()
        raise
    return core


def _native_errors_to(observer: Observer) -> Callable[[RouterFfiError], None]:
    """The core's error sink: it runs on the core's owner thread, so each error is handed to
    the event loop (the observer is only ever called there)."""
    loop = asyncio.get_running_loop()

    def on_error(error: RouterFfiError) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            loop.call_soon_threadsafe(_report_native_error, observer, error)

    return on_error


def _report_native_error(observer: Observer, error: RouterFfiError) -> None:
    observer.process_event("kv_router_error", detail=str(error))

"""The routing parts of one pylon, from Settings: the fleet, its health checks and the router.

`pylon.app.start` calls `build_routing` for `--routing` other than off, starts the health checks
with `start()`, hands `router` to `build_core`, passes `checks` to bring-up, and closes it all
with `aclose()` at stop (the health loop ends; the `kv` router's selection core shuts down once
the requests still in flight have released their bookings).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pylon.core.target import UpstreamTarget
from pylon.routing import Router, Tokenizer
from pylon.routing.fleet import Fleet, WorkerView
from pylon.routing.health import HealthChecker
from pylon.routing.least_loaded import LeastLoadedRouter
from pylon.routing.round_robin import RoundRobinRouter

if TYPE_CHECKING:
    from pylon.observe import Observer
    from pylon.routing.kv import KvRouter
    from pylon.settings import Settings
    from router_ffi._native import NativeFactory


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """What the metrics read at scrape time: each worker, and the kv selects' latencies."""

    policy: str
    workers: tuple[WorkerView, ...]
    select_bounds: tuple[float, ...] = ()
    select_seconds: tuple[float, ...] | None = None  # counts per bound, +Inf, sum; None: no kv


@dataclass
class Routing:
    """What `--routing` built: the router, the workers and their health checks."""

    mode: str
    router: Router
    fleet: Fleet
    checks: HealthChecker
    kv: KvRouter | None = None
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
    settings: Settings,
    observer: Observer,
    *,
    tokenizer: Tokenizer | None = None,
    native: NativeFactory | None = None,
) -> Routing:
    """The routing parts for `settings.routing` (not `off`).

    `tokenizer`: for `kv`, instead of loading `--tokenizer` (tests); `native`: for `kv`, a
    factory of the native selection service instead of Dynamo's (tests).
    Raises `pylon.startup.StartupError` when the `kv` parts cannot be built.
    """
    mode = settings.routing
    assert mode != "off", "--routing off has no routing parts"
    frontend = UpstreamTarget.from_url(str(settings.upstream)) if settings.upstream else None
    fleet = Fleet.from_specs(settings.worker, frontend)
    checks = HealthChecker(
        fleet,
        path=settings.worker_health_path,
        interval=settings.worker_health_interval,
        timeout=settings.worker_health_timeout,
        eject_after=settings.worker_eject_after,
        readmit_after=settings.worker_readmit_after,
        observer=observer,
    )
    if mode == "round-robin":
        return Routing(mode, RoundRobinRouter(fleet), fleet, checks)
    if mode == "least-loaded":
        return Routing(mode, LeastLoadedRouter(fleet), fleet, checks)
    from pylon.routing.kv import build_kv_router

    kv = await build_kv_router(settings, fleet, observer, tokenizer=tokenizer, native=native)
    return Routing(mode, kv, fleet, checks, kv, _closers=[kv.aclose])

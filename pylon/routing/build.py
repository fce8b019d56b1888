"""The routing parts of one pylon, from its `RoutingOptions`: the fleet, its health checks and
the router (for `kv`, the selection core with every worker upserted).

`pylon.run.start` calls `build_routing` for `--routing` other than off (with `--workers-file`,
the catalogue is read here and watched: `pylon.routing.catalogue`), starts the health checks
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
from pylon.routing.catalogue import (
    CatalogueError,
    CatalogueWatch,
    DiscoveryOptions,
    InstanceDiscovery,
    WorkersFileOptions,
    check_catalogue,
    parse_workers_file,
    read_workers_file,
)
from pylon.routing.fleet import Fleet, Worker, WorkerView
from pylon.routing.health import HealthChecker, HealthCheckOptions
from pylon.routing.least_loaded import LeastLoadedRouter
from pylon.routing.outlier import OutlierOptions
from pylon.routing.passive import PassiveHealth
from pylon.routing.round_robin import RoundRobinRouter
from pylon.routing.spec import check_replica_peer
from pylon.startup import StartupError

if TYPE_CHECKING:
    from pylon.observe import Observer
    from pylon.routing.kv import KvRouter
    from pylon.routing.remote import AuthorityLink
    from pylon.routing.replica_sync import ReplicaSyncWatch
    from pylon.routing.spec import WorkerSpec
    from pylon.routing.token_data import TokenDataProver
    from router_ffi import ReplicaSync, RouterFfiError, SelectionCore
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
    replica_sync_port: int | None = None
    """The port Dynamo's replica sync publishes this pylon's bookings on (`0.0.0.0:PORT`,
    `--replica-sync-port`); None: no sync."""
    replica_peers: tuple[str, ...] = ()
    """The other replicas' sync addresses, HOST:PORT (`--replica-peer`)."""
    booking_expiry: float | None = None
    """Seconds after which the core forgets a booking it was never told to free (a crashed
    replica's; `--kv-booking-expiry`); None: Dynamo's default (300)."""


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
    workers_file: WorkersFileOptions | None = None
    """`--workers-file`: the catalogue comes from it (read at start, then watched), and
    `workers` is empty."""
    discovery: DiscoveryOptions | None = None
    """`--discover-instances`: the catalogue is the frontend's instances (the fleet starts
    empty and fills at the first read), and `workers` is empty."""


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    """What the metrics read at scrape time: each worker, and the kv selects' latencies."""

    policy: str
    workers: tuple[WorkerView, ...]
    select_bounds: tuple[float, ...] = ()
    select_seconds: tuple[float, ...] | None = None  # counts per bound, +Inf, sum; None: no kv
    catalogue_digest: str | None = None  # --routing kv: what replicas compare
    core_active: dict[str, int] = field(default_factory=dict)  # worker label -> core's count
    replica_sync_events: dict[tuple[str, str], int] = field(default_factory=dict)
    """(peer, result) -> sync events heard from that peer (`pylon.routing.replica_sync`)."""
    # Catalogue reloads (changed, refused) with --workers-file / --discover-instances; None: a
    # fixed --worker list.
    catalogue_reloads: tuple[int, int] | None = None
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
    replica_watch: ReplicaSyncWatch | None = None
    link: AuthorityLink | None = None  # booked at the node's authority (`remote`)
    # `--kv-token-data`'s proofs (the kv router's, or a process booked at the authority: its own)
    token_data: TokenDataProver | None = None
    _task: asyncio.Task[None] | None = None
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # --workers-file or --discover-instances; None: --worker, fixed.
    catalogue: CatalogueWatch | InstanceDiscovery | None = None
    _watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the health loop (its first round at once), for `kv` the KV-event stream
        watch, and the workers file's watch."""
        if self._task is None:
            self._task = asyncio.create_task(self.checks.run(), name="pylon-worker-health")
            if self.kv is not None:
                self.kv.start()
            if self.replica_watch is not None:
                self.replica_watch.start()
            if self.catalogue is not None:
                self._watch = asyncio.create_task(
                    self.catalogue.run(), name="pylon-workers-file-watch"
                )

    @property
    def catalogue_source(self) -> str:
        """Where the catalogue comes from: `file PATH`, `discovery URL`, or `flags` (--worker,
        [[worker]])."""
        return self.catalogue.source if self.catalogue is not None else "flags"

    def snapshot(self) -> RoutingSnapshot:
        catalogue = self.catalogue
        reloads = (catalogue.reloads, catalogue.failures) if catalogue is not None else None
        if self.link is not None:
            link = self.link
            return RoutingSnapshot(
                self.mode,
                self.fleet.views(),
                catalogue_reloads=reloads,
                authority=(link.connected, dict(link.counters)),
            )
        if self.kv is None:
            return RoutingSnapshot(self.mode, self.fleet.views(), catalogue_reloads=reloads)
        from pylon.routing.kv import SELECT_SECONDS_BUCKETS

        watch = self.replica_watch
        return RoutingSnapshot(
            self.mode,
            self.fleet.views(),
            SELECT_SECONDS_BUCKETS,
            tuple(self.kv.select_seconds),
            self.kv.catalogue_digest,
            self.kv.core_active(),
            dict(watch.counts) if watch is not None else {},
            catalogue_reloads=reloads,
        )

    def workers_report(self) -> dict[str, object]:
        """What the admin listener's `GET /workers` answers (JSON-ready; at most
        `MAX_WORKERS` workers): the catalogue, its digest and source, and each worker's spec,
        rotation, health, passive ejections, bookings in flight and KV-event faults."""
        fleet = self.fleet
        report: dict[str, object] = {
            "routing": self.mode,
            "catalogue_digest": fleet.digest,
            "catalogue_source": self.catalogue_source,
            "in_rotation": len(fleet.in_rotation),
            "workers": [worker_report(worker) for worker in fleet.workers],
        }
        if self.catalogue is not None:
            report["reloads"] = self.catalogue.reloads
            report["reload_failures"] = self.catalogue.failures
        return report

    def active_bookings(self) -> dict[str, int]:
        """Bookings in flight per worker label (all zero when nothing is in flight)."""
        return self.fleet.active_by_worker()

    async def aclose(self) -> None:
        """Stop the workers file's watch and the health loop, then whatever the router holds
        (idempotent)."""
        for task in (self._watch, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._watch = self._task = None
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            await close()


def worker_report(worker: Worker) -> dict[str, object]:
    """One worker in `GET /workers`."""
    return {
        "label": worker.label,
        "worker_id": worker.spec.worker_id,
        "spec": worker.spec.text(),
        "in_rotation": worker.in_rotation,
        "health": {
            "passing": worker.checks_pass,
            "last_result": worker.last_result,
            "passes": worker.passes,
            "failures": worker.failures,
        },
        "ejected": worker.outlier.ejected,
        "ejections": dict(worker.ejections),
        "active": worker.active,
        "decisions": dict(worker.decisions),
        "kv_faults": dict(worker.kv_faults),
    }


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
    catalogue: CatalogueWatch | InstanceDiscovery | None = None
    workers = options.workers
    if options.workers_file is not None:
        data, workers = _first_catalogue(options.workers_file)
    fleet = Fleet.from_specs(workers, options.frontend)
    if authority is not None:
        # The authority watches the catalogue; this process's mirror follows its pushes.
        return _remote_routing(options, fleet, observer, tokenizer, authority)
    if options.workers_file is not None:
        catalogue = CatalogueWatch(fleet, options.workers_file, observer)
        catalogue.prime(data)
    elif options.discovery is not None:
        catalogue = InstanceDiscovery(fleet, options.discovery, observer)
    checks = HealthChecker(fleet, options.health, observer=observer)
    closers: list[Callable[[], Awaitable[None]]] = []
    if options.outlier is not None and options.outlier.consecutive > 0:
        # It sets `fleet.passive` while it is enabled (off for a fleet of one worker; a
        # catalogue change may turn it on or off).
        passive = PassiveHealth(fleet, options.outlier, observer)
        closers.append(passive.aclose)
    if mode == "round-robin":
        router: Router = RoundRobinRouter(fleet)
    elif mode == "least-loaded":
        router = LeastLoadedRouter(fleet)
    else:
        assert options.kv is not None and tokenizer is not None, "kv needs options, tokenizer"
        kv = await build_kv_router(options.kv, fleet, observer, tokenizer, native=native)
        closers.append(kv.aclose)
        watch = None
        if options.kv.replica_sync_port is not None:
            from pylon.routing.replica_sync import ReplicaSyncWatch

            watch = ReplicaSyncWatch(
                {peer: check_replica_peer(peer) for peer in options.kv.replica_peers},
                (worker.spec.worker_id for worker in fleet.workers),
                kv.catalogue_digest,
                observer,
            )
            closers.append(watch.aclose)
            replica_watch = watch
            fleet.on_catalogue(
                lambda change: replica_watch.catalogue_changed(
                    (worker.spec.worker_id for worker in fleet.workers), change.digest
                )
            )
        return Routing(
            mode,
            kv,
            fleet,
            checks,
            kv,
            watch,
            token_data=kv.token_data,
            _closers=closers,
            catalogue=catalogue,
        )
    return Routing(mode, router, fleet, checks, _closers=closers, catalogue=catalogue)


def _first_catalogue(options: WorkersFileOptions) -> tuple[bytes, tuple[WorkerSpec, ...]]:
    """The workers file at start: its bytes and specs; `StartupError` (one line) otherwise."""
    where = f"--workers-file {options.path}"
    try:
        data = read_workers_file(options.path)
        specs = parse_workers_file(data, where)
        check_catalogue(specs, options.rules, where)
    except CatalogueError as exc:
        raise StartupError(str(exc)) from None
    return data, specs


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
        catalogue_digest=router.catalogue_digest,
    )
    if options.replica_sync_port is not None:
        port = options.replica_sync_port
        observer.process_event(
            "replica_sync_started",
            exposure=f"0.0.0.0:{port}",
            peers=list(options.replica_peers),
            catalogue_digest=router.catalogue_digest,
            booking_expiry=options.booking_expiry,
            detail=f"Dynamo's replica sync publishes this pylon's bookings on every interface "
            f"(0.0.0.0:{port}), unauthenticated: allow only the peers to reach it "
            "(docs/routing.md, 'Replicas across nodes'); every replica must log the same "
            "catalogue_digest",
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
        on_error=on_error,
        native=native,
        overlap_score_weight=options.overlap_weight,
        replica_sync=_replica_sync(options),
        active_request_expiry_s=options.booking_expiry,
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


def _replica_sync(options: KvOptions) -> ReplicaSync | None:
    """The core's replica sync from `--replica-sync-port` and `--replica-peer` (None: off)."""
    if options.replica_sync_port is None:
        return None
    from router_ffi import ReplicaSync

    peers = tuple(check_replica_peer(peer) for peer in options.replica_peers)
    return ReplicaSync(options.replica_sync_port, peers)


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

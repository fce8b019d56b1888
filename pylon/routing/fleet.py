"""The configured workers: where its requests go, whether it is in rotation, what it carries.

A `Worker` is built once from its `WorkerSpec`:

- `url=` worker: its own `Upstream` (the pool keeps connections, and the per-upstream cap,
  per worker), no extra header;
- `instance-id=` worker: the `--upstream` Dynamo frontend's upstream, plus the trusted pin
  `x-dynamo-worker-instance-id: <decimal u64>` (pylon's deny-lists strip every client copy of
  `x-dynamo-*`, its aliases and the body pins, so only pylon writes it).

`Fleet` holds them in spec order, the tuple of those in rotation (what routers choose from; rebuilt
only when health changes it, so a choice reads one tuple) and each worker's bookings in flight
(`Worker.active`, counted by the bookings themselves). `WorkerBooking` is the booking of the
load-aware routers: it counts itself on its worker from booking to release, exactly once, and
tells the fleet's passive health (`pylon.routing.outlier`) how the worker answered.

The rotation state, one truth for routers, readiness and metrics: a worker is in rotation when
its active health checks admit it (`Worker.checks_pass`, set by `Fleet.set_in_rotation`) and
its real answers have not ejected it (`Worker.outlier.ejected`, set by `Fleet.set_ejected`).
Read it as `Fleet.in_rotation` (a tuple), `Worker.in_rotation`, `Fleet.views()`, and hear its
changes with `Fleet.on_change`.

The catalogue can change while pylon serves (`Fleet.replace`: a reloaded workers file, or the
snapshot a serving process's mirror fleet is pushed). Workers are compared by their spec (the
worker id and every key): a kept worker keeps its state and bookings, an added one starts out of
rotation and enters it through its health checks like a worker at start, a removed one leaves
rotation at once and leaves the fleet's load view (its bookings in flight finish; their release
only touches the detached `Worker`). `on_catalogue` listeners (the health checks, passive
health, the `kv` router) hear each `CatalogueChange`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pylon.core.hooks import ExchangeHooks
from pylon.core.http import Header
from pylon.core.record import RequestRecord
from pylon.core.upstream import Upstream
from pylon.routing.outlier import OutlierState
from pylon.routing.spec import WorkerSpec, catalogue_digest, parse_worker_spec

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.routing import Booking

INSTANCE_PIN_HEADER = b"x-dynamo-worker-instance-id"


class Worker:
    """One worker: its spec, where its requests go (upstream and trusted headers), live state."""

    __slots__ = (
        "active",
        "checks_pass",
        "decisions",
        "ejections",
        "ever_in_rotation",
        "failures",
        "headers",
        "in_rotation",
        "index",
        "kv_faults",
        "label",
        "last_result",
        "outlier",
        "passes",
        "removed",
        "spec",
        "upstream",
    )

    def __init__(
        self, spec: WorkerSpec, index: int, upstream: Upstream, headers: tuple[Header, ...]
    ) -> None:
        self.spec = spec
        self.index = index  # position in the configured list
        self.label = spec.label
        self.upstream = upstream
        self.headers = headers
        self.active = 0  # bookings in flight
        self.decisions: dict[str, int] = {}  # bookings made, by the policy that chose it
        # KV-event stream faults seen (`kv` routing): gap, regressed, malformed.
        self.kv_faults: dict[str, int] = {}
        self.in_rotation = False  # routers may choose it: checks pass and not ejected
        self.checks_pass = False  # the active health checks admit it
        self.outlier = OutlierState()  # passive health: its real answers (`outlier.ejected`)
        self.ejections: dict[str, int] = {}  # passive ejections so far, by reason
        self.ever_in_rotation = False
        self.failures = 0  # consecutive failed health checks
        self.passes = 0  # consecutive passed health checks
        self.last_result = "not checked yet"
        self.removed = False  # left the catalogue (`Fleet.replace`): verdicts about it are moot

    def __repr__(self) -> str:
        return f"Worker({self.label!r}, in_rotation={self.in_rotation}, active={self.active})"


class AnswerReport(Protocol):
    """Where bookings tell how their worker answered (`pylon.routing.passive.PassiveHealth`)."""

    def answered(self, worker: Worker, status: int) -> None:
        """A response head with `status` arrived."""
        ...

    def ended(self, worker: Worker, status: int, outcome: str) -> None:
        """The response a head with `status` began is over, as `outcome` says."""
        ...

    def unanswered(self, worker: Worker, outcome: str) -> None:
        """The exchange ended (or moved) with no response head, as `outcome` says."""
        ...


def make_worker(spec: WorkerSpec, index: int, frontend: Upstream | None) -> Worker:
    """Where `spec`'s requests go: its own URL, or the frontend with the instance pin."""
    if spec.url is not None:
        return Worker(spec, index, Upstream.from_url(spec.url), ())
    assert frontend is not None, "Settings require --upstream for instance-id workers"
    pin = (INSTANCE_PIN_HEADER, str(spec.instance_id).encode("ascii"))
    return Worker(spec, index, frontend, (pin,))


@dataclass(frozen=True, slots=True)
class CatalogueChange:
    """What one `Fleet.replace` did: the workers added (out of rotation until their health
    checks pass), removed (out of rotation and out of the load view) and kept (state intact),
    and the new catalogue's digest (`pylon.routing.spec.catalogue_digest`)."""

    added: tuple[Worker, ...]
    removed: tuple[Worker, ...]
    kept: tuple[Worker, ...]
    digest: str

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed)

    def fields(self) -> dict[str, object]:
        """The `workers_reloaded` process event's fields."""
        return {
            "added": [w.label for w in self.added],
            "removed": [w.label for w in self.removed],
            "kept": len(self.kept),
            "catalogue_digest": self.digest,
        }


class Fleet:
    """The workers, which are in rotation, and a way to wait for the first worker in rotation."""

    def __init__(self, workers: Sequence[Worker], frontend: Upstream | None = None) -> None:
        # Empty only until the first discovery of Dynamo instances (`--discover-instances`).
        self.workers: tuple[Worker, ...] = tuple(workers)
        self.in_rotation: tuple[Worker, ...] = ()
        self.frontend = frontend  # where `instance-id=` workers added later go
        self.digest = catalogue_digest(w.spec for w in self.workers)
        self._changed: asyncio.Event | None = None
        self._listeners: list[Callable[[], None]] = []
        self._catalogue_listeners: list[Callable[[CatalogueChange], None]] = []
        # Passive health, when on (`pylon.routing.build` sets it): the bookings report to it.
        self.passive: AnswerReport | None = None

    @classmethod
    def from_specs(cls, specs: Sequence[WorkerSpec], frontend: Upstream | None) -> Fleet:
        workers = [make_worker(spec, index, frontend) for index, spec in enumerate(specs)]
        return cls(workers, frontend)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` after every change of the set in rotation (e.g. to rebuild a filter)."""
        self._listeners.append(listener)

    def on_catalogue(self, listener: Callable[[CatalogueChange], None]) -> None:
        """Call `listener` with every `CatalogueChange` that added or removed a worker, before
        the listeners of the rotation hear it."""
        self._catalogue_listeners.append(listener)

    def replace(self, specs: Sequence[WorkerSpec]) -> CatalogueChange:
        """Make `specs` the catalogue (validated by the caller: at least one, no worker id
        twice). A worker whose spec is unchanged is kept, whatever its position; a spec that
        is new (or changed for the same worker id) is a new worker, out of rotation; a worker
        whose spec is gone leaves rotation and the fleet at once (see the module docstring).
        The one way the catalogue changes, for a reload and for a mirror fleet alike."""
        assert specs, "a fleet has at least one worker"
        by_spec = {worker.spec: worker for worker in self.workers}
        assert len({spec.worker_id for spec in specs}) == len(specs), "a worker id twice"
        workers: list[Worker] = []
        added: list[Worker] = []
        for index, spec in enumerate(specs):
            worker = by_spec.pop(spec, None)
            if worker is None:
                worker = make_worker(spec, index, self.frontend)
                added.append(worker)
            worker.index = index
            workers.append(worker)
        removed = tuple(by_spec.values())
        new = set(added)
        kept = tuple(w for w in workers if w not in new)
        change = CatalogueChange(tuple(added), removed, kept, catalogue_digest(specs))
        self.workers = tuple(workers)
        self.digest = change.digest
        if not change.changed:
            return change
        was_in_rotation = any(w.in_rotation for w in removed)
        for worker in removed:
            worker.removed = True
            worker.in_rotation = worker.checks_pass = False
        for listener in self._catalogue_listeners:
            listener(change)
        if was_in_rotation:
            self._rotated()
        return change

    def spec_texts(self) -> tuple[str, ...]:
        """The catalogue as canonical SPEC texts, in order: what a booking authority pushes to
        the mirror fleets of serving processes (`replace_texts` there)."""
        return tuple(worker.spec.text() for worker in self.workers)

    def replace_texts(self, texts: Sequence[str]) -> CatalogueChange:
        """`replace` from SPEC texts (a pushed snapshot); `WorkerSpecError` for a bad one,
        before anything changes."""
        return self.replace([parse_worker_spec(text) for text in texts])

    def set_in_rotation(self, worker: Worker, in_rotation: bool) -> None:
        """The active health checks' verdict: `worker` passes them (or no longer does)."""
        if worker.removed:
            return  # a check that was in flight when the worker left the catalogue
        worker.checks_pass = in_rotation
        if in_rotation:
            worker.ever_in_rotation = True
        self._rotate(worker)

    def set_ejected(self, worker: Worker, ejected: bool) -> None:
        """Passive health's verdict: `worker`'s real answers eject it (or it returns)."""
        if worker.removed:
            return
        worker.outlier.ejected = ejected
        self._rotate(worker)

    def _rotate(self, worker: Worker) -> None:
        in_rotation = worker.checks_pass and not worker.outlier.ejected
        if worker.in_rotation == in_rotation:
            return
        worker.in_rotation = in_rotation
        self._rotated()

    def _rotated(self) -> None:
        self.in_rotation = tuple(w for w in self.workers if w.in_rotation)
        for listener in self._listeners:
            listener()
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    @property
    def active(self) -> int:
        """Bookings in flight, all workers together."""
        return sum(worker.active for worker in self.workers)

    def active_by_worker(self) -> dict[str, int]:
        return {worker.label: worker.active for worker in self.workers}

    def views(self) -> tuple[WorkerView, ...]:
        """Each worker's state now (for metrics, read at scrape time)."""
        return tuple(
            WorkerView(
                worker.label,
                worker.in_rotation,
                worker.active,
                dict(worker.decisions),
                dict(worker.kv_faults),
                worker.outlier.ejected,
                dict(worker.ejections),
            )
            for worker in self.workers
        )

    def discovery_upstream(self) -> Upstream | None:
        """Where pylon asks for the model list: the first worker in rotation (None: none is)."""
        in_rotation = self.in_rotation
        return in_rotation[0].upstream if in_rotation else None

    async def wait_in_rotation(self, timeout: float) -> bool:
        """Wait until at least one worker is in rotation; False when `timeout` ran out first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.in_rotation:
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                return bool(self.in_rotation)
        return True

    def describe_health(self) -> str:
        """Each worker's last health answer, for the one line that says why none is in rotation."""
        return "; ".join(f"{worker.label}: {worker.last_result}" for worker in self.workers)


@dataclass(frozen=True, slots=True)
class WorkerView:
    label: str
    in_rotation: bool
    active: int  # bookings in flight
    decisions: dict[str, int]  # bookings made so far, by policy
    kv_faults: dict[str, int]  # KV-event stream faults so far, by kind
    ejected: bool = False  # passive health holds it out of rotation now
    ejections: dict[str, int] = field(default_factory=dict)  # passive ejections, by reason


def elsewhere(fleet: Fleet, failed: Booking) -> tuple[Worker, ...]:
    """The workers in rotation a request that could not reach `failed`'s worker may go to:
    those behind another upstream (`instance-id=` workers share their frontend's)."""
    label = failed.upstream.label
    return tuple(w for w in fleet.in_rotation if w.upstream.label != label)


def count_decision(worker: Worker, policy: str) -> None:
    decisions = worker.decisions
    decisions[policy] = decisions.get(policy, 0) + 1


class WorkerBooking(ExchangeHooks):
    """A request in flight on one worker (the round-robin and least-loaded routers' booking);
    `policy` names the router that chose it (counted per worker). Released by the exchange's
    terminal moment, exactly once; on the way it tells the fleet's passive health how the
    worker answered (`AnswerReport`)."""

    __slots__ = ("_passive", "_released", "_worker", "headers", "upstream", "worker")
    counts_output = False
    quiet = False
    body = None

    def __init__(self, worker: Worker, policy: str, passive: AnswerReport | None) -> None:
        self._worker = worker
        self._passive = passive
        self.upstream = worker.upstream
        self.headers = worker.headers
        self.worker = worker.label
        self._released = False
        worker.active += 1
        count_decision(worker, policy)

    def response_head(self, record: RequestRecord) -> None:
        passive = self._passive
        if passive is not None:
            passive.answered(self._worker, record.status)

    def complete(self, record: RequestRecord) -> None:
        """The exchange is over: the worker carries one request less (idempotent); the worker
        is judged by how it ended (no head, a head and a broken body, a whole response)."""
        if not self._released:
            self._released = True
            self._worker.active -= 1
            passive = self._passive
            if passive is not None:
                if record.first_byte_at is None:
                    passive.unanswered(self._worker, record.outcome)
                else:
                    passive.ended(self._worker, record.status, record.outcome)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        """Released without the worker having seen the request (see `Exchange.rebooked`):
        judged by the error that sent it elsewhere."""
        if not self._released:
            self._released = True
            self._worker.active -= 1
            passive = self._passive
            if passive is not None:
                passive.unanswered(self._worker, error.code.value)

"""Passive health applied to a fleet: the bookings tell `PassiveHealth` how each worker
answered, and the `pylon.routing.outlier` rule ejects and returns workers in the fleet's one
rotation (the same one the active checks feed: routers, readiness and metrics read it).

The returns are scheduled on the event loop (one timer, for the earliest). Reported to the
`Observer` as process events: `worker_outlier_ejected` (warning: `worker`, `reason`,
`failures`, `ejected_for_s`, `ejections`, `active`: its bookings still in flight),
`worker_outlier_returned` (`worker`, `ejected_for_s`) and `worker_outlier_held` (warning: the
cap kept a worker due for ejection in rotation: `worker`, `reason`, `failures`, `ejected`,
`cap`; once until it is ejected or succeeds). Each worker counts its ejections by reason
(`Worker.ejections`, `pylon_router_worker_ejections_total`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pylon.routing.fleet import AnswerReport, CatalogueChange, Fleet, Worker
from pylon.routing.outlier import (
    BROKEN_AFTER_HEAD,
    STATUS_5XX,
    UNANSWERED,
    Held,
    OutlierDetector,
    OutlierOptions,
)

if TYPE_CHECKING:
    from pylon.observe import Observer


class PassiveHealth:
    """`OutlierDetector` applied to a fleet: bookings tell it each exchange's verdict
    (`answered`, `unanswered`), it ejects and returns workers in the fleet's rotation and
    reports each change (see the module docstring)."""

    __slots__ = ("_detector", "_fleet", "_observer", "_timer")

    def __init__(self, fleet: Fleet, options: OutlierOptions, observer: Observer) -> None:
        self._fleet = fleet
        self._detector = OutlierDetector(options, len(fleet.workers))
        self._observer = observer
        self._timer: asyncio.TimerHandle | None = None
        fleet.on_catalogue(self._catalogue_changed)
        fleet.passive = self if self._detector.enabled else None

    def _catalogue_changed(self, change: CatalogueChange) -> None:
        """The cap follows the fleet's size (passive health is off for a fleet of one: the
        bookings stop reporting), and a removed worker's ejection stops counting."""
        for worker in change.removed:
            self._detector.forget(worker.outlier)
        self._detector.resize(len(self._fleet.workers))
        self._fleet.passive = self if self._detector.enabled else None

    @property
    def detector(self) -> OutlierDetector:
        return self._detector

    def answered(self, worker: Worker, status: int) -> None:
        """A booking on `worker` heard a response head with `status`: a 5xx is a failure at
        once (the worker leaves before more requests reach it); any other head is judged when
        its response is over (`ended`)."""
        if status >= 500 and status != 503:
            self._failed(worker, STATUS_5XX)

    def ended(self, worker: Worker, status: int, outcome: str) -> None:
        """The response a head with `status` began on `worker` is over, as `outcome` says: a
        whole one is a success (the path is a compare and two attribute reads), one that broke
        after a good head a failure; a 5xx was counted at its head."""
        if status >= 500 and status != 503:
            return
        if outcome == "ok":
            state = worker.outlier
            if state.failures or state.probation:
                self._detector.success(state)
            return
        reason = BROKEN_AFTER_HEAD.get(outcome)
        if reason is not None:
            self._failed(worker, reason)

    def unanswered(self, worker: Worker, outcome: str) -> None:
        """A booking on `worker` ended with no response head, as `outcome` says."""
        reason = UNANSWERED.get(outcome)
        if reason is not None:
            self._failed(worker, reason)

    def _failed(self, worker: Worker, reason: str) -> None:
        if worker.removed:
            return  # a late answer from a worker that left the catalogue
        loop = asyncio.get_running_loop()
        fleet = self._fleet
        verdict = self._detector.failure(
            worker.outlier, reason, loop.time(), len(fleet.in_rotation)
        )
        if verdict is None:
            return
        if isinstance(verdict, Held):
            self._observer.process_event(
                "worker_outlier_held",
                worker=worker.label,
                reason=verdict.reason,
                failures=verdict.failures,
                ejected=verdict.ejected,
                cap=verdict.cap,
            )
            return
        counts = worker.ejections
        counts[reason] = counts.get(reason, 0) + 1
        fleet.set_ejected(worker, True)
        self._observer.process_event(
            "worker_outlier_ejected",
            worker=worker.label,
            reason=reason,
            failures=verdict.failures,
            ejected_for_s=verdict.seconds,
            ejections=verdict.ejections,
            active=worker.active,
        )
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """One timer, for the earliest return due."""
        pending = [w.outlier.until for w in self._fleet.workers if w.outlier.ejected]
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if pending:
            self._timer = loop.call_at(min(pending), self._return_due)

    def _return_due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        detector = self._detector
        for worker in self._fleet.workers:
            state = worker.outlier
            if detector.due(state, now):
                detector.returned(state)
                self._fleet.set_ejected(worker, False)
                self._observer.process_event(
                    "worker_outlier_returned", worker=worker.label, ejected_for_s=state.seconds
                )
        self._arm(loop)

    async def aclose(self) -> None:
        """Stop the return timer (at pylon's stop)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_: type[AnswerReport] = PassiveHealth

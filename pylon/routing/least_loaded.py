"""`--routing least-loaded`: the worker in rotation with the fewest bookings in flight.

Ties go round-robin: the scan starts one past the last choice, and the first worker with the
fewest bookings from there wins, so equally loaded workers take turns (an idle fleet behaves
exactly like round-robin). A booking counts from `book` to `release`, i.e. for the whole engine
exchange, streaming included.
"""

from __future__ import annotations

from pylon.core.plan import ForwardPlan
from pylon.routing import Booking, Router
from pylon.routing.fleet import Fleet, Worker, WorkerBooking, elsewhere
from pylon.routing.round_robin import no_worker

POLICY = "least-loaded"


def least_loaded(in_rotation: tuple[Worker, ...], start: int) -> int:
    """Index in `in_rotation` (non-empty) of the first worker with the fewest bookings, scanning
    from `start` round the tuple."""
    count = len(in_rotation)
    best = start % count
    fewest = in_rotation[best].active
    for step in range(1, count):
        if fewest == 0:
            break
        index = (start + step) % count
        active = in_rotation[index].active
        if active < fewest:
            best, fewest = index, active
    return best


class LeastLoadedRouter:
    __slots__ = ("_fleet", "_next")

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._next = 0

    async def book(self, plan: ForwardPlan) -> Booking:
        return self.choose()

    def choose(self) -> WorkerBooking:
        """The booking on the least-loaded worker in rotation, at once; raises `NoWorker`."""
        in_rotation = self._fleet.in_rotation
        if not in_rotation:
            raise no_worker(self._fleet)
        index = least_loaded(in_rotation, self._next)
        self._next = index + 1
        return WorkerBooking(in_rotation[index], POLICY, self._fleet.passive)

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        others = elsewhere(self._fleet, failed)
        if not others:
            return None
        index = least_loaded(others, self._next)
        return WorkerBooking(others[index], POLICY, self._fleet.passive)


_: type[Router] = LeastLoadedRouter

"""`--routing least-loaded`: the admitted worker with the fewest bookings in flight.

Ties go round-robin: the scan starts one past the last choice, and the first worker with the
fewest bookings from there wins, so equally loaded workers take turns (an idle fleet behaves
exactly like round-robin). A booking counts from `book` to `release`, i.e. for the whole engine
exchange, streaming included.
"""

from __future__ import annotations

from pylon.core.plan import ForwardPlan
from pylon.routing import Booking, Router
from pylon.routing.fleet import Fleet, Worker, WorkerBooking
from pylon.routing.round_robin import no_worker

POLICY = "least-loaded"


def least_loaded(admitted: tuple[Worker, ...], start: int) -> int:
    """Index in `admitted` (non-empty) of the first worker with the fewest bookings, scanning
    from `start` round the tuple."""
    count = len(admitted)
    best = start % count
    fewest = admitted[best].active
    for step in range(1, count):
        if fewest == 0:
            break
        index = (start + step) % count
        active = admitted[index].active
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
        """The booking on the least-loaded admitted worker, at once; raises `NoWorker`."""
        admitted = self._fleet.admitted
        if not admitted:
            raise no_worker(self._fleet)
        index = least_loaded(admitted, self._next)
        self._next = index + 1
        return WorkerBooking(admitted[index], POLICY)


_: type[Router] = LeastLoadedRouter

"""`--routing round-robin`: each request to the next worker in rotation, in turn."""

from __future__ import annotations

from pylon.core.plan import ForwardPlan
from pylon.routing import Booking, NoWorker, Router
from pylon.routing.fleet import Fleet, WorkerBooking, elsewhere

POLICY = "round-robin"


def no_worker(fleet: Fleet) -> NoWorker:
    """What a router raises when no worker is in rotation (health checks failed: passive health
    never ejects the last one)."""
    count = len(fleet.workers)
    return NoWorker(
        f"no engine worker can take the request: none of the {count} "
        f"worker{'s' if count != 1 else ''} is in rotation now (failed health checks, or "
        "ejected for failing answers)"
    )


class RoundRobinRouter:
    """Cycles over the workers in rotation; an ejected worker drops out of the cycle at once."""

    __slots__ = ("_fleet", "_next")

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._next = 0

    async def book(self, plan: ForwardPlan) -> Booking:
        return self.choose()

    def choose(self) -> WorkerBooking:
        """The booking on the next worker in rotation, at once; raises `NoWorker`."""
        in_rotation = self._fleet.in_rotation
        if not in_rotation:
            raise no_worker(self._fleet)
        index = self._next % len(in_rotation)
        self._next = index + 1
        return WorkerBooking(in_rotation[index], POLICY, self._fleet.passive)

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        others = elsewhere(self._fleet, failed)
        if not others:
            return None
        # The turn stays where `book` left it: a move does not skip anyone's turn.
        return WorkerBooking(others[self._next % len(others)], POLICY, self._fleet.passive)


_: type[Router] = RoundRobinRouter

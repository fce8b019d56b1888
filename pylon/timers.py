"""A cheap movable deadline, shared by the transports (connection timers) and the relay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Deadline:
    """One connection timer whose deadline moves without rescheduling on every request.

    Arming stores a float (and reschedules only to fire earlier); the timer re-checks when it
    fires. HTTP/1.1 arms and disarms per request, so this keeps the per-request cost near zero.
    """

    __slots__ = ("_deadline", "_due", "_handle", "_loop", "_on_expire")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[], None] | None = None
    ) -> None:
        self._loop = loop
        self._on_expire = on_expire
        self._deadline: float | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0  # when the pending handle fires (kept here: no `when()` call per arm)

    def arm(self, seconds: float) -> None:
        deadline = self._loop.time() + seconds
        self._deadline = deadline
        if self._handle is None or self._due > deadline:
            if self._handle is not None:
                self._handle.cancel()
            self._schedule(deadline)

    def disarm(self) -> None:
        self._deadline = None  # the pending handle notices when it fires

    def cancel(self) -> None:
        self._deadline = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        if self._deadline is None:
            return
        if self._loop.time() + 0.001 < self._deadline:
            self._schedule(self._deadline)
            return
        self._deadline = None
        self.expired()

    def _schedule(self, when: float) -> None:
        self._due = when
        self._handle = self._loop.call_at(when, self._fire)

    def expired(self) -> None:
        """What expiry does; a subclass overrides this instead of passing a callback that
        refers back to it (which would make a reference cycle per timer for the GC to find)."""
        if self._on_expire is not None:
            self._on_expire()

"""The process lifecycle: starting, ready, draining. One object per process.

Listeners, admission (the `not_ready` and `shutting_down` 503s) and the admin `/ready` read it;
nothing else keeps a drain flag of its own. `readiness()` is the one answer to "may traffic come
here?" (the admin listener serves it). Connections subscribe to be told when the drain starts
(HTTP/2 and HTTP/3 send GOAWAY, idle HTTP/1.1 keep-alives close).
"""

from __future__ import annotations

import enum
from collections.abc import Callable


class Phase(enum.Enum):
    STARTING = "starting"  # listeners may be up; the engine is not known to be usable yet
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: finish what is in flight, admit nothing new


class Lifecycle:
    __slots__ = ("_listeners", "phase")

    def __init__(self, phase: Phase = Phase.STARTING) -> None:
        self.phase = phase
        # A dict as an ordered set: connections come and go, so removal must be O(1).
        self._listeners: dict[Callable[[], None], None] = {}

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) for `/ready`: ready only in the READY phase; a drain says so at once."""
        if self.phase is Phase.READY:
            return True, "ready"
        if self.phase is Phase.DRAINING:
            return False, "draining"
        return False, "starting"

    def mark_ready(self) -> None:
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY

    def drain(self) -> None:
        """Start the drain (once): every subscriber is told, in subscription order."""
        if self.phase is Phase.DRAINING:
            return
        self.phase = Phase.DRAINING
        for listener in list(self._listeners):
            listener()

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Call `listener` when the drain starts (at once if it already has)."""
        if self.phase is Phase.DRAINING:
            listener()
        else:
            self._listeners[listener] = None

    def forget(self, listener: Callable[[], None]) -> None:
        """A connection that closed before the drain need not be told."""
        self._listeners.pop(listener, None)

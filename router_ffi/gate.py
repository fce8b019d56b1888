"""The lifecycle guard: counts native calls in flight, admits none once closed. Thread-safe.

Every path to the native object enters the gate first and exits it when the native call has
landed; `SelectionCore.shutdown` closes the gate, waits until nothing is in flight, and only
then stops the native core. So no call can reach the native object after (or during) its
shutdown, and a call admitted before the close always finishes first.
"""

from __future__ import annotations

import threading

from router_ffi.errors import ServiceClosed


class CallGate:
    __slots__ = ("_cond", "_in_flight", "_open")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._in_flight = 0
        self._open = True

    def enter(self) -> None:
        """Admit one call, or raise `ServiceClosed` once the gate is closed."""
        with self._cond:
            if not self._open:
                raise ServiceClosed("the selection core is shut down")
            self._in_flight += 1

    def try_enter(self) -> bool:
        """Admit one call if open; False (and nothing admitted) once closed."""
        with self._cond:
            if not self._open:
                return False
            self._in_flight += 1
            return True

    def exit(self) -> None:
        """One admitted call has finished."""
        with self._cond:
            self._in_flight -= 1
            if self._in_flight <= 0:
                self._cond.notify_all()

    def close(self) -> None:
        """Admit nothing more (idempotent); calls already admitted go on."""
        with self._cond:
            self._open = False

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Block until no admitted call is in flight; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight <= 0, timeout_s)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def in_flight(self) -> int:
        return self._in_flight

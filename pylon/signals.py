"""What each signal pylon can catch does, so that none ends it silently (docs/operations.md,
"Signals"):

- SIGINT, SIGTERM, SIGQUIT: the graceful drain; a second one during the drain ends it at once.
- SIGHUP (`systemctl reload`, a closing terminal): a reload of what can be re-read while serving
  (`pylon.run.Running.reload`); pylon keeps running whatever it finds.
- SIGUSR1, SIGUSR2: a `status_report` line (phase, requests in flight); pylon keeps running.
- SIGALRM, SIGVTALRM, SIGXCPU, SIGXFSZ, SIGIO, SIGPWR, SIGSTKFLT and the real-time signals
  (SIGRTMIN to SIGRTMAX), whose default is to end the process: a `signal_ignored` warning;
  pylon keeps running.
- SIGPIPE stays ignored (Python's default): a write to a closed socket is an error on that
  connection, never the end of the process.

`faulthandler` stays off: it runs every handler on a small alternate signal stack, and a burst
of different signals (each may interrupt the one before) overflows it: a SIGSEGV, measured
with the 38 signals above sent at once.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)
RELOAD = signal.SIGHUP
REPORT = (signal.SIGUSR1, signal.SIGUSR2)
IGNORED = (
    signal.SIGALRM,
    signal.SIGVTALRM,
    signal.SIGXCPU,
    signal.SIGXFSZ,
    signal.SIGIO,
    signal.SIGPWR,
    signal.SIGSTKFLT,
    *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
)
HANDLED: tuple[int, ...] = (*STOP, RELOAD, *REPORT, *IGNORED)


def signal_name(sig: int) -> str:
    """SIGHUP, ..., and SIGRTMIN+n for the real-time signals (no enum member of their own)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIGRTMIN+{sig - signal.SIGRTMIN}"


class Signals:
    """The signal handlers of one `pylon serve`. A stop signal sets `stop` (the graceful
    drain); one during the drain sets `force` (what still runs ends at once) and is remembered
    as `forced_by`. SIGHUP calls `on_reload`, SIGUSR1/2 `on_report`, once `serve` set them
    (a signal before that, while the listeners start, is said by `on_early`)."""

    def __init__(self, stop: asyncio.Event, force: asyncio.Event, say: Callable[..., None]) -> None:
        self.stop = stop
        self.force = force
        self.forced_by: signal.Signals | None = None  # the signal that cut the drain short
        self.on_reload: Callable[[signal.Signals], object] | None = None
        self.on_report: Callable[[signal.Signals], object] | None = None
        self._say = say  # a process event: (kind, **fields)

    def received(self, sig: int) -> None:
        if sig in STOP:
            self._stop(signal.Signals(sig))
        elif sig == RELOAD:
            self._then(self.on_reload, RELOAD, "reload")
        elif sig in REPORT:
            self._then(self.on_report, signal.Signals(sig), "status report")
        else:
            self._say("signal_ignored", signal=signal_name(sig), detail="pylon keeps running")

    def _stop(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            self.stop.set()
            return
        if self.forced_by is None:
            self.forced_by = sig
        self.force.set()

    def _then(
        self, action: Callable[[signal.Signals], object] | None, sig: signal.Signals, what: str
    ) -> None:
        if action is None:
            self._say("signal_ignored", signal=sig.name, detail=f"still starting: no {what}")
            return
        action(sig)

    @contextmanager
    def handled(self) -> Iterator[None]:
        """The handlers are installed in the running loop for the `with` block."""
        loop = asyncio.get_running_loop()
        installed = [sig for sig in HANDLED if self._install(loop, sig)]
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _install(self, loop: asyncio.AbstractEventLoop, sig: int) -> bool:
        """Whether `sig`'s handler is installed. The stop, reload and report signals must be;
        a signal to ignore may be one the runtime keeps for itself (valgrind and sanitizers
        take real-time signals: sigaction answers EINVAL), which then cannot reach pylon."""
        try:
            loop.add_signal_handler(sig, self.received, sig)
        except (OSError, RuntimeError):
            if sig not in IGNORED:
                raise
            return False
        return True

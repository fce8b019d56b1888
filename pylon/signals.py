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

From the first line of `pylon serve` until the event loop's handlers take over, `EarlySignals`
holds every signal above (imports, settings, the tokenizer's load can take seconds, and each
signal's default would end pylon silently meanwhile); the loop's handlers then act on them in
the order they came: a stop signal stops pylon as soon as it has started (nothing runs yet to
drain), SIGHUP and SIGUSR1/2 are said as `signal_ignored` (still starting).

`faulthandler` stays off: it runs every handler on a small alternate signal stack, and a burst
of different signals (each may interrupt the one before) overflows it: a SIGSEGV, measured
with the 38 signals above sent at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

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


def catch(
    loop: asyncio.AbstractEventLoop, sig: int, callback: Callable[..., object], *args: object
) -> None:
    """`callback(*args)` runs on `loop` once each time `sig` is caught: a Python-level handler
    that only schedules it (it may run between any two bytecodes, so it does nothing else;
    `call_soon_threadsafe` is what asyncio's own `Runner` calls from its SIGINT handler).

    Not `loop.add_signal_handler`: uvloop's (0.23) takes each signal from two sources, its
    wakeup pipe and its own Python-level handler, and runs the callback twice when the handler
    ran before the signal's byte reached the pipe (the C handler on another thread): measured
    as one duplicated line in about 15 bursts of the 38 signals, and a duplicated SIGTERM is a
    second one, which cuts the drain short. One source here: Python runs a signal's handler
    once per catch; `woken` makes the loop run it soon."""

    def caught(_sig: int, _frame: object) -> None:
        with suppress(RuntimeError):  # the loop has closed: the process is exiting
            loop.call_soon_threadsafe(callback, *args)

    signal.signal(sig, caught)
    signal.siginterrupt(sig, False)  # restart interrupted system calls, as asyncio's does


def release(sig: int) -> None:
    """`sig` back to its default action (Python's KeyboardInterrupt for SIGINT)."""
    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


@contextmanager
def woken(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """For the `with` block, `loop` wakes for every signal, whichever thread the kernel gave it
    to: the C-level handler writes the signal's number to a socket the loop reads
    (`signal.set_wakeup_fd`), and the loop then runs the Python-level handlers (`catch`) as it
    runs Python code. asyncio sets a wakeup socket only in `add_signal_handler`; without one,
    a signal caught on a helper thread (asyncio's child watcher's) would wait for the loop's
    next timer. The bytes are only drained: the handlers, not the bytes, say what came."""
    wake, woke = socket.socketpair()
    for end in (wake, woke):
        end.setblocking(False)
    loop.add_reader(woke.fileno(), _drain, woke)
    previous = signal.set_wakeup_fd(wake.fileno(), warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        loop.remove_reader(woke.fileno())
        wake.close()
        woke.close()


def _drain(sock: socket.socket) -> None:
    with suppress(BlockingIOError):  # drained
        while sock.recv(4096):
            pass


class EarlySignals:
    """Python-level handlers for `HANDLED`, from `install` until `Signals.handled` replaces them
    with the loop's: each signal is only remembered (a handler that did more could run inside
    any start-up code), to be acted on by `Signals.handled` (`take`)."""

    def __init__(self) -> None:
        self._pending: list[int] = []

    def install(self) -> None:
        for sig in HANDLED:
            try:
                signal.signal(sig, self._received)
            except (OSError, RuntimeError, ValueError):
                if sig not in IGNORED:
                    raise  # (as `Signals._install`: the runtime may keep a real-time signal)

    def _received(self, sig: int, _frame: object) -> None:
        self._pending.append(sig)

    def take(self) -> list[int]:
        """The signals received so far, each once, in the order they first came; forgotten
        here. Once: nothing runs yet that a second stop signal could cut short."""
        pending, self._pending = self._pending, []
        return list(dict.fromkeys(pending))


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
    def handled(self, early: EarlySignals | None = None) -> Iterator[None]:
        """The handlers are installed in the running loop for the `with` block; then the
        signals `early` held before are acted on, in order."""
        loop = asyncio.get_running_loop()
        installed: list[int] = []
        with woken(loop):
            try:
                for sig in HANDLED:
                    if self._install(loop, sig):
                        installed.append(sig)
                for sig in early.take() if early is not None else ():
                    self.received(sig)
                yield
            finally:  # (also those installed before one that could not be)
                for sig in installed:
                    release(sig)

    def _install(self, loop: asyncio.AbstractEventLoop, sig: int) -> bool:
        """Whether `sig`'s handler is installed. The stop, reload and report signals must be;
        a signal to ignore may be one the runtime keeps for itself (valgrind and sanitizers
        take real-time signals: sigaction answers EINVAL), which then cannot reach pylon."""
        try:
            catch(loop, sig, self.received, sig)
        except (OSError, RuntimeError, ValueError):
            if sig not in IGNORED:
                raise
            return False
        return True

"""`NativeOwner`: the one thread that builds, calls and shuts down the native SelectionService.

Threading model: one owner. The native object is built, called and shut down on a single
daemon thread running its own event loop ("router-ffi-owner"); no other thread touches it.
That is required as much as chosen: the 1.6.1 binding's async calls return futures of the
calling thread's running loop, so a synchronous caller (pylon's `Router.book`) cannot await
them in its own loop. Callers hand calls over with `loop.call_soon_threadsafe`:

- `submit` hands a call over and returns a `concurrent.futures.Future` of its parsed answer
  (`call` blocks on it, with a timeout);
- `submit_op` hands over one of a reservation's fire-and-forget calls (prefill-complete, output
  blocks, free): it returns at once, and the call runs on the owner in the order it was made
  (one reservation's calls are chained, through its `ReservationChain`; different
  reservations' calls overlap). Their failures go to `on_error`.

Lifecycle: every hand-over enters a `CallGate` first. `shutdown()` closes the gate, waits for
the calls in flight, and only then shuts the native core down and drops the handle, on the owner
thread. After it, `submit` raises `ServiceClosed` and `submit_op` is a silent no-op.

The facade over it, what callers use, is `router_ffi.service.SelectionCore`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

from router_ffi._native import NativeFactory, NativeService, translate
from router_ffi.errors import NativeCallFailed, NotFound, RouterFfiError, ServiceClosed
from router_ffi.gate import CallGate
from router_ffi.types import Selection, ShutdownReport

__all__ = [
    "FREE",
    "OUTPUT",
    "PREFILL",
    "ErrorSink",
    "NativeOwner",
    "ReservationChain",
]

T = TypeVar("T")
ErrorSink = Callable[[RouterFfiError], None]

# A reservation's fire-and-forget calls (`NativeOwner.submit_op`'s `kind`).
PREFILL: Final = 0
OUTPUT: Final = 1
FREE: Final = 2
_OP_NAMES: Final = ("prefill_complete", "output_block", "free")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pylon dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# One fire-and-forget call of a reservation: (kind, count, decay), as `submit_op` takes them.
Op = tuple[int, int, float | None]


class ReservationChain:
    """A reservation as the owner thread sees it: its selection, the reset epoch it was made
    in, and the chain that keeps its native calls in order (one pending at a time, the rest
    queued behind it). Only the owner thread calls these methods;
    `router_ffi.service.Reservation` adds the caller's side."""

    __slots__ = ("_busy", "_native_freed", "_queue", "epoch", "selection")

    def __init__(self, selection: Selection, epoch: int) -> None:
        self.selection = selection
        self.epoch = epoch  # the owner's reset epoch when the native select ran
        # The native free was issued; a native call is pending; calls queued behind it.
        self._native_freed = False
        self._busy = False
        self._queue: list[Op] | None = None

    @property
    def native_freed(self) -> bool:
        """The native free was issued: every later call of this reservation is a no-op."""
        return self._native_freed

    def mark_native_freed(self) -> None:
        """The native free is being issued now."""
        self._native_freed = True

    def defer(self, op: Op) -> bool:
        """Queue `op` behind this reservation's pending call; False when none is pending (the
        caller runs `op` now)."""
        if not self._busy:
            return False
        if self._queue is None:
            self._queue = []
        self._queue.append(op)
        return True

    def mark_pending(self) -> None:
        """A native call of this reservation was issued and has not landed yet."""
        self._busy = True

    def landed(self) -> Op | None:
        """The pending call landed: the next queued call, to run now (None: the chain is idle)."""
        self._busy = False
        return self.next_op()

    def next_op(self) -> Op | None:
        """The next queued call (None when none is queued), taken off the chain."""
        queue = self._queue
        return queue.pop(0) if queue else None


class NativeOwner:
    """Runs every call on one native SelectionService on its own thread, behind a `CallGate`.

    Builds the native object with `factory` on the owner thread (its failure is raised here,
    translated). `on_error` receives the failures of fire-and-forget calls (on the owner
    thread: keep it cheap and thread-safe; its own exceptions are swallowed).
    """

    def __init__(self, factory: NativeFactory, on_error: ErrorSink | None) -> None:
        self._on_error = on_error
        self._gate = CallGate()
        self._shutdown_lock = threading.Lock()
        self._report: ShutdownReport | None = None
        self.failed_ops = 0  # fire-and-forget native calls that failed (written on the owner)
        self.expired_ops = 0  # ... of a reservation the core had expired (not failures)
        # Owner-thread-only state.
        self._native: NativeService | None = None
        # Reset epochs (`mark_reset`): the latest, and per worker the one of its last reset.
        self.epoch = 0
        self._reset_epochs: dict[int, int] = {}
        self._waiting: set[cf.Future[Any]] = set()
        self._loop = _new_loop()
        self._thread = threading.Thread(
            target=self._owner_main, name="router-ffi-owner", daemon=True
        )
        self._thread.start()
        started: cf.Future[None] = cf.Future()
        self._loop.call_soon_threadsafe(self._owner_init, factory, started)
        try:
            started.result()
        except BaseException:
            self._gate.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise

    # -- state (any thread) -----------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Native calls handed over and not yet landed (fire-and-forget ones included)."""
        return self._gate.in_flight

    @property
    def closed(self) -> bool:
        return not self._gate.is_open

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no native call is in flight; False on timeout."""
        return self._gate.wait_idle(timeout_s)

    # -- hand-over (any thread) -------------------------------------------------------------

    def submit(
        self, op: str, invoke: Callable[[NativeService], Any], parse: Callable[[str, Any], T]
    ) -> cf.Future[T]:
        """Run `invoke(native)` on the owner (awaited there if it returns an awaitable), and
        settle the future with `parse(op, answer)` or the translated failure."""
        self._gate.enter()  # ServiceClosed after shutdown; while admitted, the loop runs
        cfut: cf.Future[T] = cf.Future()
        self._loop.call_soon_threadsafe(self._owner_call, op, invoke, parse, cfut)
        return cfut

    def call(
        self,
        op: str,
        invoke: Callable[[NativeService], Any],
        parse: Callable[[str, Any], T],
        timeout_s: float,
    ) -> T:
        """`submit`, blocking the calling thread for the answer (`NativeCallFailed` after
        `timeout_s`)."""
        cfut = self.submit(op, invoke, parse)
        try:
            return cfut.result(timeout_s)
        except TimeoutError:
            raise NativeCallFailed(
                op, "timeout", 504, f"no answer within {timeout_s:g} s"
            ) from None

    def submit_op(self, res: ReservationChain, kind: int, count: int, decay: float | None) -> None:
        """Queue one of `res`'s fire-and-forget calls (`kind`: PREFILL, OUTPUT of `count`
        blocks, FREE) behind its earlier ones; a no-op once shut down."""
        if self._gate.try_enter():  # closed: a no-op, by design
            self._loop.call_soon_threadsafe(self._owner_op, res, kind, count, decay)

    # -- lifecycle (any thread but the owner) -----------------------------------------------

    def shutdown(self, timeout_s: float) -> ShutdownReport:
        """Admit no more calls, wait up to `timeout_s` for those in flight, then shut the native
        core down and drop it on the owner thread. Idempotent (a second call returns the first
        report). Calls still in flight after the timeout get `ServiceClosed`."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("SelectionCore.shutdown() cannot run on its own owner thread")
        with self._shutdown_lock:
            if self._report is not None:
                return self._report
            self._gate.close()
            drained = self._gate.wait_idle(timeout_s)
            abandoned = 0 if drained else self._gate.in_flight
            stopped: cf.Future[None] = cf.Future()
            self._loop.call_soon_threadsafe(self._owner_stop, stopped)
            stopped.result()
            self._thread.join()
            if drained:  # nothing can call back into the loop any more
                self._loop.close()
            self._report = ShutdownReport(drained=drained, abandoned=abandoned)
            return self._report

    # -- owner thread -----------------------------------------------------------------------

    def mark_reset(self, worker_id: int) -> None:
        """On the owner thread, as a worker's reset begins: the reservations made on it before
        this point are forgotten (their later calls become no-ops), later ones are not."""
        self.epoch += 1
        self._reset_epochs[worker_id] = self.epoch

    def _owner_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _owner_init(self, factory: NativeFactory, started: cf.Future[None]) -> None:
        try:
            self._native = factory()
        except BaseException as exc:
            started.set_exception(translate("start", exc))
            return
        started.set_result(None)

    def _owner_call(
        self,
        op: str,
        invoke: Callable[[NativeService], Any],
        parse: Callable[[str, Any], Any],
        cfut: cf.Future[Any],
    ) -> None:
        native = self._native
        if native is None or not cfut.set_running_or_notify_cancel():  # cancelled before start
            if not cfut.done():
                cfut.set_exception(ServiceClosed("the selection core is shut down"))
            self._gate.exit()
            return
        self._waiting.add(cfut)
        try:
            raw = invoke(native)
        except BaseException as exc:
            self._settle(op, parse, cfut, None, exc)
            return
        if inspect.isawaitable(raw):
            asyncio.ensure_future(raw).add_done_callback(
                functools.partial(self._owner_landed, op, parse, cfut)
            )
        else:
            self._settle(op, parse, cfut, raw, None)

    def _owner_landed(
        self,
        op: str,
        parse: Callable[[str, Any], Any],
        cfut: cf.Future[Any],
        fut: asyncio.Future[Any],
    ) -> None:
        if fut.cancelled():
            self._settle(op, parse, cfut, None, asyncio.CancelledError())
        elif (exc := fut.exception()) is not None:
            self._settle(op, parse, cfut, None, exc)
        else:
            self._settle(op, parse, cfut, fut.result(), None)

    def _settle(
        self,
        op: str,
        parse: Callable[[str, Any], Any],
        cfut: cf.Future[Any],
        raw: object,
        exc: BaseException | None,
    ) -> None:
        self._waiting.discard(cfut)
        if not cfut.done():  # done: failed at shutdown after the drain timed out
            if exc is None:
                try:
                    cfut.set_result(parse(op, raw))
                except RouterFfiError as err:
                    cfut.set_exception(err)
            else:
                cfut.set_exception(translate(op, exc))
        self._gate.exit()

    def _owner_op(self, res: ReservationChain, kind: int, count: int, decay: float | None) -> None:
        if res.defer((kind, count, decay)):  # an earlier call is pending: keep the order
            return
        self._owner_run_ops(res, kind, count, decay)

    def _owner_run_ops(
        self, res: ReservationChain, kind: int, count: int, decay: float | None
    ) -> None:
        while True:
            if self._owner_start_op(res, kind, count, decay):
                return  # resumes in _owner_op_landed
            nxt = res.next_op()
            if nxt is None:
                return
            kind, count, decay = nxt

    def _owner_start_op(
        self, res: ReservationChain, kind: int, count: int, decay: float | None
    ) -> bool:
        """Issue one reservation call; True when it is pending (an awaitable)."""
        native = self._native
        if native is None or res.native_freed or self._forgotten(res):
            self._gate.exit()
            return False
        sid = res.selection.selection_id
        try:
            if kind == FREE:
                res.mark_native_freed()
                raw: object = native.free_reservation(sid)
            elif kind == PREFILL:
                raw = native.prefill_complete(sid)
            else:
                for _ in range(count):
                    native.add_output_block(sid, decay_fraction=decay)
                raw = None
        except BaseException as exc:
            self._owner_failed(_OP_NAMES[kind], exc)
            self._gate.exit()
            return False
        if not inspect.isawaitable(raw):
            self._gate.exit()
            return False
        res.mark_pending()
        asyncio.ensure_future(raw).add_done_callback(
            functools.partial(self._owner_op_landed, res, _OP_NAMES[kind])
        )
        return True

    def _forgotten(self, res: ReservationChain) -> bool:
        """The reservation predates its worker's last reset: the native core forgot it."""
        reset = self._reset_epochs.get(res.selection.worker_id)
        return reset is not None and res.epoch < reset

    def _owner_op_landed(self, res: ReservationChain, op: str, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self._owner_failed(op, asyncio.CancelledError())
        elif (exc := fut.exception()) is not None:
            self._owner_failed(op, exc)
        self._gate.exit()
        nxt = res.landed()
        if nxt is not None:
            self._owner_run_ops(res, *nxt)

    def _owner_failed(self, op: str, exc: BaseException) -> None:
        error = translate(op, exc)
        if isinstance(error, NotFound) and op in _OP_NAMES:
            # The core no longer knows the reservation: it expired it (a booking older than
            # DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS, a long stream's). Its load already left
            # the view; counted, not reported.
            self.expired_ops += 1
            return
        self.failed_ops += 1
        sink = self._on_error
        if sink is not None:
            with contextlib.suppress(Exception):  # a broken sink must not stop the owner loop
                sink(error)

    def _owner_stop(self, stopped: cf.Future[None]) -> None:
        native, self._native = self._native, None
        try:
            if native is not None:
                native.shutdown()
        except BaseException as exc:
            self._owner_failed("shutdown", exc)
        for cfut in self._waiting:
            if not cfut.done():
                cfut.set_exception(ServiceClosed("the selection core shut down during the call"))
        self._waiting.clear()
        del native  # the last reference: the native handle is dropped here, on the owner
        self._loop.stop()
        stopped.set_result(None)

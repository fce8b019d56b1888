"""`SelectionCore`: the one object pylon holds around Dynamo's native SelectionService.

Threading model: one owner. The native object is built, called and shut down on a single
daemon thread running its own event loop ("router-ffi-owner"); no other thread touches it.
That is required as much as chosen: the 1.6.1 binding's async calls return futures of the
calling thread's running loop, so a synchronous caller (pylon's `Router.book`) cannot await
them in its own loop. Callers hand calls over with `loop.call_soon_threadsafe`:

- catalog, selection, loads and overlap calls block the calling thread until the native answer
  is parsed (`select_and_reserve`; `select_and_reserve_async` awaits instead of blocking);
- a reservation's prefill-complete, output blocks and free are fire-and-forget: they return at
  once and run on the owner in the order they were made (one reservation's calls are chained;
  different reservations' calls overlap). Their failures go to `on_error`.

Lifecycle: every hand-over enters a `CallGate` first. `shutdown()` closes the gate, waits for
the calls in flight, and only then shuts the native core down and drops the handle, on the owner
thread. After it, selection raises `ServiceClosed`, and a reservation's free, prefill-complete
and output blocks are silent no-ops.

Per-request state (prefill done, output-token remainder, freed) lives on the `Reservation`
returned for that request, never on the shared core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import inspect
import itertools
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any, Final, TypeVar

from router_ffi import _wire
from router_ffi._native import NativeFactory, NativeService, native_factory, translate
from router_ffi.errors import (
    NativeCallFailed,
    NotFound,
    RouterFfiError,
    SelectionTimeout,
    ServiceClosed,
)
from router_ffi.gate import CallGate
from router_ffi.types import (
    DEFAULT_GROUP,
    GroupLoads,
    OverlapScores,
    Prompt,
    Selection,
    SelectRequest,
    ShutdownReport,
    WorkerRecord,
    WorkerSpec,
)
from router_ffi.validation import check_worker, check_worker_id

T = TypeVar("T")
ErrorSink = Callable[[RouterFfiError], None]

_PREFILL: Final = 0
_OUTPUT: Final = 1
_FREE: Final = 2
_OP_NAMES: Final = ("prefill_complete", "output_block", "free")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a pylon dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _free_if_reserved(cfut: cf.Future[Reservation]) -> None:
    """For a selection nobody waits for any more (timed out, cancelled): free what it booked."""
    if not cfut.cancelled() and cfut.exception() is None:
        cfut.result().free()


class Reservation:
    """One request's booking on the worker the core chose (its `selection`).

    Call `prefill_complete()` at the first output (or response head), `output_tokens(n)` as
    output is relayed (one native output block per `block_size` tokens), and `free()` on every
    exit path. All of them return at once (the native calls run on the owner thread, in order),
    and all are idempotent where that matters: a second prefill-complete or free is a no-op, and
    after `free()` or the core's shutdown every call is a no-op. Safe to call from any thread.
    A reservation made before its worker's `reset_worker` is forgotten by the native core: its
    later calls are no-ops too (its load left the core with the reset).
    """

    __slots__ = (
        "_busy",
        "_core",
        "_epoch",
        "_freed",
        "_native_freed",
        "_out_tokens",
        "_prefilled",
        "_queue",
        "selection",
    )

    def __init__(self, core: SelectionCore, selection: Selection, epoch: int = 0) -> None:
        self.selection = selection
        self._core = core
        self._epoch = epoch  # the core's reset epoch when the native select ran
        self._prefilled = False
        self._freed = False
        self._out_tokens = 0  # output tokens not yet making a full block
        # Owner-thread-only state: the native free was issued; a native call is pending; calls
        # queued behind it.
        self._native_freed = False
        self._busy = False
        self._queue: list[tuple[int, int, float | None]] | None = None

    @property
    def selection_id(self) -> str:
        return self.selection.selection_id

    @property
    def worker_id(self) -> int:
        return self.selection.worker_id

    @property
    def freed(self) -> bool:
        return self._freed

    def prefill_complete(self) -> None:
        """The booking's load moves from prefill to decode (first call only)."""
        if self._prefilled or self._freed:
            return
        self._prefilled = True
        self._core._submit_op(self, _PREFILL, 0, None)

    def output_block(self, decay_fraction: float | None = None) -> None:
        """One more decode output block (native `add_output_block`)."""
        if not self._freed:
            self._core._submit_op(self, _OUTPUT, 1, decay_fraction)

    def output_tokens(self, count: int) -> None:
        """`count` more output tokens: one output block per full `block_size` tokens so far."""
        if self._freed or count <= 0:
            return
        blocks, self._out_tokens = divmod(self._out_tokens + count, self.selection.block_size)
        if blocks:
            self._core._submit_op(self, _OUTPUT, blocks, None)

    def free(self) -> None:
        """Release the booking (first call only; a no-op after the core's shutdown)."""
        if self._freed:
            return
        self._freed = True
        self._core._submit_op(self, _FREE, 0, None)

    def _next(self) -> tuple[int, int, float | None] | None:
        queue = self._queue
        return queue.pop(0) if queue else None

    def __repr__(self) -> str:
        s = self.selection
        return (
            f"Reservation({s.selection_id!r}, worker={s.worker_id}, dp_rank={s.dp_rank}, "
            f"freed={self._freed})"
        )


OVERLAP_WEIGHT_ENV = "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT"


class SelectionCore:
    """The typed, thread-safe boundary around one native SelectionService.

    `native=None` builds Dynamo's own (raises `NativeUnavailable`, saying how to install it,
    when `ai-dynamo-runtime` is not importable); tests pass a factory for a fake.
    `on_error` receives the failures of fire-and-forget calls (on the owner thread: keep it
    cheap and thread-safe; its own exceptions are swallowed).
    """

    def __init__(
        self,
        *,
        indexer_threads: int = 2,
        select_timeout_s: float = 0.5,
        call_timeout_s: float = 10.0,
        on_error: ErrorSink | None = None,
        native: NativeFactory | None = None,
        overlap_score_weight: float | None = None,
    ) -> None:
        if indexer_threads < 1:
            raise ValueError(f"indexer_threads must be >= 1, got {indexer_threads}")
        if overlap_score_weight is not None:
            if not 0 <= overlap_score_weight < float("inf"):
                raise ValueError(f"overlap_score_weight must be >= 0, got {overlap_score_weight}")
            # The native core reads its cost weights from the environment when it is built (on
            # the owner thread, below), and offers no argument for them: one core per process.
            os.environ[OVERLAP_WEIGHT_ENV] = repr(float(overlap_score_weight))
        factory = native if native is not None else native_factory(indexer_threads)
        self._select_timeout_s = select_timeout_s
        self._call_timeout_s = call_timeout_s
        self._on_error = on_error
        self._gate = CallGate()
        self._ids = itertools.count(1)
        self._id_prefix = f"pylon-{secrets.token_hex(6)}-"
        self._shutdown_lock = threading.Lock()
        self._report: ShutdownReport | None = None
        self.failed_ops = 0  # fire-and-forget native calls that failed (written on the owner)
        # Owner-thread-only state.
        self._native: NativeService | None = None
        # Reset epochs (`reset_worker`): the latest, and per worker the one of its last reset.
        self._epoch = 0
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

    # -- catalog ----------------------------------------------------------------------------

    def upsert_worker(self, spec: WorkerSpec) -> WorkerRecord:
        """Add or replace a worker (validated first: `InvalidConfig`); the native core starts
        following its KV events. The record says whether it is schedulable yet."""
        check_worker(spec)
        payload = _wire.worker_to_native(spec)
        return self._call(
            "upsert_worker",
            lambda n: n.upsert_worker(payload),
            _wire.parse_record,
            self._call_timeout_s,
        )

    def remove_worker(self, worker_id: int) -> WorkerRecord:
        """Remove a worker (`NotFound` if unknown); its KV-event listener is torn down."""
        wid = check_worker_id(worker_id)
        return self._call(
            "remove_worker",
            lambda n: n.delete_worker(wid),
            _wire.parse_record,
            self._call_timeout_s,
        )

    def reset_worker(self, spec: WorkerSpec) -> WorkerRecord:
        """Drop everything the native core knows about a worker and start it afresh: its cache
        view (blocks heard from its KV events) and the load of its reservations go, and a new
        KV-event listener starts (native delete, then upsert, back to back on the owner thread).

        For a worker whose cache view can no longer be trusted (its KV-event sequence had a gap,
        or went back because the engine restarted). Reservations made on it before the reset
        become no-ops (the native core no longer knows them), so their later frees cannot fail.
        """
        check_worker(spec)
        wid = spec.worker_id
        payload = _wire.worker_to_native(spec)

        async def reset(native: NativeService) -> object:
            # Runs on the owner thread: a select that ran before this point made a reservation
            # the delete is about to forget, one that runs after it gets the new epoch.
            self._epoch += 1
            self._reset_epochs[wid] = self._epoch
            try:
                await native.delete_worker(wid)
            except Exception as exc:
                if not isinstance(translate("reset_worker", exc), NotFound):
                    raise
            return await native.upsert_worker(payload)

        return self._call("reset_worker", reset, _wire.parse_record, self._call_timeout_s)

    def workers(self) -> tuple[WorkerRecord, ...]:
        return self._call(
            "workers", lambda n: n.list_workers(), _wire.parse_records, self._call_timeout_s
        )

    # -- selection --------------------------------------------------------------------------

    def new_selection_id(self) -> str:
        """A fresh pylon-minted selection id (process-unique prefix + counter)."""
        return f"{self._id_prefix}{next(self._ids)}"

    def select_and_reserve(self, request: SelectRequest) -> Reservation:
        """Choose a worker for the prompt and book its load, blocking the calling thread until
        the native answer (median ~0.1 ms, see docs/routing.md). Raises `NoWorkerAvailable`
        (no schedulable worker; `SelectionTimeout` past `select_timeout_s`), `ServiceClosed`,
        `InvalidRequest` or `NativeCallFailed`. Free the returned reservation on every path."""
        cfut = self._submit_select(request)
        try:
            return cfut.result(self._select_timeout_s)
        except TimeoutError:
            cfut.add_done_callback(_free_if_reserved)
            raise SelectionTimeout("select_and_reserve", self._select_timeout_s) from None

    async def select_and_reserve_async(self, request: SelectRequest) -> Reservation:
        """`select_and_reserve` for a coroutine: awaits the owner's answer instead of blocking.
        If the caller is cancelled (or times out) meanwhile, a booking made anyway is freed."""
        cfut = self._submit_select(request)
        try:
            async with asyncio.timeout(self._select_timeout_s):
                return await asyncio.wrap_future(cfut)
        except TimeoutError:
            cfut.add_done_callback(_free_if_reserved)
            raise SelectionTimeout("select_and_reserve", self._select_timeout_s) from None
        except asyncio.CancelledError:
            cfut.add_done_callback(_free_if_reserved)
            raise

    def _submit_select(self, request: SelectRequest) -> cf.Future[Reservation]:
        selection_id = request.selection_id or self.new_selection_id()
        payload = _wire.select_to_native(request, selection_id)
        epoch = 0

        def invoke(native: NativeService) -> Any:  # on the owner thread
            nonlocal epoch
            epoch = self._epoch
            return native.select_and_reserve(payload)

        def reserve(op: str, raw: object) -> Reservation:
            return Reservation(self, _wire.parse_selection(op, raw), epoch)

        return self._submit("select_and_reserve", invoke, reserve)

    # -- inspection -------------------------------------------------------------------------

    def loads(self) -> tuple[GroupLoads, ...]:
        """Active load per model/routing group and worker rank (bookings not yet freed)."""
        return self._call("loads", lambda n: n.loads(), _wire.parse_loads, self._call_timeout_s)

    def overlap(
        self, prompt: Prompt, *, model_name: str = DEFAULT_GROUP, routing_group: str = DEFAULT_GROUP
    ) -> OverlapScores:
        """How many of the prompt's full blocks each worker holds (from the KV events seen)."""
        payload = _wire.overlap_to_native(prompt, model_name, routing_group)
        return self._call(
            "overlap",
            lambda n: n.overlap_scores(payload),
            _wire.parse_overlap,
            self._call_timeout_s,
        )

    @property
    def in_flight(self) -> int:
        """Native calls handed over and not yet landed (fire-and-forget ones included)."""
        return self._gate.in_flight

    @property
    def closed(self) -> bool:
        return not self._gate.is_open

    def quiesce(self, timeout_s: float = 5.0) -> bool:
        """Block until no native call is in flight (e.g. issued frees have landed); False on
        timeout. For tests and consistent snapshots, not for the request path."""
        return self._gate.wait_idle(timeout_s)

    # -- lifecycle --------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> ShutdownReport:
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

    def __enter__(self) -> SelectionCore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- hand-over (any thread) -------------------------------------------------------------

    def _submit(
        self, op: str, invoke: Callable[[NativeService], Any], parse: Callable[[str, Any], T]
    ) -> cf.Future[T]:
        self._gate.enter()  # ServiceClosed after shutdown; while admitted, the loop runs
        cfut: cf.Future[T] = cf.Future()
        self._loop.call_soon_threadsafe(self._owner_call, op, invoke, parse, cfut)
        return cfut

    def _call(
        self,
        op: str,
        invoke: Callable[[NativeService], Any],
        parse: Callable[[str, Any], T],
        timeout_s: float,
    ) -> T:
        cfut = self._submit(op, invoke, parse)
        try:
            return cfut.result(timeout_s)
        except TimeoutError:
            raise NativeCallFailed(
                op, "timeout", 504, f"no answer within {timeout_s:g} s"
            ) from None

    def _submit_op(self, res: Reservation, kind: int, count: int, decay: float | None) -> None:
        if self._gate.try_enter():  # closed: a no-op, by design
            self._loop.call_soon_threadsafe(self._owner_op, res, kind, count, decay)

    # -- owner thread -----------------------------------------------------------------------

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

    def _owner_op(self, res: Reservation, kind: int, count: int, decay: float | None) -> None:
        if res._busy:  # an earlier call of this reservation is pending: keep the order
            if res._queue is None:
                res._queue = []
            res._queue.append((kind, count, decay))
            return
        self._owner_run_ops(res, kind, count, decay)

    def _owner_run_ops(self, res: Reservation, kind: int, count: int, decay: float | None) -> None:
        while True:
            if self._owner_start_op(res, kind, count, decay):
                return  # resumes in _owner_op_landed
            nxt = res._next()
            if nxt is None:
                return
            kind, count, decay = nxt

    def _owner_start_op(self, res: Reservation, kind: int, count: int, decay: float | None) -> bool:
        """Issue one reservation call; True when it is pending (an awaitable)."""
        native = self._native
        if native is None or res._native_freed or self._forgotten(res):
            self._gate.exit()
            return False
        sid = res.selection.selection_id
        try:
            if kind == _FREE:
                res._native_freed = True
                raw: object = native.free_reservation(sid)
            elif kind == _PREFILL:
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
        res._busy = True
        asyncio.ensure_future(raw).add_done_callback(
            functools.partial(self._owner_op_landed, res, _OP_NAMES[kind])
        )
        return True

    def _forgotten(self, res: Reservation) -> bool:
        """The reservation predates its worker's last reset: the native core forgot it."""
        reset = self._reset_epochs.get(res.selection.worker_id)
        return reset is not None and res._epoch < reset

    def _owner_op_landed(self, res: Reservation, op: str, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self._owner_failed(op, asyncio.CancelledError())
        elif (exc := fut.exception()) is not None:
            self._owner_failed(op, exc)
        self._gate.exit()
        res._busy = False
        nxt = res._next()
        if nxt is not None:
            self._owner_run_ops(res, *nxt)

    def _owner_failed(self, op: str, exc: BaseException) -> None:
        self.failed_ops += 1
        sink = self._on_error
        if sink is not None:
            with contextlib.suppress(Exception):  # a broken sink must not stop the owner loop
                sink(translate(op, exc))

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

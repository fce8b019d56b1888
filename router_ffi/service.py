"""`SelectionCore`: the one object pylon holds around Dynamo's native SelectionService, and
`Reservation`, one request's booking on it.

The facade: typed calls in (validated), typed values out (`router_ffi.types`), one exception
hierarchy (`router_ffi.errors`). Every native call runs on the owner thread of a `NativeOwner`
(`router_ffi.owner`, which says why and how):

- catalog, selection, loads and overlap calls block the calling thread until the native answer
  is parsed (`select_and_reserve`; `select_and_reserve_async` awaits instead of blocking);
- a reservation's prefill-complete, output blocks and free are fire-and-forget: they return at
  once and run on the owner in the order they were made. Their failures go to `on_error`.

After `shutdown()`, selection raises `ServiceClosed`, and a reservation's free, prefill-complete
and output blocks are silent no-ops.

Per-request state (prefill done, output-token remainder, freed) lives on the `Reservation`
returned for that request, never on the shared core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import os
import secrets
from typing import Any

from router_ffi import _wire
from router_ffi._native import NativeFactory, NativeService, native_factory, translate
from router_ffi.errors import NotFound, SelectionTimeout
from router_ffi.owner import FREE, OUTPUT, PREFILL, ErrorSink, NativeOwner, ReservationChain
from router_ffi.types import (
    DEFAULT_GROUP,
    CoreWorker,
    GroupLoads,
    OverlapScores,
    Prompt,
    ReplicaSync,
    Selection,
    SelectRequest,
    ShutdownReport,
    WorkerRecord,
)
from router_ffi.validation import check_replica_sync, check_worker, check_worker_id

__all__ = ["EXPIRY_ENV", "OVERLAP_WEIGHT_ENV", "ErrorSink", "Reservation", "SelectionCore"]


def _free_if_reserved(cfut: cf.Future[Reservation]) -> None:
    """For a selection nobody waits for any more (timed out, cancelled): free what it booked."""
    if not cfut.cancelled() and cfut.exception() is None:
        cfut.result().free()


class Reservation(ReservationChain):
    """One request's booking on the worker the core chose (its `selection`).

    Call `prefill_complete()` at the first output (or response head), `output_tokens(n)` as
    output is relayed (one native output block per `block_size` tokens), and `free()` on every
    exit path. All of them return at once (the native calls run on the owner thread, in order),
    and all are idempotent where that matters: a second prefill-complete or free is a no-op, and
    after `free()` or the core's shutdown every call is a no-op. Safe to call from any thread.
    A reservation made before its worker's `reset_worker` is forgotten by the native core: its
    later calls are no-ops too (its load left the core with the reset).
    """

    __slots__ = ("_freed", "_out_tokens", "_owner", "_prefilled")

    def __init__(self, owner: NativeOwner, selection: Selection, epoch: int = 0) -> None:
        super().__init__(selection, epoch)
        self._owner = owner
        self._prefilled = False
        self._freed = False
        self._out_tokens = 0  # output tokens not yet making a full block

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
        self._owner.submit_op(self, PREFILL, 0, None)

    def output_block(self, decay_fraction: float | None = None) -> None:
        """One more decode output block (native `add_output_block`)."""
        if not self._freed:
            self._owner.submit_op(self, OUTPUT, 1, decay_fraction)

    def output_tokens(self, count: int) -> None:
        """`count` more output tokens: one output block per full `block_size` tokens so far."""
        if self._freed or count <= 0:
            return
        blocks, self._out_tokens = divmod(self._out_tokens + count, self.selection.block_size)
        if blocks:
            self._owner.submit_op(self, OUTPUT, blocks, None)

    def free(self) -> None:
        """Release the booking (first call only; a no-op after the core's shutdown)."""
        if self._freed:
            return
        self._freed = True
        self._owner.submit_op(self, FREE, 0, None)

    def __repr__(self) -> str:
        s = self.selection
        return (
            f"Reservation({s.selection_id!r}, worker={s.worker_id}, dp_rank={s.dp_rank}, "
            f"freed={self._freed})"
        )


OVERLAP_WEIGHT_ENV = "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT"
EXPIRY_ENV = "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS"


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
        replica_sync: ReplicaSync | None = None,
        active_request_expiry_s: float | None = None,
    ) -> None:
        if indexer_threads < 1:
            raise ValueError(f"indexer_threads must be >= 1, got {indexer_threads}")
        if overlap_score_weight is not None:
            if not 0 <= overlap_score_weight < float("inf"):
                raise ValueError(f"overlap_score_weight must be >= 0, got {overlap_score_weight}")
            # The native core reads its cost weights from the environment when it is built (on
            # the owner thread, below), and offers no argument for them: one core per process.
            os.environ[OVERLAP_WEIGHT_ENV] = repr(float(overlap_score_weight))
        if active_request_expiry_s is not None:
            if not 1 <= active_request_expiry_s < float("inf"):
                raise ValueError(
                    f"active_request_expiry_s must be >= 1, got {active_request_expiry_s}"
                )
            # Read the same way (and as whole seconds): how long a booking the core was never
            # told to free (a crashed replica's) lingers.
            os.environ[EXPIRY_ENV] = str(int(active_request_expiry_s))
        if replica_sync is not None:
            check_replica_sync(replica_sync)
        self.replica_sync = replica_sync
        factory = native if native is not None else native_factory(indexer_threads, replica_sync)
        self._select_timeout_s = select_timeout_s
        self._call_timeout_s = call_timeout_s
        self._ids = itertools.count(1)
        self._id_prefix = f"pylon-{secrets.token_hex(6)}-"
        self._owner = NativeOwner(factory, on_error)

    @property
    def failed_ops(self) -> int:
        """Fire-and-forget native calls that failed (their errors went to `on_error`)."""
        return self._owner.failed_ops

    @property
    def expired_ops(self) -> int:
        """Fire-and-forget calls of a reservation the native core had already expired (it
        forgets a booking `active_request_expiry_s` after its admission): no-ops, not
        failures."""
        return self._owner.expired_ops

    # -- catalog ----------------------------------------------------------------------------

    def upsert_worker(self, spec: CoreWorker) -> WorkerRecord:
        """Add or replace a worker (validated first: `InvalidConfig`); the native core starts
        following its KV events. The record says whether it is schedulable yet."""
        check_worker(spec)
        payload = _wire.worker_to_native(spec)
        return self._owner.call(
            "upsert_worker",
            lambda n: n.upsert_worker(payload),
            _wire.parse_record,
            self._call_timeout_s,
        )

    def remove_worker(self, worker_id: int) -> WorkerRecord:
        """Remove a worker (`NotFound` if unknown); its KV-event listener is torn down.

        Reservations made on it before the removal are forgotten as by `reset_worker`: their
        later calls (a request in flight that ends after its worker left the catalogue) are
        no-ops, never a `NotFound` from the native core."""
        wid = check_worker_id(worker_id)

        def remove(native: NativeService) -> object:
            self._owner.mark_reset(wid)  # on the owner thread, before the delete
            return native.delete_worker(wid)

        return self._owner.call("remove_worker", remove, _wire.parse_record, self._call_timeout_s)

    def reset_worker(self, spec: CoreWorker) -> WorkerRecord:
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
            self._owner.mark_reset(wid)
            try:
                await native.delete_worker(wid)
            except Exception as exc:
                if not isinstance(translate("reset_worker", exc), NotFound):
                    raise
            return await native.upsert_worker(payload)

        return self._owner.call("reset_worker", reset, _wire.parse_record, self._call_timeout_s)

    def workers(self) -> tuple[WorkerRecord, ...]:
        return self._owner.call(
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
            epoch = self._owner.epoch
            return native.select_and_reserve(payload)

        def reserve(op: str, raw: object) -> Reservation:
            return Reservation(self._owner, _wire.parse_selection(op, raw), epoch)

        return self._owner.submit("select_and_reserve", invoke, reserve)

    # -- inspection -------------------------------------------------------------------------

    def loads(self, *, timeout_s: float | None = None) -> tuple[GroupLoads, ...]:
        """Active load per model/routing group and worker rank (bookings not yet freed; with
        replica sync, the peers' too). `timeout_s`: how long to wait for the answer (default
        the core's call timeout), then `NativeCallFailed`."""
        return self._owner.call(
            "loads",
            lambda n: n.loads(),
            _wire.parse_loads,
            self._call_timeout_s if timeout_s is None else timeout_s,
        )

    def overlap(
        self, prompt: Prompt, *, model_name: str = DEFAULT_GROUP, routing_group: str = DEFAULT_GROUP
    ) -> OverlapScores:
        """How many of the prompt's full blocks each worker holds (from the KV events seen)."""
        payload = _wire.overlap_to_native(prompt, model_name, routing_group)
        return self._owner.call(
            "overlap",
            lambda n: n.overlap_scores(payload),
            _wire.parse_overlap,
            self._call_timeout_s,
        )

    @property
    def in_flight(self) -> int:
        """Native calls handed over and not yet landed (fire-and-forget ones included)."""
        return self._owner.in_flight

    @property
    def closed(self) -> bool:
        return self._owner.closed

    def quiesce(self, timeout_s: float = 5.0) -> bool:
        """Block until no native call is in flight (e.g. issued frees have landed); False on
        timeout. For tests and consistent snapshots, not for the request path."""
        return self._owner.wait_idle(timeout_s)

    # -- lifecycle --------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> ShutdownReport:
        """Admit no more calls, wait up to `timeout_s` for those in flight, then shut the native
        core down and drop it on the owner thread. Idempotent (a second call returns the first
        report). Calls still in flight after the timeout get `ServiceClosed`."""
        return self._owner.shutdown(timeout_s)

    def __enter__(self) -> SelectionCore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

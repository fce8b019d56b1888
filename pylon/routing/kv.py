"""`--routing kv`: the worker that holds the prompt's KV cache and is not overloaded, chosen by
Dynamo's native selection core (`router_ffi.SelectionCore`), booked for exactly the exchange.

At start (`pylon.routing.build.build_kv_router`) every worker is upserted into the core with its
KV-event endpoints (the core follows each engine's cache through them). Per request:

1. the prompt's token ids: the injected `PromptTokenizer` renders `/v1/completions` prompts and
   `/v1/chat/completions` messages exactly as the engine does (`prompt_tokens(path, body)` on
   the body pylon forwards: client steering fields already stripped), on the event loop for a
   body of up to `INLINE_TOKENIZE_BYTES`, else in the router's tokenizer thread;
2. `select_and_reserve` with a pylon-minted selection id, the workers in rotation only
   (`allowed_worker_ids`, rebuilt when health changes the set in rotation) and the cache salt from
   what pylon trusts (never the client: pylon strips every client `cache_salt`, `nvext.cache_salt`
   and `x-tenant-id`, so the engine hashes unsalted and so does the router, unless a trusted
   `salt` function is given);
3. the `KvBooking`: `first_output` -> the reservation's `prefill_complete`, `output_tokens` ->
   its `output_tokens` (one native output block per `block-size` tokens), `release` -> `free`.
   The forwarding `finally` releases it on every exit path; a release after the core's shutdown
   is a no-op.

Each worker's KV-event streams are followed by their sequence numbers (`kv_watch`): a gap or a
restart (the sequence going back) is logged (`kv_events_gap`), counted per worker and resets
that worker in the core (`SelectionCore.reset_worker`: its cache view and the load of its
bookings in flight go, so requests stop chasing blocks it may no longer hold; those bookings'
later calls become no-ops).

A catalogue change (`Fleet.replace`) reaches the core in order: a removed worker is filtered
out of `allowed_worker_ids` at once and then removed (`SelectionCore.remove_worker`: its load
and cache view go, its bookings' later calls are no-ops); an added one is upserted, and
allowed once the upsert landed and its health checks admit it.

A request with nothing to tokenize (another route, a GET, a body the tokenizer cannot read) is
booked least-loaded over the workers in rotation instead (counted in `KvRouter.fallbacks`), as is
one the core refuses for a reason other than load (counted in `errors`, reported). No worker in
rotation, or a native 503 (no schedulable worker), is `NoWorker`: 503, retryable.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pylon.core.body import with_token_data
from pylon.core.hooks import ExchangeHooks
from pylon.core.http import Header
from pylon.core.kv_events import SequenceCheck
from pylon.core.plan import ForwardPlan
from pylon.core.record import RequestRecord
from pylon.routing import Booking, NoWorker, PromptTokenizer, Router
from pylon.routing.fleet import AnswerReport, CatalogueChange, Fleet, Worker, count_decision
from pylon.routing.kv_watch import KvEventWatch
from pylon.routing.least_loaded import LeastLoadedRouter
from pylon.routing.round_robin import no_worker

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.observe import Observer
    from pylon.routing.token_data import TokenDataProver
    from router_ffi import CoreWorker, Reservation, SelectionCore

# The DP-rank pin pylon writes next to the worker, when the worker has several ranks: Dynamo's
# own header for an instance behind the frontend; for a worker's own URL, the header vLLM and
# SGLang read (and a Dynamo frontend reads as an alias). Both are in pylon's request deny-lists.
INSTANCE_RANK_HEADER = b"x-dynamo-dp-rank"
URL_RANK_HEADER = b"x-data-parallel-rank"
POLICY = "kv"
# Bodies up to this size are tokenized on the event loop; larger ones in the tokenizer thread
# (see `KvRouter._prompt_tokens`). 4 KiB: there a prompt seen before (segment cache hits) costs
# the loop about what the hop itself does (~0.08 ms), and a new one at most ~1 ms (~0.25 ms per
# KiB of multilingual chat); at 16 KiB a new one held it ~4 ms (docs/benchmarks.md, "Loop hold
# with large prompts").
INLINE_TOKENIZE_BYTES = 4 * 1024
# How long a scrape waits for the core's loads (a native call of ~0.1 ms behind the owner
# thread's queue): a busy or stuck core costs the scrape at most this.
CORE_LOADS_TIMEOUT_S = 0.25
# Select-and-reserve latency (seconds), as the event loop waits for it: ~0.12 ms typical.
SELECT_SECONDS_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0
)  # fmt: skip


class KvBooking(ExchangeHooks):
    """One exchange's reservation on the worker the core chose; its moments drive the
    reservation (`first_output` -> prefill complete, `output` -> output tokens, the terminal
    moment -> free)."""

    __slots__ = (
        "_passive",
        "_released",
        "_reservation",
        "_worker",
        "body",
        "headers",
        "upstream",
        "worker",
    )
    counts_output = True
    quiet = False

    def __init__(
        self,
        worker: Worker,
        reservation: Reservation,
        headers: tuple[Header, ...],
        body: bytes | None = None,
        passive: AnswerReport | None = None,
    ) -> None:
        self._worker = worker
        self._passive = passive
        self._reservation = reservation
        self.upstream = worker.upstream
        self.headers = headers
        self.body = body
        self.worker = worker.label
        self._released = False
        worker.active += 1
        count_decision(worker, POLICY)

    @property
    def reservation(self) -> Reservation:
        return self._reservation

    def response_head(self, record: RequestRecord) -> None:
        passive = self._passive
        if passive is not None:
            passive.answered(self._worker, record.status)

    def first_output(self, record: RequestRecord) -> None:
        self._reservation.prefill_complete()

    def output(self, record: RequestRecord, count: int) -> None:
        self._reservation.output_tokens(count)

    def complete(self, record: RequestRecord) -> None:
        """The exchange is over: free the reservation (idempotent; a no-op after the core's
        shutdown); the worker is judged by how the exchange ended (no head, a head and a broken
        body, a whole response)."""
        if not self._released:
            self._released = True
            self._worker.active -= 1
            self._reservation.free()
            passive = self._passive
            if passive is not None:
                if record.first_byte_at is None:
                    passive.unanswered(self._worker, record.outcome)
                else:
                    passive.ended(self._worker, record.status, record.outcome)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        """Released without the worker having seen the request (`Exchange.rebooked`)."""
        if not self._released:
            self._released = True
            self._worker.active -= 1
            self._reservation.free()
            passive = self._passive
            if passive is not None:
                passive.unanswered(self._worker, error.code.value)


class KvRouter:
    """The `kv` mode's router over one `SelectionCore` (see the module docstring)."""

    def __init__(
        self,
        core: SelectionCore,
        fleet: Fleet,
        tokenizer: PromptTokenizer,
        observer: Observer,
        *,
        salt: Callable[[ForwardPlan], str | None] | None = None,
        token_data: TokenDataProver | None = None,
    ) -> None:
        from router_ffi import (
            NoWorkerAvailable,
            RouterFfiError,
            SelectRequest,
            ServiceClosed,
            TokenPrompt,
        )

        self._core = core
        self._fleet = fleet
        self._tokenizer = tokenizer
        self._observer = observer
        self._salt = salt
        self.token_data = token_data  # --kv-token-data: which models may carry the ids
        self._select_request = SelectRequest
        self._token_prompt = TokenPrompt
        self._no_worker_errors: tuple[type[Exception], ...] = (NoWorkerAvailable, ServiceClosed)
        self._ffi_error = RouterFfiError
        self._by_id = {worker.spec.worker_id: worker for worker in fleet.workers}
        self._rank_headers = {
            worker.spec.worker_id: rank_headers(worker) for worker in fleet.workers
        }
        self._allowed: tuple[int, ...] | None = None
        # The worker ids the core knows (upserted, and not removed yet): a worker added by a
        # catalogue change is allowed only once its upsert landed, and the filter stays on
        # while the core still knows a removed worker.
        self._core_ids = {worker.spec.worker_id for worker in fleet.workers}
        self._catalogue_lock = asyncio.Lock()  # catalogue changes reach the core in order
        self._fallback = LeastLoadedRouter(fleet)
        # One thread: large prompts are tokenized one at a time, in arrival order, and never
        # take the threads of the loop's default executor.
        self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="pylon-tokenize")
        self.fallbacks = 0  # requests booked least-loaded: nothing to tokenize
        self.errors = 0  # requests booked least-loaded: the tokenizer or the core failed
        # Select latencies: one count per SELECT_SECONDS_BUCKETS bound, +Inf, then the sum.
        self.select_seconds: list[float] = [0] * (len(SELECT_SECONDS_BUCKETS) + 1) + [0.0]
        fleet.on_change(self._refilter)
        fleet.on_catalogue(self._catalogue_changed)
        self.watch = KvEventWatch(fleet.workers, self.stream_stale, observer)
        self._tasks: set[asyncio.Task[None]] = set()
        self._resetting: set[Worker] = set()  # a reset is running
        self._reset_again: set[Worker] = set()  # another stale report came in meanwhile
        self.resets = 0  # resets done

    @property
    def catalogue_digest(self) -> str:
        """What replicas sharing bookings must agree on (--replica-peer): logged and exposed;
        it follows catalogue reloads."""
        return self._fleet.digest

    @property
    def core(self) -> SelectionCore:
        return self._core

    def core_active(self) -> dict[str, int]:
        """Requests the selection core counts on each worker (label -> count, every rank):
        this pylon's bookings plus, with replica sync, every peer's it heard. Read at scrape
        time, on the event loop: waits at most `CORE_LOADS_TIMEOUT_S` for the owner thread
        (empty when it did not answer in time or the core is shut down)."""
        try:
            groups = self._core.loads(timeout_s=CORE_LOADS_TIMEOUT_S)
        except self._ffi_error:
            return {}
        by_id = self._by_id
        out = {worker.label: 0 for worker in self._fleet.workers}
        for group in groups:
            for load in group.workers:
                worker = by_id.get(load.worker_id)
                if worker is not None:
                    out[worker.label] += load.active_requests
        return out

    def _refilter(self) -> None:
        """The ids the core may choose: the workers in rotation it knows; None (no filter)
        when that is every worker the core knows."""
        core_ids = self._core_ids
        allowed = tuple(
            w.spec.worker_id for w in self._fleet.in_rotation if w.spec.worker_id in core_ids
        )
        self._allowed = None if len(allowed) == len(core_ids) else allowed

    def _catalogue_changed(self, change: CatalogueChange) -> None:
        """A catalogue change: the removed workers leave the core's choice at once (filtered
        out, then removed from the core: their bookings' load goes, their late frees are
        no-ops), the added ones are upserted (allowed once that landed and their health
        checks pass), and the KV-event watch follows the new endpoints."""
        for worker in change.removed:
            wid = worker.spec.worker_id
            self._by_id.pop(wid, None)
            self._rank_headers.pop(wid, None)
        for worker in change.added:
            wid = worker.spec.worker_id
            self._by_id[wid] = worker
            self._rank_headers[wid] = rank_headers(worker)
        self._refilter()
        self.watch.update(change)
        self._spawn(self._apply_to_core(change), "pylon-kv-catalogue")

    async def _apply_to_core(self, change: CatalogueChange) -> None:
        async with self._catalogue_lock:
            for worker in change.removed:
                wid = worker.spec.worker_id
                try:
                    await asyncio.to_thread(self._core.remove_worker, wid)
                except self._ffi_error as exc:
                    self._failed("remove_worker", str(exc))
                else:
                    self._core_ids.discard(wid)  # a changed spec is upserted back below
                    self._refilter()
            for worker in change.added:
                if worker.removed:
                    continue  # a later change removed it again
                try:
                    record = await asyncio.to_thread(self._core.upsert_worker, native_spec(worker))
                except self._ffi_error as exc:
                    self._failed("upsert_worker", f"{worker.label}: {exc}")
                    continue
                if not worker.removed:
                    self._core_ids.add(worker.spec.worker_id)
                    self._refilter()
                if not record.schedulable:
                    reasons = ", ".join(record.not_schedulable_reasons) or record.lifecycle
                    self._failed("upsert_worker", f"{worker.label}: not schedulable ({reasons})")

    async def book(self, plan: ForwardPlan) -> Booking:
        if not self._fleet.in_rotation:
            raise no_worker(self._fleet)
        token_data = self.token_data
        carry = token_data is not None and plan.model in token_data.proven
        prompt = await self._prompt_tokens(plan, carry)
        if prompt is None:
            return self._fallback.choose()
        tokens, body = prompt
        salt = self._salt(plan) if self._salt is not None else None
        booking = self.book_tokens(tokens, salt, body)
        if token_data is not None and not carry:
            token_data.want(plan.model)
        return booking

    def choose_by_load(self) -> Booking:
        """A booking by load alone (a request with no prompt to route by), least-loaded."""
        self.fallbacks += 1
        return self._fallback.choose()

    def book_tokens(
        self, tokens: Sequence[int], salt: str | None, body: bytes | None = None
    ) -> Booking:
        """Select and reserve for prompt `tokens` (with the trusted cache `salt`), at once:
        the core's answer is waited for on this thread (~0.1 ms), so bookings made one after
        another each see every earlier one (the booking authority relies on it). Raises
        `NoWorker`; a core failure books least-loaded instead."""
        if not self._fleet.in_rotation:
            raise no_worker(self._fleet)
        core = self._core
        request = self._select_request(
            self._token_prompt(tokens, cache_salt=salt),
            selection_id=core.new_selection_id(),
            allowed_worker_ids=self._allowed,
        )
        started = time.perf_counter()
        try:
            reservation = core.select_and_reserve(request)
        except self._no_worker_errors as exc:
            raise NoWorker(f"no engine worker can take the request now: {exc}") from None
        except self._ffi_error as exc:
            self._failed("select_and_reserve", str(exc))
            return self._fallback.choose()
        elapsed = time.perf_counter() - started
        latencies = self.select_seconds
        latencies[bisect_left(SELECT_SECONDS_BUCKETS, elapsed)] += 1
        latencies[-1] += elapsed
        wid = reservation.worker_id
        worker = self._by_id.get(wid)
        if worker is None:  # the core only knows the workers upserted from the same fleet
            reservation.free()
            self._failed("select_and_reserve", f"the core chose an unknown worker {wid}")
            return self._fallback.choose()
        headers = worker.headers
        ranks = self._rank_headers[wid]
        if ranks:
            headers = headers + ranks[reservation.selection.dp_rank]
        return KvBooking(worker, reservation, headers, body, self._fleet.passive)

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        """Least-loaded over the other workers: the move is rare, and the prompt's cache
        view was the failed worker's."""
        return self._fallback.elsewhere(plan, failed)

    async def _prompt_tokens(
        self, plan: ForwardPlan, carry: bool
    ) -> tuple[list[int], bytes | None] | None:
        """The prompt's token ids and, with `carry` (`--kv-token-data`, a proven model), the
        body carrying them; None to book least-loaded (nothing to route by).

        A body of `INLINE_TOKENIZE_BYTES` or less is tokenized on the event loop (at most about
        a millisecond: a thread hop would cost a good part of it); a larger one in the router's
        tokenizer thread, so that a 1 MiB prompt (a quarter of a second of rendering and
        encoding) never holds the loop; the encode releases the GIL (see `pylon.tokenize`). The
        token-data body is built in the same call: re-encoding a quarter of a million ids and
        copying the body costs milliseconds too.
        """
        path = plan.target.partition("?")[0]
        if len(plan.body) <= INLINE_TOKENIZE_BYTES:
            tokens, body = self._tokenize(path, plan.body, carry)
        else:
            tokens, body = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_thread, self._tokenize, path, plan.body, carry
            )
        if isinstance(tokens, Exception):  # the tokenizer's bug must not fail the request
            self._failed("tokenize", f"{type(tokens).__name__}")
            return None
        if not tokens:
            self.fallbacks += 1
            return None
        return tokens, body

    def _tokenize(
        self, path: str, body: bytes, carry: bool
    ) -> tuple[list[int] | Exception | None, bytes | None]:
        """`_prompt_tokens`' work, on the loop or in the tokenizer thread: the ids (or the
        tokenizer's exception) and, with `carry`, the body carrying them."""
        try:
            tokens = self._tokenizer.prompt_tokens(path, body)
        except Exception as exc:
            return exc, None
        if carry and tokens:
            return tokens, with_token_data(body, tokens)
        return tokens, None

    def start(self) -> None:
        """Follow every worker's KV-event streams (in the running loop) until `aclose`."""
        if not self._tasks:
            self._spawn(self.watch.run(), "pylon-kv-event-watch")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stream_stale(self, worker: Worker, endpoint: str, check: SequenceCheck) -> None:
        """A worker's KV-event stream lost messages or went back: its cache view in the core
        can no longer be trusted. Log, count, and reset it there (once more if another report
        comes in while a reset runs). Nothing for a worker that left the catalogue."""
        if worker.removed:
            return
        faults = worker.kv_faults
        faults[check.kind] = faults.get(check.kind, 0) + 1
        self._observer.process_event(
            "kv_events_gap",
            worker=worker.label,
            endpoint=endpoint,
            kind=check.kind,
            expected=check.expected,
            received=check.received,
            missed=check.missed,
            active=worker.active,
        )
        if worker in self._resetting:
            self._reset_again.add(worker)
        else:
            self._resetting.add(worker)
            self._spawn(self._reset(worker), "pylon-kv-reset")

    async def _reset(self, worker: Worker) -> None:
        try:
            while True:
                self._reset_again.discard(worker)
                try:
                    # In order with the catalogue changes: a reset never lands after the
                    # removal of its worker (it would upsert it back into the core).
                    async with self._catalogue_lock:
                        if worker.removed:
                            return
                        spec = native_spec(worker)
                        record = await asyncio.to_thread(self._core.reset_worker, spec)
                except self._ffi_error as exc:
                    self._failed("reset_worker", str(exc))
                else:
                    self.resets += 1
                    self._observer.process_event(
                        "kv_view_reset",
                        worker=worker.label,
                        lifecycle=record.lifecycle,
                        reasons=list(record.not_schedulable_reasons),
                    )
                if worker not in self._reset_again:
                    return
        finally:
            self._resetting.discard(worker)

    def _failed(self, op: str, detail: str) -> None:
        self.errors += 1
        self._observer.process_event("kv_routing_failed", op=op, detail=detail)

    async def aclose(self) -> None:
        """Stop following the KV-event streams, then shut the selection core down (its
        in-flight native calls finish first); bookings released afterwards are no-ops."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        if self.token_data is not None:
            await self.token_data.aclose()
        report = await asyncio.to_thread(self._core.shutdown)
        self._observer.process_event(
            "kv_router_stopped", drained=report.drained, abandoned=report.abandoned
        )


def rank_headers(worker: Worker) -> tuple[tuple[Header, ...], ...]:
    """Per DP rank, the rank pin (none for a single-rank worker)."""
    if worker.spec.dp_size == 1:
        return ()
    name = URL_RANK_HEADER if worker.spec.url is not None else INSTANCE_RANK_HEADER
    return tuple(((name, str(rank).encode("ascii")),) for rank in range(worker.spec.dp_size))


def native_spec(worker: Worker) -> CoreWorker:
    """The worker as the selection core knows it."""
    from router_ffi import CoreWorker

    spec = worker.spec
    return CoreWorker(
        worker_id=spec.worker_id,
        endpoint=worker.label,
        block_size=spec.block_size,
        kv_events=spec.kv_events,
        dp_size=spec.dp_size,
    )


_: type[Router] = KvRouter
__: type[Booking] = KvBooking

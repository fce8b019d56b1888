"""The queue gate: refuse, before the engine sees it, a request that would clearly queue
longer here than the gateway expected when it chose this node.

The gateway routes on load figures that may be stale (or shared with other gateways) and sends
its expectation in `x-stargate-expected-queue-ms`. pylon keeps a live table of the requests it
has taken per model, turns the input work ahead of a request into milliseconds with an
input-throughput estimate, and answers 429 `queue_estimate_mismatch` (retryable) when

    local estimate > max(expected + min_delta_ms, ceil(expected * factor))

(equal is accepted), so the gateway can retry another node at once. No estimate (no throughput
observed and no `--initial-input-tps`) admits. Pure: no clock (times are passed in), no I/O, no
settings.

Per model, an entry is in one phase:

- pending: taken, no response head from the engine yet (waiting for a connection, or queued in
  the engine). Counted by scheduling level: the work at the request's level or a lower one.
- prefill: the response head came, no output yet: the engine is working on it, ahead of everyone.
- decode: the first output came (for a response that is not an event stream, its head): no
  input work is left.

Every entry leaves, exactly once, with its exchange's terminal moment (success, error, timeout,
cancel, a rejection), from any phase.
The scheduling level is the adapter's `queue_level` (`pylon.core.priority`): the order the engine
serves the priority pylon writes, normalised so that lower runs first; one level for all when the
engine is told no priority (passthrough, `--no-derive-priority`).

Input tokens of a request: `x-input-tokens` when the gateway sent it, else the body size over
`BYTES_PER_TOKEN` (cheap, and the same unit on both sides of the division). Either is bounded by
the body: the proxy refuses a claim above `pylon.core.contract.check_input_tokens`' bound before
the request gets here.

Input throughput, per model: the input tokens of the requests whose first output marks the end of
their prefill (event streams; embeddings at their response head), over the time at least one of
them was between dispatch and first output: the union of their prefill intervals, so concurrent
prefills are not counted twice, as the reference's later fallback does. A sample is one busy
period (or `MAX_SAMPLE_BUSY_S` of one that goes on), once it holds `MIN_SAMPLE_BUSY_S` and some
tokens, so prefills that end together fall in one sample; the estimate is the median of the rates
of the last `WINDOW` samples (`median_tps`), from the `MIN_SAMPLES`th on; before that,
`initial_tps` (or unknown). A request's tokens fall in one sample only, and every sample weighs the
same whatever its length, so fewer than half the window's samples (requests claiming far from
their real work, low or high, prefills the engine held for a minute) cannot move the estimate
beyond the rates of the others: they can neither zero the estimates nor blow them up. (A ratio of
sums would let one long sample outweigh all the others: two requests claiming 1 token each over
a held prefill made every gateway request look minutes late.)
A busy period that ends without any output (the only request in it failed or was cancelled) is
dropped, not counted as time without work.

Cost per request: one `QueueEntry`, O(1) per lifecycle event, O(live levels) for a decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from pylon.core.contract import TunnelRequest
from pylon.core.errors import PylonError, QueueMismatchError
from pylon.core.hooks import ExchangeHooks
from pylon.core.priority import PriorityAdapter
from pylon.core.record import RequestRecord
from pylon.core.values import static_frozen

BYTES_PER_TOKEN = 4  # body bytes per input token, when the gateway sent no x-input-tokens
MIN_SAMPLES = 5  # samples before the measured throughput replaces the initial one (the median
# of five: two outliers cannot move it)
WINDOW = 8  # samples the estimate is taken over
MIN_SAMPLE_BUSY_S = 0.010  # busy time a sample needs at least
MAX_SAMPLE_BUSY_S = 1.0  # a busy period that goes on is cut into samples of about this much
DEFAULT_MAX_MODELS = 1024  # models tracked at once; requests for others are unknown (admitted)
PREFILL_ONLY_PATHS = frozenset({"/v1/embeddings"})  # the response head ends their prefill
_MAX_MS = 2**63 - 1  # estimates are capped here (a tiny throughput cannot overflow them)


def median_tps(tokens: list[float], busy: list[float]) -> float:
    """The throughput of samples (`tokens[i]` input tokens over `busy[i]` > 0 seconds, at least
    one): the median of their rates (of the two middle ones for an even count). Each sample
    counts once, however long it is, so fewer than half of them cannot carry it past the
    others' rates, whatever they say."""
    rates = sorted(t / b for t, b in zip(tokens, busy, strict=True))
    middle = len(rates) // 2
    if len(rates) % 2:
        return rates[middle]
    return (rates[middle - 1] + rates[middle]) / 2


def queue_ms(tokens: int, tps: float) -> int:
    """Milliseconds to process `tokens` input tokens at `tps` tokens per second, rounded up."""
    if tokens <= 0:
        return 0
    ms = tokens * 1000 / tps
    return math.ceil(ms) if ms < _MAX_MS else _MAX_MS


class Result(StrEnum):
    """A queue-gate decision, as reported to the observer (and counted in metrics)."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    UNKNOWN_ESTIMATE = "unknown_estimate"  # no throughput known yet: admitted
    DISABLED = "disabled"  # --no-queue-admission: admitted whatever the estimate


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    enabled: bool = True
    min_delta_ms: int = 25
    factor: float = 1.25
    retry_after_ms: int | None = None  # sent as x-stargate-retry-after-ms on a rejection

    def __post_init__(self) -> None:
        if self.min_delta_ms < 0:
            raise ValueError(f"min_delta_ms must be >= 0, got {self.min_delta_ms}")
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"factor must be finite and >= 1, got {self.factor}")

    def threshold_ms(self, expected_ms: int) -> int:
        """The largest local estimate still accepted for the gateway's `expected_ms`."""
        return max(expected_ms + self.min_delta_ms, math.ceil(expected_ms * self.factor))


# One per request that carries the header: frozen for mypy, no run-time freeze (see
# `pylon.core.values`).
@static_frozen
class QueueDecision:
    """One decision on a request that carried `x-stargate-expected-queue-ms`."""

    result: Result
    model: str
    level: int
    expected_ms: int
    estimate_ms: int | None  # the local estimate; None when unknown
    threshold_ms: int

    @property
    def rejected(self) -> bool:
        return self.result is Result.REJECTED

    def error(self, request_id: str | None, retry_after_ms: int | None) -> QueueMismatchError:
        assert self.estimate_ms is not None
        return QueueMismatchError(
            f"the local queue estimate for this request is {self.estimate_ms} ms, above "
            f"{self.threshold_ms} ms (the gateway expected {self.expected_ms} ms); retry on "
            "another node",
            expected_queue_ms=self.expected_ms,
            actual_queue_ms=self.estimate_ms,
            threshold_ms=self.threshold_ms,
            retry_after_ms=retry_after_ms,
            request_id=request_id,
        )


# An entry's phase (plain ints: this is read on every lifecycle event).
PENDING = 0
PREFILL = 1
DECODE = 2
GONE = 3  # released, or refused (never in the table)


class ModelQueue:
    """One model's live requests by phase, and its input-throughput estimate."""

    __slots__ = (
        "_busy_acc",
        "_busy_count",
        "_busy_mark",
        "_next",
        "_ring_busy",
        "_ring_tokens",
        "_samples",
        "_tokens_acc",
        "decode",
        "decode_tokens",
        "input_tps",
        "model",
        "pending",
        "prefill",
        "prefill_tokens",
        "tracked",
    )

    def __init__(self, model: str, initial_tps: float | None, tracked: bool = True) -> None:
        self.model = model
        self.tracked = tracked  # False: the overflow queue of untracked models (no estimates)
        self.pending: dict[int, list[int]] = {}  # level -> [requests, input tokens]
        self.prefill = 0
        self.prefill_tokens = 0
        self.decode = 0
        self.decode_tokens = 0  # input tokens of the requests in decode (the snapshot's total)
        # Throughput: tokens per second, None while unknown.
        self.input_tps: float | None = initial_tps if tracked else None
        self._busy_count = 0  # sampled requests between dispatch and first output
        self._busy_mark = 0.0  # busy time is counted up to here
        self._busy_acc = 0.0  # busy seconds not in a sample yet
        self._tokens_acc = 0  # their input tokens
        self._ring_tokens = [0.0] * WINDOW
        self._ring_busy = [0.0] * WINDOW
        self._next = 0
        self._samples = 0

    # --- the table ---
    def work_ahead(self, level: int) -> int:
        """Input tokens ahead of a new request at `level`: everything in prefill, and what is
        pending at the same or a lower level."""
        work = self.prefill_tokens
        for pending_level, slot in self.pending.items():
            if pending_level <= level:
                work += slot[1]
        return work

    def estimate_ms(self, level: int) -> int | None:
        """The local queue estimate for a new request at `level`; None when unknown."""
        if self.input_tps is None:
            return None
        return queue_ms(self.work_ahead(level), self.input_tps)

    @property
    def pending_count(self) -> int:
        return sum(slot[0] for slot in self.pending.values())

    @property
    def pending_tokens(self) -> int:
        return sum(slot[1] for slot in self.pending.values())

    def _add_pending(self, level: int, tokens: int) -> None:
        slot = self.pending.get(level)
        if slot is None:
            self.pending[level] = [1, tokens]
        else:
            slot[0] += 1
            slot[1] += tokens

    def _remove_pending(self, level: int, tokens: int) -> None:
        slot = self.pending[level]
        if slot[0] == 1:
            del self.pending[level]
        else:
            slot[0] -= 1
            slot[1] -= tokens

    # --- throughput ---
    def _advance(self, now: float) -> None:
        if self._busy_count and now > self._busy_mark:
            self._busy_acc += now - self._busy_mark
            self._busy_mark = now

    def _start_busy(self, now: float) -> None:
        self._advance(now)
        if not self._busy_count:
            self._busy_mark = now
        self._busy_count += 1

    def _stop_busy(self, now: float, tokens: int) -> None:
        self._advance(now)
        self._busy_count -= 1
        self._tokens_acc += tokens
        if not self._tokens_acc:
            if not self._busy_count:
                self._busy_acc = 0.0  # a busy period with no output at all: not a sample
            return
        busy = self._busy_acc
        if busy >= MIN_SAMPLE_BUSY_S and (not self._busy_count or busy >= MAX_SAMPLE_BUSY_S):
            self._add_sample(self._tokens_acc, self._busy_acc)
            self._tokens_acc = 0
            self._busy_acc = 0.0

    def _add_sample(self, tokens: int, busy: float) -> None:
        self._ring_tokens[self._next] = float(tokens)
        self._ring_busy[self._next] = busy
        self._next = (self._next + 1) % WINDOW
        self._samples += 1
        if self._samples >= MIN_SAMPLES:
            # Only the slots filled so far (the ring fills from the first one).
            held = min(self._samples, WINDOW)
            self.input_tps = median_tps(self._ring_tokens[:held], self._ring_busy[:held])

    @property
    def samples(self) -> int:
        """Throughput samples taken so far."""
        return self._samples


class QueueEntry(ExchangeHooks):
    """One request's place in its model's table, from the queue gate to the exchange's end:
    it subscribes to the exchange's moments (`pylon.core.record`), which move it through the
    phases, and leaves with the terminal one."""

    __slots__ = ("_busy", "_queue", "_sampled", "decision", "level", "phase", "tokens")

    def __init__(
        self,
        queue: ModelQueue,
        level: int,
        tokens: int,
        sampled: bool,
        decision: QueueDecision | None,
    ) -> None:
        self._queue = queue
        self.level = level
        self.tokens = tokens
        self._sampled = sampled  # its first output marks the end of its prefill
        self._busy = False  # counted in the model's busy time
        self.decision = decision
        if decision is not None and decision.rejected:
            self.phase = GONE  # never in the table
        else:
            self.phase = PENDING
            queue._add_pending(level, tokens)

    def dispatched(self, record: RequestRecord) -> None:
        """The request was written to the engine: its prefill interval starts."""
        if self._sampled and not self._busy and self.phase != GONE:
            self._busy = True
            assert record.dispatched_at is not None
            self._queue._start_busy(record.dispatched_at)

    def response_head(self, record: RequestRecord) -> None:
        """The engine's response head arrived: the engine is working on it."""
        if self.phase == PENDING:
            queue = self._queue
            # `_remove_pending`, inlined: once per request.
            slot = queue.pending[self.level]
            if slot[0] == 1:
                del queue.pending[self.level]
            else:
                slot[0] -= 1
                slot[1] -= self.tokens
            queue.prefill += 1
            queue.prefill_tokens += self.tokens
            self.phase = PREFILL

    def first_output(self, record: RequestRecord) -> None:
        """The first output (or, for a response that is not an event stream, its head).
        `record.ends_prefill`: it ended a successful prefill, so it measures throughput."""
        phase = self.phase
        if phase >= DECODE:  # DECODE or GONE
            return
        queue = self._queue
        if phase == PENDING:
            queue._remove_pending(self.level, self.tokens)
        else:
            queue.prefill -= 1
            queue.prefill_tokens -= self.tokens
        queue.decode += 1
        queue.decode_tokens += self.tokens
        self.phase = DECODE
        if self._busy:
            self._busy = False
            assert record.first_output_at is not None
            queue._stop_busy(record.first_output_at, self.tokens if record.ends_prefill else 0)

    def complete(self, record: RequestRecord, error: PylonError | None = None) -> None:
        """The exchange is over, however it ended: the entry leaves. Idempotent."""
        phase = self.phase
        if phase == GONE:
            return
        queue = self._queue
        if phase == PENDING:
            queue._remove_pending(self.level, self.tokens)
        elif phase == PREFILL:
            queue.prefill -= 1
            queue.prefill_tokens -= self.tokens
        else:
            queue.decode -= 1
            queue.decode_tokens -= self.tokens
        self.phase = GONE
        if self._busy:
            self._busy = False
            assert record.done_at is not None
            queue._stop_busy(record.done_at, 0)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        """pylon answered the request itself: the entry leaves the same way."""
        self.complete(record, error)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """One model's table, read at one instant (for metrics)."""

    model: str
    input_tps: float | None  # None: unknown
    pending: int
    pending_tokens: int
    prefill: int
    prefill_tokens: int
    decode: int
    # (level, local queue estimate in ms) for every level with pending requests, ascending;
    # empty while the throughput is unknown. A new request at a level between two listed ones
    # gets the lower one's estimate; below all of them, the prefill work alone (`idle_ms`).
    estimates_ms: tuple[tuple[int, int], ...]
    idle_ms: int | None  # the estimate with nothing pending ahead: prefill work only
    decode_tokens: int = 0  # input tokens of the requests in decode (no input work left)


class QueueTable:
    """The live request tables of every model, keyed by `x-model`."""

    def __init__(
        self, initial_tps: float | None = None, max_models: int = DEFAULT_MAX_MODELS
    ) -> None:
        if initial_tps is not None and not (math.isfinite(initial_tps) and initial_tps > 0):
            raise ValueError(f"initial_tps must be finite and > 0, got {initial_tps}")
        self._initial_tps = initial_tps
        self._max_models = max_models
        self._models: dict[str, ModelQueue] = {}
        # Requests for models beyond `max_models` are counted nowhere that is read.
        self._overflow = ModelQueue("", None, tracked=False)

    def queue_for(self, model: str) -> ModelQueue:
        queue = self._models.get(model)
        if queue is None:
            if len(self._models) >= self._max_models:
                return self._overflow
            queue = self._models[model] = ModelQueue(model, self._initial_tps)
        return queue

    def retire(self, model: str) -> None:
        """Forget a model (its live entries still release, into a table nobody reads)."""
        self._models.pop(model, None)

    # --- read-only views ---
    def models(self) -> list[str]:
        return list(self._models)

    def estimate_ms(self, model: str, level: int) -> int | None:
        """The local queue estimate for a new request of `model` at `level`; None: unknown."""
        queue = self._models.get(model)
        if queue is None:
            return 0 if self._initial_tps is not None else None
        return queue.estimate_ms(level)

    def input_tps(self, model: str) -> float | None:
        queue = self._models.get(model)
        return self._initial_tps if queue is None else queue.input_tps

    def snapshot(self) -> list[QueueSnapshot]:
        """Every tracked model's table (allocates: for scrapes, not for the request path)."""
        out = []
        for queue in self._models.values():
            tps = queue.input_tps
            estimates: tuple[tuple[int, int], ...] = ()
            idle_ms = None
            if tps is not None:
                levels = sorted(queue.pending)
                estimates = tuple(
                    (level, queue_ms(queue.work_ahead(level), tps)) for level in levels
                )
                idle_ms = queue_ms(queue.prefill_tokens, tps)
            out.append(
                QueueSnapshot(
                    model=queue.model,
                    input_tps=tps,
                    pending=queue.pending_count,
                    pending_tokens=queue.pending_tokens,
                    prefill=queue.prefill,
                    prefill_tokens=queue.prefill_tokens,
                    decode=queue.decode,
                    estimates_ms=estimates,
                    idle_ms=idle_ms,
                    decode_tokens=queue.decode_tokens,
                )
            )
        return out


class QueueGate:
    """The queue gate: its decision on a request, before any engine sees it, and the queue
    entry it creates. Built once (`build_core`) and injected into the proxy."""

    __slots__ = ("_adapter", "_policy", "_table")

    def __init__(self, table: QueueTable, policy: QueuePolicy, adapter: PriorityAdapter) -> None:
        self._table = table
        self._policy = policy
        self._adapter = adapter

    @property
    def table(self) -> QueueTable:
        return self._table

    @property
    def policy(self) -> QueuePolicy:
        return self._policy

    @property
    def adapter(self) -> PriorityAdapter:
        """The backend's adapter, whose `queue_level` sorts the table's levels."""
        return self._adapter

    def admit(self, request: TunnelRequest, body_size: int, stream: bool) -> QueueEntry:
        """Decide on `request` (when the gateway sent an expectation) and, unless refused,
        enter it as pending. `entry.decision` says what was decided (None: nothing to decide);
        a refused entry is not in the table, and `decision.error` is its answer."""
        level = self._adapter.queue_level(request.priority)
        tokens = request.input_tokens
        if tokens is None:
            tokens = -(-body_size // BYTES_PER_TOKEN)  # no x-input-tokens: body bytes / 4
        queue = self._table._models.get(request.model) or self._table.queue_for(request.model)
        expected = request.expected_queue_ms
        decision = None if expected is None else self._decide(request.model, queue, level, expected)
        sampled = stream or request.path in PREFILL_ONLY_PATHS
        return QueueEntry(queue, level, tokens, sampled, decision)  # level, tokens: both int

    def refusal(self, decision: QueueDecision, request_id: str | None) -> QueueMismatchError:
        """The answer to a rejected request (with the configured retry-after hint)."""
        return decision.error(request_id, self._policy.retry_after_ms)

    def _decide(self, model: str, queue: ModelQueue, level: int, expected: int) -> QueueDecision:
        policy = self._policy
        estimate = queue.estimate_ms(level) if queue.tracked else None
        threshold = policy.threshold_ms(expected)
        if not policy.enabled:
            result = Result.DISABLED
        elif estimate is None:
            result = Result.UNKNOWN_ESTIMATE
        elif estimate > threshold:
            result = Result.REJECTED
        else:
            result = Result.ACCEPTED
        # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
        # result, model, level, expected_ms, estimate_ms, threshold_ms
        return QueueDecision(result, model, level, expected, estimate, threshold)

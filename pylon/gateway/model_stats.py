"""The registration snapshot's live `ModelStats`, per published model, from what pylon measures:
`ModelStatsCollector.collect(models)` -> {model: `pylon.gateway.stats.ModelStatsValue`}.

Where each value comes from (the queue table's phases are `pylon.core.queue`'s: pending = no
response head yet, prefill = head but no output, decode = output flowing):

- `queue_size`: live requests without a first output: pending + prefill (the proto's "queued
  or in prefill");
- `queued_input_size`: their input tokens (the work the queue estimates divide);
- `input_processing_queries`: prefill (the engine answered the head, works on the prompt);
- `output_generation_queries`: decode;
- `num_running_queries`: every live request: pending + prefill + decode;
- `total_query_input_size`: the input tokens of every live request;
- `queue_time_estimate_ms_by_priority`: per gateway priority, the queue gate's own estimate
  (below);
- `last_mean_input_tps`: the queue table's input-throughput estimate, sticky (the last known
  stays while it is unknown again); 0 until there is one;
- `output_tps`: output tokens of the requests that ended in the last `OutputMeter.window`
  seconds, over the window (`OutputMeter`);
- `max_output_tps`: the highest `output_tps` collected since the model was published;
- `kv_cache_{capacity,used,free}_tokens`: from the injected `kv_cache(model)` when it knows all
  three, else 0 (pylon's `kv` router knows each worker's active blocks, not the cache's
  capacity, so it reports none: a free figure of 0 would read as a full cache);
- `max_engine_concurrency`: 0, unknown (the gateway then applies no full-backend filter);
- `stats_observed_at_unix_ms`: the wall clock at collection;
- `stats_capabilities`, sticky per model: `queue.live_requests` (always),
  `model.throughput.input` (once an input-throughput estimate existed), `request.output.tokens`
  (once output tokens were counted), `machine.kv_cache` (once `kv_cache` gave figures);
- `stats_sources`: `pylon` (its own live table and meters), and `kv_cache` once `kv_cache` gave
  figures.

Queue estimates by priority. The gateway reads the map for a request of priority p (its
`x-priority` rank: lower = more urgent; absent = 0) as the entry with the largest key <= p (0
when none is), and between two snapshots adds the requests it routed to the entries at and
above their priority (only when the map is not empty). pylon's table is kept per scheduling
level (`PriorityAdapter.queue_level`, monotone in the rank), so each level with pending requests
is published under the smallest rank scheduled there (`priority_of_level`; for the priority-aware
adapters the level is the rank clamped to `--priority-ceiling`, for passthrough and
`--no-derive-priority` every rank is level 0) with the estimate a new request at that level gets
from the queue gate; and key 0 always carries the most urgent rank's estimate (the prefill work
alone when nothing is pending there), so every priority finds an entry and the gateway's
between-snapshot accounting applies. Unknown throughput: an empty map (the gateway then has no
estimate either). Caveat (the contract's, not pylon's): the gateway looks an unconfigured request
up at priority 0, while the engine schedules it as the least urgent (level of the ceiling).

Cost: `OutputMeter.complete` is O(1) per request (one bucket of a ring); `collect` allocates and
runs once per snapshot (every `--registration-interval`), not on the request path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pylon.core.priority import PriorityAdapter
from pylon.core.queue import QueueSnapshot, QueueTable
from pylon.gateway.stats import ModelStatsValue
from pylon.observe import QuietMoments, quiet

if TYPE_CHECKING:
    from pylon.assemble import Core
    from pylon.core.errors import PylonError
    from pylon.core.queue import QueueDecision
    from pylon.core.record import RequestRecord
    from pylon.core.retry import RetryMark
    from pylon.routing.build import Routing

U32_MAX = 2**32 - 1  # the gateway's priorities are u32
DEFAULT_WINDOW_S = 10.0
DEFAULT_BUCKET_S = 1.0
MAX_METERED_MODELS = 1024  # models the output meter counts at once (the queue table's bound)
MAX_LEVEL_CACHE = 4096

CAP_QUEUE = "queue.live_requests"
CAP_INPUT_TPS = "model.throughput.input"
CAP_OUTPUT = "request.output.tokens"
CAP_KV = "machine.kv_cache"
SOURCE_PYLON = "pylon"
SOURCE_KV = "kv_cache"

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class KvCacheFigures:
    """One model's KV cache as the engine (or a router that knows its capacity) reports it."""

    capacity_tokens: int
    used_tokens: int
    free_tokens: int


KvCache = Callable[[str], "KvCacheFigures | None"]


class _Ring:
    """One model's output tokens in `buckets` buckets of `width` seconds."""

    __slots__ = ("counts", "ids")

    def __init__(self, buckets: int) -> None:
        self.ids = [-1] * buckets  # which bucket (time // width) each slot holds now
        self.counts = [0] * buckets


class OutputMeter(QuietMoments):
    """Output tokens per model over a sliding window, an `Observer` of the requests' ends.

    It hears `complete` (the observers' last moment of every exchange that reached the engine)
    and adds the record's `output_tokens` (the engine's usage, or the events relayed) to the
    bucket of `record.done_at` (the loop clock): O(1). Counting at the end is unbiased in a
    steady state (as many streams end per window as start) but lags a single long stream;
    pylon's canaries never pass here. `rate(model, now)`: tokens in the buckets of the last
    `window` seconds, over `window`. Add it to the process's observers (`Observers(log,
    meter)`, before `pylon.run.start`).
    """

    __slots__ = ("_buckets", "_rings", "_width", "window")

    def __init__(self, window: float = DEFAULT_WINDOW_S, bucket: float = DEFAULT_BUCKET_S) -> None:
        if not (bucket > 0 and window >= bucket):
            raise ValueError(f"need window >= bucket > 0, got {window}, {bucket}")
        self._width = bucket
        self._buckets = max(1, round(window / bucket))
        self.window = self._buckets * bucket
        self._rings: dict[str, _Ring] = {}

    def complete(self, record: RequestRecord) -> None:
        tokens = record.output_tokens
        model = record.model
        if not tokens or model is None or record.done_at is None:
            return
        self.add(model, tokens, record.done_at)

    def add(self, model: str, tokens: int, at: float) -> None:
        ring = self._rings.get(model)
        if ring is None:
            if len(self._rings) >= MAX_METERED_MODELS:
                return
            ring = self._rings[model] = _Ring(self._buckets)
        index = int(at // self._width)
        slot = index % self._buckets
        if ring.ids[slot] != index:
            ring.ids[slot] = index
            ring.counts[slot] = tokens
        else:
            ring.counts[slot] += tokens

    def rate(self, model: str, now: float) -> float:
        """Output tokens per second of `model` over the window that ends at `now`."""
        ring = self._rings.get(model)
        if ring is None:
            return 0.0
        newest = int(now // self._width)
        oldest = newest - self._buckets
        total = sum(
            count for index, count in zip(ring.ids, ring.counts, strict=True) if oldest < index
        )
        return total / self.window

    def seen(self, model: str) -> bool:
        return model in self._rings

    def retire(self, model: str) -> None:
        self._rings.pop(model, None)

    def models(self) -> list[str]:
        return list(self._rings)

    # The rest of the `Observer`: nothing heard.
    @quiet
    def queue_gate(self, record: RequestRecord, decision: QueueDecision) -> None:
        return None

    @quiet
    def upstream_status(self, record: RequestRecord, mark: RetryMark) -> None:
        return None

    @quiet
    def upstream_failed(self, record: RequestRecord, error: PylonError, after_head: bool) -> None:
        return None

    @quiet
    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        return None

    @quiet
    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        return None

    @quiet
    def transport_event(self, event: str, protocol: str, /, **fields: Any) -> None:
        return None

    @quiet
    def process_event(self, event: str, /, **fields: Any) -> None:
        return None


class LevelPriorities:
    """The gateway priority (rank) each scheduling level of `adapter` is published under: the
    smallest rank in 0..U32_MAX whose `queue_level` reaches the level (a binary search:
    `queue_level` is monotone in the rank), remembered."""

    def __init__(self, adapter: PriorityAdapter) -> None:
        self._adapter = adapter
        self._cache: dict[int, int] = {}
        self.top_level = adapter.queue_level(0)  # where the most urgent rank is scheduled

    def __call__(self, level: int) -> int:
        cached = self._cache.get(level)
        if cached is not None:
            return cached
        queue_level = self._adapter.queue_level
        low, high = 0, U32_MAX
        if queue_level(high) < level:
            rank = U32_MAX
        else:
            while low < high:
                middle = (low + high) // 2
                if queue_level(middle) >= level:
                    high = middle
                else:
                    low = middle + 1
            rank = low
        if len(self._cache) < MAX_LEVEL_CACHE:
            self._cache[level] = rank
        return rank


def estimates_by_priority(snapshot: QueueSnapshot, priority_of: LevelPriorities) -> dict[int, int]:
    """The queue estimates of one model's table, keyed by gateway priority (module docstring)."""
    if snapshot.input_tps is None or snapshot.idle_ms is None:
        return {}
    out = {0: snapshot.idle_ms}
    for level, estimate in snapshot.estimates_ms:
        key = 0 if level <= priority_of.top_level else priority_of(level)
        out[key] = max(out.get(key, 0), estimate)
    return out


class ModelStatsCollector:
    """Builds the snapshot's `ModelStatsValue` per published model (module docstring).

    `table`: the queue gate's live table; `meter`: the output-token meter among the observers;
    `priority_of`: the adapter's levels as gateway priorities; `kv_cache`: KV figures per model,
    where something knows them (None: none). `clock`: the loop clock `meter` counts in (default
    the running loop's); `wall`: the wall clock, in seconds (the observed-at time)."""

    def __init__(
        self,
        table: QueueTable,
        meter: OutputMeter,
        priority_of: LevelPriorities,
        *,
        kv_cache: KvCache | None = None,
        clock: Clock | None = None,
        wall: Clock = time.time,
    ) -> None:
        self._table = table
        self._meter = meter
        self._priority_of = priority_of
        self._kv_cache = kv_cache
        self._clock = clock
        self._wall = wall
        self._input_tps: dict[str, float] = {}  # sticky: the last known estimate
        self._max_output: dict[str, float] = {}
        self._caps: dict[str, set[str]] = {}

    def collect(self, models: Iterable[str]) -> dict[str, ModelStatsValue]:
        """The stats of each of `models` (the published set) now; state about every other
        model is forgotten (a re-published model starts afresh)."""
        published = dict.fromkeys(models)
        self._forget_others(published)
        snapshots = {snap.model: snap for snap in self._table.snapshot() if snap.model in published}
        now = (self._clock or asyncio.get_running_loop().time)()
        observed_at = int(self._wall() * 1000)
        return {
            model: self._one(model, snapshots.get(model), now, observed_at) for model in published
        }

    def _one(
        self, model: str, snap: QueueSnapshot | None, now: float, observed_at: int
    ) -> ModelStatsValue:
        caps = self._caps.setdefault(model, {CAP_QUEUE})
        known_tps = snap.input_tps if snap is not None else self._table.input_tps(model)
        if known_tps is not None:  # (a model with no table yet: the initial throughput)
            self._input_tps[model] = known_tps
        input_tps = self._input_tps.get(model, 0.0)
        if model in self._input_tps:
            caps.add(CAP_INPUT_TPS)
        output_tps = self._meter.rate(model, now)
        if self._meter.seen(model):
            caps.add(CAP_OUTPUT)
        max_output = max(self._max_output.get(model, 0.0), output_tps)
        self._max_output[model] = max_output
        kv = self._kv_cache(model) if self._kv_cache is not None else None
        if kv is not None:
            caps.add(CAP_KV)
        if snap is None:
            pending = pending_tokens = prefill = prefill_tokens = decode = decode_tokens = 0
            estimates: Mapping[int, int] = {0: 0} if known_tps is not None else {}
        else:
            pending, pending_tokens = snap.pending, snap.pending_tokens
            prefill, prefill_tokens = snap.prefill, snap.prefill_tokens
            decode, decode_tokens = snap.decode, snap.decode_tokens
            estimates = estimates_by_priority(snap, self._priority_of)
        sources = (SOURCE_PYLON, SOURCE_KV) if CAP_KV in caps else (SOURCE_PYLON,)
        return ModelStatsValue(
            last_mean_input_tps=input_tps,
            output_tps=output_tps,
            queue_size=pending + prefill,
            queued_input_size=pending_tokens + prefill_tokens,
            max_output_tps=max_output,
            kv_cache_capacity_tokens=kv.capacity_tokens if kv is not None else 0,
            kv_cache_used_tokens=kv.used_tokens if kv is not None else 0,
            kv_cache_free_tokens=kv.free_tokens if kv is not None else 0,
            num_running_queries=pending + prefill + decode,
            max_engine_concurrency=0,
            total_query_input_size=pending_tokens + prefill_tokens + decode_tokens,
            queue_time_estimate_ms_by_priority=estimates,
            input_processing_queries=prefill,
            output_generation_queries=decode,
            stats_observed_at_unix_ms=observed_at,
            stats_capabilities=tuple(sorted(caps)),
            stats_sources=sources,
        )

    def retire(self, model: str) -> None:
        """Forget what was learnt about `model` (its generation ended: a re-published model
        starts afresh even between two collections)."""
        for state in (self._input_tps, self._max_output, self._caps):
            state.pop(model, None)
        self._meter.retire(model)

    def _forget_others(self, published: Mapping[str, None]) -> None:
        for state in (self._input_tps, self._max_output, self._caps):
            for model in [m for m in state if m not in published]:
                del state[model]
        for model in [m for m in self._meter.models() if m not in published]:
            self._meter.retire(model)


def build_collector(
    core: Core,
    routing: Routing | None,
    meter: OutputMeter,
    *,
    kv_cache: KvCache | None = None,
    clock: Clock | None = None,
    wall: Clock = time.time,
) -> ModelStatsCollector:
    """The collector of a running pylon: its queue table, `meter` (which must be among the
    observers `pylon.run.start` was given) and its backend's levels; it forgets each model the
    catalogue retires. `routing` is accepted for the KV figures; pylon's routers know no cache
    capacity, so none come from it today (pass `kv_cache` where something knows them)."""
    del routing  # no KV capacity known to any router (see the module docstring)
    collector = ModelStatsCollector(
        core.queue.table,
        meter,
        LevelPriorities(core.queue.adapter),
        kv_cache=kv_cache,
        clock=clock,
        wall=wall,
    )
    core.lifecycle.models.on_retire(collector.retire)
    return collector

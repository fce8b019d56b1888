"""The registration snapshot's live ModelStats, pure: the queue table's phases in the right
fields, the output-token window, the queue estimates per gateway priority (and the map the
gateway reads back, as it reads it), sticky values and labels, retirement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.queue import QueueEntry, QueueGate, QueuePolicy, QueueSnapshot, QueueTable
from pylon.core.record import RequestRecord
from pylon.gateway.model_stats import (
    CAP_INPUT_TPS,
    CAP_KV,
    CAP_OUTPUT,
    CAP_QUEUE,
    U32_MAX,
    KvCacheFigures,
    LevelPriorities,
    ModelStatsCollector,
    OutputMeter,
    estimates_by_priority,
)
from tests.unit.helpers import tunnel

CEILING = 3600
BACKENDS = ("dynamo", "vllm", "sglang", "passthrough")


def gate(
    backend: str = "vllm", initial_tps: float | None = 1000.0, derive: bool = True
) -> QueueGate:
    adapter = build_adapter(backend, AdapterOptions(CEILING), derive=derive)
    return QueueGate(QueueTable(initial_tps), QueuePolicy(), adapter)


def admit(queue: QueueGate, tokens: int, priority: int | None = None) -> QueueEntry:
    headers = [(b"x-input-tokens", str(tokens).encode())]
    if priority is not None:
        headers.append((b"x-priority", str(priority).encode()))
    return queue.admit(tunnel(*headers), 0, True)  # x-model: m


def record(**at: Any) -> RequestRecord:
    out = RequestRecord("http1", 1, 0.0)
    for name, value in at.items():
        setattr(out, name, value)
    return out


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def collector(queue: QueueGate, **kw: Any) -> tuple[ModelStatsCollector, OutputMeter, Clock]:
    meter = kw.pop("meter", None) or OutputMeter(window=10.0, bucket=1.0)
    clock = Clock()
    built = ModelStatsCollector(
        queue.table,
        meter,
        LevelPriorities(queue.adapter),
        clock=clock,
        wall=lambda: 1_700_000_000.5,
        **kw,
    )
    return built, meter, clock


def test_queue_phases_map_to_their_fields() -> None:
    queue = gate(initial_tps=1000.0)
    stats, _, _ = collector(queue)
    pending = admit(queue, 100)
    prefill = admit(queue, 200)
    prefill.response_head(record())
    decode = admit(queue, 400)
    decode.response_head(record())
    decode.first_output(record(first_output_at=1.0))
    (value,) = stats.collect(["m"]).values()
    assert value.queue_size == 2  # pending + prefill: no first output yet
    assert value.queued_input_size == 300
    assert value.input_processing_queries == 1
    assert value.output_generation_queries == 1
    assert value.num_running_queries == 3
    assert value.total_query_input_size == 700
    assert value.last_mean_input_tps == 1000.0
    assert value.max_engine_concurrency == 0
    assert value.stats_observed_at_unix_ms == 1_700_000_000_500
    assert (value.kv_cache_capacity_tokens, value.kv_cache_free_tokens) == (0, 0)
    assert value.stats_sources == ("pylon",)
    assert set(value.stats_capabilities) == {CAP_QUEUE, CAP_INPUT_TPS}
    for entry in (pending, prefill, decode):
        entry.complete(record(done_at=2.0))
    (value,) = stats.collect(["m"]).values()
    assert (value.queue_size, value.num_running_queries, value.total_query_input_size) == (0, 0, 0)
    assert value.queue_time_estimate_ms_by_priority == {0: 0}  # known throughput, nothing ahead


def test_a_published_model_without_traffic_is_all_zero() -> None:
    queue = gate(initial_tps=None)
    stats, _, _ = collector(queue)
    value = stats.collect(["quiet"])["quiet"]
    assert (value.queue_size, value.num_running_queries, value.output_tps) == (0, 0, 0.0)
    assert value.last_mean_input_tps == 0.0
    assert value.queue_time_estimate_ms_by_priority == {}  # no throughput: no estimate
    assert value.stats_capabilities == (CAP_QUEUE,)
    assert queue.table.models() == []  # collecting created no table


def test_estimates_per_priority_are_the_queue_gates_own() -> None:
    queue = gate("vllm", initial_tps=1000.0)
    stats, _, _ = collector(queue)
    admit(queue, 1000, priority=5)
    admit(queue, 2000, priority=9)
    admit(queue, 4000)  # no x-priority: scheduled last (level = the ceiling)
    running = admit(queue, 500, priority=1)
    running.response_head(record())  # prefill: ahead of everyone
    estimates = stats.collect(["m"])["m"].queue_time_estimate_ms_by_priority
    assert estimates == {0: 500, 5: 1500, 9: 3500, CEILING: 7500}
    table = queue.table
    for rank in (0, 1, 4, 5, 6, 9, 100, CEILING, CEILING + 7, U32_MAX):
        level = queue.adapter.queue_level(rank)
        assert gateway_lookup(estimates, rank) == table.estimate_ms("m", level), rank


def gateway_lookup(estimates: dict[int, int], priority: int) -> int:
    """How the gateway reads the map for a request of `priority`: the entry with the largest
    key at or below it, 0 when there is none."""
    keys = [key for key in estimates if key <= priority]
    return estimates[max(keys)] if keys else 0


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(BACKENDS),
    st.booleans(),
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, CEILING + 100)),
            st.integers(0, 5000),
            st.sampled_from(["pending", "prefill", "decode"]),
        ),
        max_size=12,
    ),
    st.integers(0, U32_MAX),
)
def test_the_gateway_reads_back_the_gates_estimate_for_every_rank(
    backend: str,
    derive: bool,
    entries: list[tuple[int | None, int, str]],
    rank: int,
) -> None:
    """Whatever is live, for every backend: the gateway's lookup of a rank gives the estimate
    pylon's queue gate computes for a request of that rank."""
    queue = gate(backend, initial_tps=250.0, derive=derive)
    for priority, tokens, phase in entries:
        entry = admit(queue, tokens, priority)
        if phase != "pending":
            entry.response_head(record())
        if phase == "decode":
            entry.first_output(record(first_output_at=1.0))
    if not entries:
        queue.table.queue_for("m")
    (snap,) = queue.table.snapshot()
    estimates = estimates_by_priority(snap, LevelPriorities(queue.adapter))
    assert 0 in estimates
    level = queue.adapter.queue_level(rank)
    assert gateway_lookup(estimates, rank) == queue.table.estimate_ms("m", level)
    assert list(estimates.values()) == sorted(estimates.values())  # more urgent, less ahead


@pytest.mark.parametrize("backend", BACKENDS)
def test_level_priorities_invert_each_adapters_levels(backend: str) -> None:
    adapter = build_adapter(backend, AdapterOptions(CEILING), derive=True)
    priority_of = LevelPriorities(adapter)
    for rank in (0, 1, 17, CEILING - 1, CEILING):
        level = adapter.queue_level(rank)
        back = priority_of(level)
        assert adapter.queue_level(back) == level and back <= rank
    assert priority_of(adapter.queue_level(None)) <= CEILING


def test_input_throughput_is_sticky() -> None:
    queue = gate(initial_tps=None)
    stats, _, _ = collector(queue)
    queue.table.queue_for("m").input_tps = 321.0  # as measured
    assert stats.collect(["m"])["m"].last_mean_input_tps == 321.0
    queue.table.retire("m")  # e.g. the table forgot it: the last valid value stays
    assert stats.collect(["m"])["m"].last_mean_input_tps == 321.0
    assert CAP_INPUT_TPS in stats.collect(["m"])["m"].stats_capabilities


def test_output_tps_over_the_sliding_window() -> None:
    queue = gate()
    stats, meter, clock = collector(queue)
    meter.complete(record(model="m", output_tokens=50, done_at=100.2))
    meter.complete(record(model="m", output_tokens=30, done_at=104.9))
    meter.complete(record(model="m", output_tokens=None, done_at=105.0))  # nothing counted
    meter.complete(record(model=None, output_tokens=9, done_at=105.0))
    clock.now = 105.0
    value = stats.collect(["m"])["m"]
    assert value.output_tps == 8.0  # 80 tokens over 10 s
    assert value.max_output_tps == 8.0
    assert CAP_OUTPUT in value.stats_capabilities
    clock.now = 110.5  # the first bucket (100 s) left the window
    value = stats.collect(["m"])["m"]
    assert (value.output_tps, value.max_output_tps) == (3.0, 8.0)  # the max is kept
    clock.now = 200.0
    assert stats.collect(["m"])["m"].output_tps == 0.0
    meter.complete(record(model="m", output_tokens=10, done_at=203.0))  # a reused slot restarts
    clock.now = 203.5
    assert stats.collect(["m"])["m"].output_tps == 1.0


def test_retired_models_are_forgotten() -> None:
    queue = gate()
    stats, meter, _clock = collector(queue)
    meter.complete(record(model="m", output_tokens=100, done_at=100.0))
    assert stats.collect(["m"])["m"].max_output_tps == 10.0
    assert stats.collect(["n"]).keys() == {"n"}  # m retired: its meter and maxima go
    assert meter.models() == []
    value = stats.collect(["m"])["m"]  # re-published: a new generation starts afresh
    assert (value.output_tps, value.max_output_tps) == (0.0, 0.0)
    assert CAP_OUTPUT not in value.stats_capabilities
    meter.complete(record(model="m", output_tokens=100, done_at=100.0))
    assert stats.collect(["m"])["m"].max_output_tps == 10.0
    stats.retire("m")  # retired and re-published between two collections
    assert meter.models() == []
    assert stats.collect(["m"])["m"].max_output_tps == 0.0


def test_kv_figures_when_something_knows_them() -> None:
    queue = gate()
    figures = {"m": KvCacheFigures(4096, 1024, 3072)}
    stats, _, _ = collector(queue, kv_cache=figures.get)
    value = stats.collect(["m", "n"])
    m, n = value["m"], value["n"]
    assert (m.kv_cache_capacity_tokens, m.kv_cache_used_tokens, m.kv_cache_free_tokens) == (
        4096,
        1024,
        3072,
    )
    assert CAP_KV in m.stats_capabilities and m.stats_sources == ("pylon", "kv_cache")
    assert n.kv_cache_free_tokens == 0 and CAP_KV not in n.stats_capabilities


def test_meter_options_are_checked() -> None:
    with pytest.raises(ValueError):
        OutputMeter(window=0.5, bucket=1.0)
    with pytest.raises(ValueError):
        OutputMeter(window=1.0, bucket=0.0)


def test_estimates_of_an_unknown_throughput_are_empty() -> None:
    snap = QueueSnapshot("m", None, 1, 10, 0, 0, 0, (), None)
    assert estimates_by_priority(snap, LevelPriorities(gate().adapter)) == {}

"""`ModelStatsValue`: one model's `ModelStats` in a registration snapshot, as a typed value.

The field names are the proto's (`stargate.proto`, message `ModelStats`); what fills them from
pylon's measurements lives elsewhere. A value with every default is the "nothing measured yet"
snapshot (zeros: the gateway treats 0 as not known where that matters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pylon.gateway import stargate_pb2 as pb


@dataclass(frozen=True, slots=True)
class ModelStatsValue:
    last_mean_input_tps: float = 0.0
    output_tps: float = 0.0
    queue_size: int = 0
    queued_input_size: int = 0
    max_output_tps: float = 0.0
    kv_cache_capacity_tokens: int = 0
    kv_cache_used_tokens: int = 0
    kv_cache_free_tokens: int = 0
    num_running_queries: int = 0
    max_engine_concurrency: int = 0
    total_query_input_size: int = 0
    # priority -> estimated queue time (ms)
    queue_time_estimate_ms_by_priority: Mapping[int, int] = field(default_factory=dict)
    input_processing_queries: int = 0
    output_generation_queries: int = 0
    stats_observed_at_unix_ms: int = 0
    stats_capabilities: tuple[str, ...] = ()
    stats_sources: tuple[str, ...] = ()

    def to_proto(self) -> pb.ModelStats:
        return pb.ModelStats(
            last_mean_input_tps=self.last_mean_input_tps,
            output_tps=self.output_tps,
            queue_size=self.queue_size,
            queued_input_size=self.queued_input_size,
            max_output_tps=self.max_output_tps,
            kv_cache_capacity_tokens=self.kv_cache_capacity_tokens,
            kv_cache_used_tokens=self.kv_cache_used_tokens,
            kv_cache_free_tokens=self.kv_cache_free_tokens,
            num_running_queries=self.num_running_queries,
            max_engine_concurrency=self.max_engine_concurrency,
            total_query_input_size=self.total_query_input_size,
            queue_time_estimate_ms_by_priority=dict(self.queue_time_estimate_ms_by_priority),
            input_processing_queries=self.input_processing_queries,
            output_generation_queries=self.output_generation_queries,
            stats_observed_at_unix_ms=self.stats_observed_at_unix_ms,
            stats_capabilities=self.stats_capabilities,
            stats_sources=self.stats_sources,
        )

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelStatsValue:
    last_mean_input_tps: float
    output_tps: float
    queue_size: int
    queued_input_size: int
    max_output_tps: float
    kv_cache_capacity_tokens: int
    kv_cache_used_tokens: int
    kv_cache_free_tokens: int
    num_running_queries: int
    max_engine_concurrency: int
    total_query_input_size: int
    queue_time_estimate_ms_by_priority: Mapping[int, int]
    input_processing_queries: int
    output_generation_queries: int
    stats_observed_at_unix_ms: int
    stats_capabilities: tuple[str, ...]
    stats_sources: tuple[str, ...]

"""The tables the metrics count into: written by `pylon.metrics.observer` on the hot path, read by
`pylon.metrics.exposition` at scrape time (both on the event loop, so nothing is torn).

Plain integers in dicts and lists: no locks, no prometheus-client objects, nothing allocated per
request beyond a small tuple.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pylon.metrics.catalogue import DURATION_BUCKETS, SECONDS_BUCKETS, STATUS_CLASS

if TYPE_CHECKING:
    from pylon.core.queue import QueueSnapshot
    from pylon.gateway.registration import GatewayReport
    from pylon.routing.build import RoutingSnapshot

# A histogram is a plain list, observed inline on the hot path (no call):
#   histogram[bisect_left(bounds, value)] += 1; histogram[-1] += value
# One count per bucket bound, then the +Inf count, then the sum; cumulated at scrape time.
Histogram = list[float]


def new_histogram(bounds: Sequence[float]) -> Histogram:
    return [0] * (len(bounds) + 1) + [0.0]


class ModelStats:
    """Everything counted for one model label."""

    __slots__ = (
        "duration",
        "first_output",
        "head",
        "in_flight",
        "input_tokens",
        "label",
        "output_tokens",
        "requests",
    )

    def __init__(self, label: str) -> None:
        self.label = label
        self.requests: dict[tuple[str, str], int] = {}  # (status class, transport) -> count
        self.in_flight: dict[str, int] = {}  # transport -> requests at the engine
        self.head = new_histogram(SECONDS_BUCKETS)
        self.first_output = new_histogram(SECONDS_BUCKETS)
        self.duration = new_histogram(DURATION_BUCKETS)
        self.input_tokens: dict[str, Histogram] = {}  # source -> histogram (TOKEN_BUCKETS)
        self.output_tokens: dict[str, Histogram] = {}

    def count(self, status: int, transport: str) -> None:
        key = (STATUS_CLASS.get(status // 100, "other"), transport)
        self.requests[key] = self.requests.get(key, 0) + 1


@dataclass(frozen=True, slots=True)
class Counts:
    """What one scrape exposes: the observer's own tables (not copies: read them at once, on the
    event loop) and the queue table and the routers as they were read for this scrape."""

    backend: str
    """The engine dialect (`--backend`), a label of the request metrics."""
    models: Sequence[ModelStats]
    """Every model label's stats, in exposition order: `_none`, `_other`, then the client models
    in the order first seen."""
    labelled: Mapping[str | None, ModelStats]
    """A model name -> its stats, for the models seen so far (`_other`'s among them)."""
    other: ModelStats
    """The stats of every model past the label limit."""
    priority_bounds: tuple[int, ...]
    """The engine priority histogram's bucket bounds (`catalogue.priority_buckets`)."""
    priority: Histogram
    """Engine priorities of the requests sent to the engine."""
    upstream_errors: Mapping[tuple[str, str], int]
    """(error code, stage) -> failed engine exchanges."""
    markings: Mapping[tuple[str, str], int]
    """(reason, retryable) -> retry markings written."""
    stripped: Mapping[tuple[str, str], int]
    """(deny-list rule, location) -> client controls removed."""
    transport_events: Mapping[tuple[str, str], int]
    """(protocol, event) -> connection-level events."""
    crashes: int
    """Requests pylon failed to handle."""
    queue_decisions: Mapping[tuple[str], int]
    """(result,) -> queue-gate decisions."""
    discovery_polls: Mapping[tuple[str, str], int]
    """(outcome, reason) -> /v1/models polls."""
    models_published: int
    """Models published now."""
    ready: int
    """1 while /ready answers 200, else 0."""
    tls_not_after: float | None
    """The TLS certificate's notAfter, in seconds since the epoch; None: no TLS listener."""
    tls_reloads: Mapping[str, int]
    """Result (`TLS_RELOAD_RESULTS`) -> TLS reloads."""
    queue: Iterable[QueueSnapshot]
    """Each model's queue table, read for this scrape (empty before the table exists)."""
    routing: RoutingSnapshot | None
    """The workers and the kv selects, read for this scrape; None with --routing off."""
    gateways: Mapping[str, GatewayReport] | None = None
    """Each registered gateway's registration state, read for this scrape; None without
    --gateway."""

"""Prometheus metrics: a `MetricsObserver` fed by the same events as the log lines.

The hot path only bumps plain integers (a dict entry, a histogram bucket found by `bisect`): no
locks, no label lookups through prometheus-client, no allocation beyond a small tuple per
request. Everything runs on the event loop, and so does the scrape, so nothing is torn. At scrape
time a collector turns the numbers into metric families on the process's own `CollectorRegistry`
(never the global default, so several pylons in one process keep their own), which the admin
listener (`pylon.admin`) serves as Prometheus text or OpenMetrics.

Label values are bounded everywhere: `model` comes from a client header, so only the first
`MODEL_LABEL_LIMIT` distinct models get their own label and later ones are counted as `_other`
(requests without a model, like `/health` or one refused before its contract was read, as
`_none`); stripped controls are labelled with the deny-list rule they matched
(`pylon.core.sanitize.stripped_control_label`); every other label is a name pylon's code defines.

`METRICS` lists every family with its type, labels and meaning: docs/operations.md renders it
(scripts/gen_operations_doc.py), and tests pin it against their own list.

What lives where (each module imports only those above it):

- catalogue.py: `METRICS` (`MetricSpec`: every family's name, type, labels and help), the
  histograms' bucket bounds and the bounded label values.
- counts.py: the tables counted into (`ModelStats`, the `Histogram` lists) and `Counts`, what one
  scrape reads.
- exposition.py: the scrape: `Counts` turned into metric families (`families`), the registry
  and its collector.
- observer.py: `MetricsObserver`, the `Observer` that counts (the per-request hot path).

The names below are the package's API; import them from `pylon.metrics`.
"""

from pylon.metrics.catalogue import (
    DURATION_BUCKETS,
    METRICS,
    MODEL_LABEL_LIMIT,
    NO_MODEL,
    OTHER_MODEL,
    SECONDS_BUCKETS,
    TOKEN_BUCKETS,
    MetricSpec,
)
from pylon.metrics.counts import Histogram, new_histogram
from pylon.metrics.exposition import histogram_buckets
from pylon.metrics.observer import BATCH, MetricsObserver

__all__ = [
    "BATCH",
    "DURATION_BUCKETS",
    "METRICS",
    "MODEL_LABEL_LIMIT",
    "NO_MODEL",
    "OTHER_MODEL",
    "SECONDS_BUCKETS",
    "TOKEN_BUCKETS",
    "Histogram",
    "MetricSpec",
    "MetricsObserver",
    "histogram_buckets",
    "new_histogram",
]

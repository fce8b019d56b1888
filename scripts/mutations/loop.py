"""Fairness to the event loop and to the log: no input source holds the loop for a burst, and
a repeated fault writes a bounded number of log lines (its counters stay exact)."""

from __future__ import annotations

from mutations.anchors import Never
from mutations.spec import KV_ROUTING_T, KV_WATCH, Mutation

LOOP_FAIRNESS = [
    Mutation(
        "loop fairness",
        "the KV-event watch never yields inside a burst",
        Never(KV_WATCH, "KvEventWatch._follow", "budget == 0"),
        {"core": (f"{KV_ROUTING_T}::test_a_burst_of_kv_events_does_not_hold_the_loop",)},
    ),
]

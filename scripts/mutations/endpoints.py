"""Operator endpoints: the admin listener's bounds under floods (one pipelined request at a
time, nothing parsed while writes are paused, eviction at the connection cap) and readiness
that follows the engine and the fleet."""

from __future__ import annotations

from mutations.anchors import Never, ReplaceExpr, ReplaceStatements
from mutations.spec import Mutation

ADMIN = "pylon/admin.py"
ADMIN_T = "tests/integration/test_admin.py"
BRINGUP = "pylon/bringup.py"
LIFECYCLE = "pylon/lifecycle.py"
RUN = "pylon/run.py"
BRINGUP_T = "tests/integration/test_bringup_and_models.py"
BRINGUP_UNIT_T = "tests/unit/test_bringup.py"

_FLOOD = f"{ADMIN_T}::test_pipelined_flood_that_never_reads_holds_neither_the_loop_nor_memory"
_CAP = f"{ADMIN_T}::test_silent_connections_at_the_cap_never_starve_the_probes"
_CUTS = f"{ADMIN_T}::test_one_request_per_loop_turn_however_the_reads_cut_the_heads[*]"

ADMIN_FLOODS = [
    Mutation(
        "admin flood",
        "every pipelined request in a read answered in one loop turn",
        ReplaceExpr(
            ADMIN,
            "AdminConnection._advance",
            "not self._answered and not self._writing_paused and not self._closing",
            "not self._writing_paused and not self._closing",
        ),
        {"core": (_FLOOD, _CUTS)},
    ),
    Mutation(
        "admin flood",
        "a head's end split across two reads is missed (two requests answered in one turn)",
        ReplaceExpr(ADMIN, "AdminConnection._feed_one", "max(start - 3, 0)", "start"),
        {"core": (_CUTS,)},
    ),
    Mutation(
        "admin flood",
        "requests parsed while the client does not read its answers",
        ReplaceStatements(
            ADMIN, "AdminConnection.pause_writing", "self._writing_paused = True", ""
        ),
        {"core": (_FLOOD,)},
    ),
    Mutation(
        "admin flood",
        "admin head bytes not counted as they arrive (one endless line buffered whole)",
        Never(
            ADMIN,
            "AdminConnection._feed_one",
            "self._head_fed > MAX_HEAD_BYTES + _HEAD_SLACK",
        ),
        {"core": (f"{ADMIN_T}::test_one_endless_header_line_is_refused_as_it_arrives[*]",)},
    ),
    Mutation(
        "admin connection cap",
        "silent connections at the cap starve the probes (the new one is refused)",
        ReplaceStatements(
            ADMIN,
            "AdminServer.add",
            """
            oldest = next(iter(self._connections))
            del self._connections[oldest]
            self.evicted += 1
            oldest.close()
            """,
            "connection.close()\nreturn",
        ),
        {"core": (_CAP,)},
    ),
]

_ENGINE = f"{BRINGUP_T}::test_readiness_follows_the_engine_after_start_up"
_FLEET = f"{BRINGUP_T}::test_readiness_follows_the_fleet_in_rotation"

READINESS = [
    Mutation(
        "readiness",
        "/ready stays 200 while an engine fault is known",
        Never(LIFECYCLE, "Lifecycle.readiness", "self._engine_fault is not None"),
        {"core": (_ENGINE, _FLEET)},
    ),
    Mutation(
        "readiness",
        "the engine's failed health checks after start-up never make pylon not ready",
        Never(BRINGUP, "EngineWatch.apply", "self.failures >= self._fail_after"),
        {
            "core": (
                _ENGINE,
                f"{BRINGUP_UNIT_T}::test_the_engine_watch_sets_and_clears_the_engine_fault",
            )
        },
    ),
    Mutation(
        "readiness",
        "the fleet's in-rotation view never reaches readiness",
        ReplaceStatements(RUN, "_follow_readiness", "fleet.on_change(rotation_changed)", ""),
        {"core": (_FLEET,)},
    ),
]

LOG_T = "tests/integration/test_log_lines.py"
METRICS_OBSERVER = "pylon/metrics/observer.py"

LABELS = [
    Mutation(
        "metric labels",
        "a request refused at admission labelled by whatever x-model the client sent",
        ReplaceExpr(
            METRICS_OBSERVER,
            "MetricsObserver.rejected",
            "error.model is not None and model not in self._published",
            "False",
        ),
        {
            "core": (
                f"{LOG_T}::test_refusals_at_admission_carry_the_model_and_label_only_published_"
                "ones[http1]",
            )
        },
    ),
]

MUTATIONS = [*ADMIN_FLOODS, *READINESS, *LABELS]

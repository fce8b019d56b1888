"""Routing: passive health (a worker whose real answers keep failing leaves rotation, within
the cap on the share ejected at once) and the connect-failure move (a request that reached no
worker goes to another, or is a retryable 503)."""

from __future__ import annotations

from mutations.anchors import Always, DropOperand, Never, ReplaceExpr, ReplaceStatements
from mutations.spec import ASSEMBLE, FORWARDING, Mutation, per_transport

OUTLIER = "pylon/routing/outlier.py"
PASSIVE = "pylon/routing/passive.py"
FLEET = "pylon/routing/fleet.py"
KV = "pylon/routing/kv.py"
EXCHANGE = "pylon/proxy/exchange.py"

_UNIT_T = "tests/unit/test_outlier.py"
_PASSIVE_T = "tests/integration/test_passive_health.py"
_SEAM_T = "tests/unit/test_seam_proxy.py"
_EJECTS = f"{_PASSIVE_T}::test_a_worker_that_answers_500_leaves_rotation_after_n_failures[*]"
_BREAKS = f"{_PASSIVE_T}::test_a_worker_that_answers_200_and_then_breaks_leaves_rotation"
_JUDGED = f"{_UNIT_T}::test_a_good_head_is_judged_when_its_response_is_over"
_DEAD = f"{_PASSIVE_T}::test_a_dead_worker_costs_the_client_nothing"
_UNREACHED = f"{_PASSIVE_T}::test_a_request_no_worker_can_be_reached_for_is_a_retryable_503[*]"
_MOVES = f"{_SEAM_T}::test_a_worker_that_cannot_be_reached_moves_the_request_and_its_booking"

PASSIVE_HEALTH = [
    Mutation(
        "passive health",
        "consecutive failures never eject a worker",
        Always(
            OUTLIER,
            "OutlierDetector.failure",
            "state.failures < self._consecutive and not state.probation",
        ),
        {
            "core": (
                f"{_UNIT_T}::test_consecutive_failures_eject_and_a_success_resets_the_count",
                _EJECTS,
            )
        },
    ),
    Mutation(
        "passive health",
        "a 5xx answer is not counted as a failure",
        Never(PASSIVE, "PassiveHealth.answered", "status >= 500 and status != 503"),
        {"core": (_EJECTS,)},
    ),
    Mutation(
        "passive health",
        "a response that breaks after a good head is not counted as a failure",
        Never(PASSIVE, "PassiveHealth.ended", "reason is not None"),
        {"core": (_JUDGED, f"{_BREAKS}[round-robin-cut_body]", f"{_BREAKS}[kv-cut_body]")},
    ),
    Mutation(
        "passive health",
        "a round-robin or least-loaded booking never judges a response by how it ended",
        Always(FLEET, "WorkerBooking.complete", "record.first_byte_at is None"),
        {"core": (_JUDGED, f"{_BREAKS}[round-robin-cut_body]")},
    ),
    Mutation(
        "passive health",
        "a kv booking never judges a response by how it ended",
        Always(KV, "KvBooking.complete", "record.first_byte_at is None"),
        {"core": (f"{_BREAKS}[kv-cut_body]",)},
    ),
    Mutation(
        "passive health",
        "an ejected worker stays in the rotation routers choose from",
        ReplaceExpr(
            FLEET,
            "Fleet._rotate",
            "worker.checks_pass and not worker.outlier.ejected",
            "worker.checks_pass",
        ),
        {"core": (_EJECTS,)},
    ),
    Mutation(
        "passive health",
        "a returned worker is not on probation (its first failure does not eject it again)",
        DropOperand(OUTLIER, "OutlierDetector.failure", "not state.probation"),
        {
            "core": (
                f"{_UNIT_T}::test_it_returns_after_its_backoff_on_probation_and_the_backoff_grows",
                f"{_PASSIVE_T}::test_an_ejected_worker_returns_on_probation_and_its_backoff_grows",
            )
        },
    ),
    Mutation(
        "passive health share cap",
        "no cap on the share of workers ejected at once",
        DropOperand(OUTLIER, "OutlierDetector.failure", "self.ejected >= self.cap"),
        {
            "core": (
                f"{_UNIT_T}::test_the_share_ejected_at_once_is_capped_never_the_whole_fleet[*]",
            )
        },
    ),
    Mutation(
        "passive health share cap",
        "the last worker in rotation may be ejected",
        DropOperand(OUTLIER, "OutlierDetector.failure", "in_rotation <= 1"),
        {"core": (f"{_UNIT_T}::test_the_last_worker_in_rotation_is_never_ejected",)},
    ),
]

CONNECT_MOVE = [
    Mutation(
        "connect-failure move",
        "a request a fresh connection's engine read and reset is sent again",
        DropOperand("pylon/upstream/connection.py", "Attempt.stale_connection", "conn.reused"),
        per_transport(
            f"{_PASSIVE_T}::test_a_reset_after_the_request_was_written_is_not_moved_nor_retryable"
        ),
    ),
    Mutation(
        "connect-failure move",
        "a request that reached no worker is never moved to another",
        Never(FORWARDING, "Proxy._forward", "not moved and not isinstance(refused, UpstreamBusy)"),
        {
            "core": (_DEAD, _MOVES),
            **per_transport(f"{_PASSIVE_T}::test_the_move_on_every_transport"),
        },
    ),
    Mutation(
        "connect-failure move",
        "the first worker's booking is not released when the request moves",
        ReplaceStatements(EXCHANGE, "Exchange.rebooked", "booking.rejected(self, error)", ""),
        {"core": (_DEAD, _MOVES)},
    ),
    Mutation(
        "connect-failure move",
        "a request no worker could be reached for is not marked retryable",
        Never(
            ASSEMBLE,
            "retry_policy",
            'settings.routing != "off" and not policy.local_connect_failures_retryable',
        ),
        {"core": (_UNREACHED,)},
    ),
]

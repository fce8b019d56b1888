"""Client claims: what a client or gateway says a request costs is believed only up to what the
request can cost, and one request's sample cannot carry the throughput estimate (issue 17,
rule 1)."""

from __future__ import annotations

from mutations.anchors import Never, ReplaceExpr, ReplaceStatements
from mutations.spec import CONTRACT, CONTRACT_T, FORWARDING, Mutation, per_transport

QUEUE = "pylon/core/queue.py"
QUEUE_T = "tests/unit/test_queue.py"
CLAIMS_T = "tests/integration/test_claims.py"

_REFUSED = f"{CLAIMS_T}::test_a_claim_beyond_the_body_is_refused_and_holds_no_one"
_OUTLIER = f"{CLAIMS_T}::test_an_outlier_sample_cannot_zero_the_next_estimates"

CLAIMS = [
    Mutation(
        "client claims",
        "x-input-tokens above the body's bound believed (check_input_tokens)",
        Never(
            CONTRACT,
            "check_input_tokens",
            "claimed is not None and claimed > body_size + TEMPLATE_TOKENS",
        ),
        {
            "core": (f"{CONTRACT_T}::test_input_tokens_beyond_the_body_are_refused",),
            **per_transport(_REFUSED),
        },
    ),
    Mutation(
        "client claims",
        "the proxy never bounds x-input-tokens by the body (Proxy.handle)",
        ReplaceStatements(FORWARDING, "Proxy.handle", "check_input_tokens(request, len(body))", ""),
        per_transport(_REFUSED),
    ),
    Mutation(
        "client claims",
        "one throughput sample weighs in full (ratio of sums, ModelQueue._add_sample)",
        ReplaceExpr(
            QUEUE,
            "ModelQueue._add_sample",
            "trimmed_tps(self._ring_tokens[:held], self._ring_busy[:held])",
            "sum(self._ring_tokens) / sum(self._ring_busy)",
        ),
        {
            "core": (f"{QUEUE_T}::test_one_outlier_sample_stays_within_the_others",),
            **per_transport(_OUTLIER),
        },
    ),
    Mutation(
        "client claims",
        "the extreme samples kept (trimmed_tps)",
        ReplaceExpr(QUEUE, "trimmed_tps", "order[1:-1]", "order"),
        {"core": (f"{QUEUE_T}::test_trimmed_throughput_drops_the_extremes",)},
    ),
]

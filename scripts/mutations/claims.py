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
_LOW = f"{CLAIMS_T}::test_low_claims_over_held_prefills_cannot_zero_the_estimate"

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
            "median_tps(self._ring_tokens[:held], self._ring_busy[:held])",
            "sum(self._ring_tokens) / sum(self._ring_busy)",
        ),
        {
            "core": (f"{QUEUE_T}::test_one_outlier_sample_stays_within_the_others",),
            **per_transport(_OUTLIER),
        },
    ),
    Mutation(
        "client claims",
        "long samples outweigh the rest (trimmed ratio of sums, not the median: median_tps)",
        ReplaceStatements(
            QUEUE,
            "median_tps",
            "rates = sorted(t / b for t, b in zip(tokens, busy, strict=True))",
            "order = sorted(range(len(tokens)), key=lambda i: tokens[i] / busy[i])[1:-1]\n"
            "return sum(tokens[i] for i in order) / sum(busy[i] for i in order)",
        ),
        {
            "core": (
                f"{QUEUE_T}::test_median_throughput_holds_against_fewer_than_half",
                f"{QUEUE_T}::test_low_claims_over_held_prefills_cannot_zero_the_estimate",
            ),
            **per_transport(_LOW),
        },
    ),
]

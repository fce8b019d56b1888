"""The HTTP/1.1 reading around the intake: nothing behind a refused request is read, and an
Upgrade is refused rather than followed."""

from __future__ import annotations

from mutations.anchors import Never, ReplaceStatements
from mutations.spec import H1_T, HTTP1, Mutation

_NOTHING_BEHIND = f"{H1_T}::test_nothing_behind_a_refused_request_is_read"

MUTATIONS = [
    Mutation(
        "HTTP/1.1 stop reading after a refusal",
        "pipelined bytes read after an admission refusal (on_headers_complete)",
        Never(HTTP1, "Http1Connection.on_headers_complete", "stream.intake.state is REJECTED"),
        {"http1": (f"{_NOTHING_BEHIND}[*]",)},
    ),
    Mutation(
        "HTTP/1.1 stop reading after a refusal",
        "pipelined bytes read after a body refusal (on_body)",
        Never(HTTP1, "Http1Connection.on_body", "stream.intake.state is REJECTED"),
        {"http1": (f"{_NOTHING_BEHIND}[streamed_body_over_limit]",)},
    ),
    Mutation(
        "HTTP/1.1 protocol upgrade",
        "Upgrade not refused",
        ReplaceStatements(
            HTTP1,
            "Http1Connection._parse",
            'self._refuse(ContractError("protocol upgrade is not supported"))',
            "",
        ),
        {"http1": (f"{H1_T}::test_upgrade_ends_the_connection",)},
    ),
]

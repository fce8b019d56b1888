"""Tunnel token auth: who may send a tunnel request at all, and what of the credential the
engine never sees."""

from __future__ import annotations

from mutations.anchors import (
    Never,
    ReplaceExpr,
    ReplaceStatements,
    ReturnAtOnce,
)
from mutations.spec import (
    ADMISSION,
    ASSEMBLE,
    AUTH,
    AUTH_T,
    CONTRACT,
    CONTRACT_T,
    INTAKE,
    SAME,
    TRANSPORTS,
    Mutation,
    per_transport,
    without_auth,
)

_HEALTH_BYPASS = 'method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] == HEALTH_PATH'
_HEALTH_BYPASS_TESTS = {
    "core": (f"{CONTRACT_T}::test_only_get_head_exact_health_bypass[*]",),
    **per_transport(f"{AUTH_T}::test_only_get_and_head_of_exactly_health_skip_the_token"),
}

MUTATIONS = [
    Mutation(
        "tunnel token auth",
        "token never checked",
        Never(
            ADMISSION,
            "ProxyAdmission.admit",
            "self._auth is not None and not self._auth.allows(request.headers)",
        ),
        per_transport(f"{SAME}::test_missing_tunnel_token_is_401_on_every_transport"),
    ),
    *(
        Mutation(
            "tunnel token auth",
            f"skipped on {t} only (its stream table gets an admission without auth)",
            without_auth(t),
            {t: (f"{SAME}::test_missing_tunnel_token_is_401_on_every_transport[{t}]",)},
        )
        for t in TRANSPORTS
    ),
    Mutation(
        "tunnel token auth",
        "authorization forwarded to the engine (Planner consumed=empty)",
        ReplaceExpr(
            ASSEMBLE,
            "build_core",
            "auth.consumed if auth is not None else frozenset()",
            "frozenset()",
        ),
        per_transport(f"{SAME}::test_missing_tunnel_token_is_401_on_every_transport"),
    ),
    Mutation(
        "tunnel token auth",
        "a second authorization header is ignored (first wins)",
        ReplaceStatements(
            AUTH,
            "TokenAuth.allows",
            "if presented is not None:\n    return False",
            "if presented is not None:\n    continue",
        ),
        {"core": (f"{AUTH_T}::test_two_authorization_headers_are_refused[*]",)},
    ),
    Mutation(
        "tunnel token auth",
        "Bearer scheme not checked",
        ReplaceExpr(
            AUTH,
            "TokenAuth.allows",
            "presented is None or presented[:7].lower() != _BEARER",
            "presented is None",
        ),
        {"core": (f"{AUTH_T}::test_token_under_another_scheme_is_refused[*]",)},
    ),
    Mutation(
        "tunnel token auth",
        "rotated token file never re-read",
        ReturnAtOnce(AUTH, "TokenAuth._refresh"),
        {"core": (f"{AUTH_T}::test_rotated_token_file_is_picked_up[*]",)},
    ),
    Mutation(
        "tunnel token auth",
        "/health bypass for any method",
        ReplaceExpr(
            CONTRACT, "is_health_target", _HEALTH_BYPASS, 'target.split(b"?", 1)[0] == HEALTH_PATH'
        ),
        _HEALTH_BYPASS_TESTS,
    ),
    Mutation(
        "tunnel token auth",
        "/health bypass for any path starting /health",
        ReplaceExpr(
            CONTRACT,
            "is_health_target",
            'target.split(b"?", 1)[0] == HEALTH_PATH',
            "target.startswith(HEALTH_PATH)",
        ),
        _HEALTH_BYPASS_TESTS,
    ),
    Mutation(
        "tunnel token auth",
        "declared body limit (413) answered before the token (401)",
        ReplaceStatements(
            INTAKE,
            "RequestIntake.receive_head",
            """
            if isinstance(admitted, PylonError):
                return self._reject(admitted)
            self.request = admitted
            declared = head.content_length
            """,
            """
            declared = head.content_length
            if declared is not None and declared > self._limits.max_body_bytes:
                known = __import__('pylon.core.contract', fromlist=['_']).request_id_of
                limit = self._limits.max_body_bytes
                return self._reject(body_too_large(limit, known(head.headers)))
            if isinstance(admitted, PylonError):
                return self._reject(admitted)
            self.request = admitted
            """,
        ),
        per_transport(f"{SAME}::test_missing_token_is_answered_before_the_declared_body_length"),
    ),
    Mutation(
        "tunnel token auth",
        "a broken token file is told at every check (one line a second while it stays broken)",
        Never(AUTH, "TokenAuth._refresh", "state == self._unusable"),
        {"core": (f"{AUTH_T}::test_a_broken_token_file_is_told_once_not_at_every_check",)},
    ),
]

"""The strip's own mutations, for scripts/golden_mutations.py: named entries of the deny tables,
the strip rules, and (`table_entries`) every entry of every table in sanitize.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mutations.anchors import (
    DropEntry,
    DropOperand,
    Never,
    ReplaceExpr,
    ReplaceStatements,
    Source,
    Table,
    table_keys,
    table_of,
)
from mutations.spec import BODY, HEAD, PLAN, SANITIZE, Mutation

_STRIP = "strip"  # the control of every golden mutation: the report shows only the label
_TABLE_NAME = re.compile(r"_?[A-Z][A-Z_]+")


def _drop(label: str, table: str, key: str) -> Mutation:
    return Mutation(_STRIP, label, DropEntry(SANITIZE, table, key))


NAMED = [
    _drop("header x-session-id", "DENIED_REQUEST_HEADERS", 'b"x-session-id"'),
    _drop("header x-tenant-id", "DENIED_REQUEST_HEADERS", 'b"x-tenant-id"'),
    _drop("prefix x-dynamo-", "DENIED_REQUEST_HEADER_PREFIXES", 'b"x-dynamo-"'),
    _drop("body cache_salt", "DENIED_BODY_FIELDS", '"cache_salt"'),
    _drop("body priority", "DENIED_BODY_FIELDS", '"priority"'),
    _drop("nvext.backend_instance_id", "DENIED_NVEXT_FIELDS", '"backend_instance_id"'),
    _drop("nvext.agent_hints", "DENIED_NVEXT_FIELDS", '"agent_hints"'),
    _drop("vllm_xargs.session_id", "DENIED_NESTED_FIELDS", '("vllm_xargs", "session_id")'),
    Mutation(
        _STRIP,
        "underscore-twin rule",
        Never(SANITIZE, "header_denied_reason", 'name.find(b"_") >= 0'),
    ),
    Mutation(
        _STRIP,
        "connection-listed-names rule",
        ReplaceStatements(
            SANITIZE,
            "_connection_tokens",
            'tokens.discard(b"")\nreturn frozenset(tokens)',
            "return frozenset()",
        ),
    ),
    Mutation(
        _STRIP,
        "duplicate-key check (body.py)",
        Never(BODY, "inspect_body", "keys.count(key) > 1"),
    ),
    # A few more rules than the brief asked for.
    Mutation(
        _STRIP,
        "duplicate-key check: escape screen",
        DropOperand(BODY, "_plain_view", 'body.find(b"\\\\") >= 0'),
    ),
    Mutation(
        _STRIP,
        "duplicate-key check: repeated model in the fast path",
        Never(BODY, "_plain_view", "body.count(b'\"model\"') > 1"),
    ),
    Mutation(
        _STRIP,
        "duplicate-key check: vllm_xargs container",
        DropEntry(
            BODY, "CONTAINER_KEYS", "*sorted({parent for parent, _ in DENIED_NESTED_FIELDS})"
        ),
    ),
    # (Whitespace around a request name cannot reach the strip any more: llhttp refuses it, and
    # the head's wire check refuses any name that is not a token, on every transport.)
    Mutation(
        _STRIP,
        "case of request names",
        ReplaceExpr(
            HEAD,
            "http1_head",
            "[name.lower() for name, _ in fields]",
            "[name for name, _ in fields]",
        ),
    ),
    Mutation(
        _STRIP,
        "hop-by-hop check in requests",
        Never(SANITIZE, "header_denied_reason", "name in HOP_BY_HOP"),
    ),
    *(
        Mutation(_STRIP, label, DropOperand(SANITIZE, "sanitize_response_head", operand))
        for label, operand in [
            ("response: x-stargate-* prefix", "name.startswith(DENIED_RESPONSE_HEADER_PREFIXES)"),
            ("response: configured retry header", "name in extra_denied"),
            ("response: hop-by-hop", "name in HOP_BY_HOP"),
        ]
    ),
    Mutation(
        _STRIP,
        "response: content-length",
        ReplaceStatements(
            SANITIZE,
            "sanitize_response_head",
            """
            length = int(value) if value.isdigit() else None
            continue
            """,
            "length = int(value) if value.isdigit() else None",
        ),
    ),
    Mutation(
        _STRIP,
        "plan: pylon's own x-request-id",
        ReplaceStatements(
            PLAN,
            "Planner.plan",
            'headers: list[Header] = [(b"x-request-id", request.request_id.encode("ascii"))]',
            "headers: list[Header] = []",
        ),
    ),
]


def table_entries() -> list[Mutation]:
    """One mutation per entry of every deny table and set in sanitize.py: each module-level
    UPPER_CASE name bound to a literal of constants (directly or inside `frozenset(...)`)."""
    source = Source(SANITIZE, Path(SANITIZE).read_text(encoding="utf-8"))
    out: list[Mutation] = []
    for statement in source.tree.body:
        found = _table(statement)
        if found is None:
            continue
        name, table = found
        for key in table_keys(table):
            text = source.segment(key)
            out.append(Mutation(_STRIP, f"{name} {text}", DropEntry(SANITIZE, name, text)))
    return out


def _table(statement: ast.stmt) -> tuple[str, Table] | None:
    """(name, literal) of a module-level table of constants, or None for any other statement."""
    table = table_of(statement)
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target = statement.targets[0]
    elif isinstance(statement, ast.AnnAssign):
        target = statement.target
    else:
        return None
    if table is None or not isinstance(target, ast.Name) or not _TABLE_NAME.fullmatch(target.id):
        return None
    try:
        ast.literal_eval(table)
    except ValueError:
        return None  # an entry is computed (`*sorted(...)`): not a table of names
    return target.id, table

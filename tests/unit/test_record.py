"""The request's record: an `Exchange` starts as exactly the record `RequestRecord` builds (its
init is inlined on the hot path, so this holds the two equal), and only the exchange writes it."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from pylon.core.record import RequestRecord
from pylon.observe import LogObserver
from pylon.proxy.exchange import Exchange

ROOT = Path(__file__).resolve().parents[2]


def record_fields() -> tuple[str, ...]:
    """`RequestRecord.__slots__`, read from its source: the class compiled by mypyc has none."""
    tree = ast.parse((ROOT / "pylon/core/record.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "RequestRecord":
            for statement in node.body:
                if isinstance(statement, ast.Assign) and any(
                    isinstance(target, ast.Name) and target.id == "__slots__"
                    for target in statement.targets
                ):
                    return tuple(ast.literal_eval(statement.value))
    raise AssertionError("RequestRecord declares no __slots__")


def test_a_new_exchange_is_a_fresh_record() -> None:
    loop = asyncio.new_event_loop()
    try:
        exchange = Exchange("h3", 7, 12.5, LogObserver(), loop)
    finally:
        loop.close()
    record = RequestRecord("h3", 7, 12.5)
    for name in record_fields():
        assert getattr(exchange, name) == getattr(record, name), name


def test_only_the_exchange_writes_a_record() -> None:
    """No module under pylon/ but the exchange (and the record's own init) assigns a record
    field on another object: the request's state is written in one place."""
    fields = set(record_fields())
    allowed = {
        ROOT / "pylon/core/record.py",
        ROOT / "pylon/proxy/exchange.py",
        # The booking authority's copy of a serving process's record, written only from the
        # moments that process's exchange sent it (`pylon.routing.remote`).
        ROOT / "pylon/routing/authority.py",
    }
    writers = []
    for path in sorted((ROOT / "pylon").rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (
                        isinstance(item, ast.Attribute)
                        and item.attr in fields
                        and isinstance(item.value, ast.Name)
                        and item.value.id in {"record", "exchange"}
                    ):
                        writers.append(f"{path.relative_to(ROOT)}:{node.lineno} {item.attr}")
    assert writers == []

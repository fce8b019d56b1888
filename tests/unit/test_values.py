"""pylon.core.values: the per-request trust-boundary values: frozen for mypy, free at run time.

mypy is run on a snippet that assigns one field of each value: every assignment must be refused
(so deleting the transform, or a value going back to a plain dataclass, fails here), and nothing
else in the snippet may be. At run time the same classes must stay slotted and unfrozen (a frozen
dataclass's `__init__` pays an `object.__setattr__` per field: the cost the transform avoids).
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pylon.core import values
from pylon.core.body import BodyView
from pylon.core.contract import HealthRequest, TraceContext, TunnelRequest
from pylon.core.head import RequestHead
from pylon.core.intake import Forward, Reject
from pylon.core.plan import ForwardPlan
from pylon.core.queue import QueueDecision
from pylon.core.sanitize import ResponseHead, SanitizedBody, SanitizedHeaders

ROOT = Path(__file__).resolve().parents[2]

# Each trust-boundary value, one of its fields and a value of that field's type.
STATIC_FROZEN = {
    TunnelRequest: ("model", '"other"'),
    HealthRequest: ("target", '"/other"'),
    TraceContext: ("tracestate", "None"),
    RequestHead: ("target", 'b"/other"'),
    BodyView: ("stream", "True"),
    SanitizedHeaders: ("stripped", "()"),
    SanitizedBody: ("body", "{}"),
    Forward: ("body", 'b""'),
    Reject: ("error", "value.error"),
    ForwardPlan: ("upstream", "None"),
    QueueDecision: ("level", "0"),
    ResponseHead: ("status", "0"),
}
# Dataclasses in pylon/core that are state, written by their own methods: not values.
MUTABLE_STATE = {"SseSplitter", "RateGuard"}
MYPY = [sys.executable, "-m", "mypy", "--strict", "--python-version", "3.11", "--no-error-summary"]


def mypy_errors(tmp_path: Path, source: str) -> list[str]:
    """mypy --strict's error lines for `source` (a module importing pylon from this checkout)."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(source), encoding="utf-8")
    result = subprocess.run(
        [*MYPY, "--ignore-missing-imports", "--cache-dir", str(tmp_path / "c"), str(snippet)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 2: mypy itself failed
    return [line for line in result.stdout.splitlines() if ": error: " in line]


def test_mypy_refuses_an_assignment_to_any_field_of_a_trust_boundary_value(tmp_path: Path) -> None:
    imports = "\n".join(f"from {cls.__module__} import {cls.__name__}" for cls in STATIC_FROZEN)
    functions = "\n".join(
        f"def assign_{cls.__name__}(value: {cls.__name__}) -> None:\n"
        f"    print(value.{name})  # reading is fine\n"
        f"    value.{name} = {literal}\n"
        for cls, (name, literal) in STATIC_FROZEN.items()
    )
    errors = mypy_errors(tmp_path, f"{imports}\n\n{functions}")
    refused = {
        cls.__name__
        for cls, (name, _) in STATIC_FROZEN.items()
        for line in errors
        if f'"{name}" defined in "{cls.__name__}" is read-only' in line
    }
    assert refused == {cls.__name__ for cls in STATIC_FROZEN}, errors
    assert len(errors) == len(STATIC_FROZEN), errors  # nothing else in the snippet is an error


def test_the_decorator_alone_makes_a_class_frozen_for_mypy(tmp_path: Path) -> None:
    errors = mypy_errors(
        tmp_path,
        """
        from dataclasses import field
        from pylon.core.values import static_frozen

        @static_frozen
        class Point:
            x: int
            tags: list[str] = field(default_factory=list)

        point = Point(1)
        point.x += 1
        point.tags.append("a")  # the field is frozen, not what it holds
        Point("one")
        """,
    )
    assert len(errors) == 2, errors
    assert 'Property "x" defined in "Point" is read-only' in errors[0]
    assert 'Argument 1 to "Point" has incompatible type "str"' in errors[1]


@pytest.mark.parametrize("cls", list(STATIC_FROZEN), ids=lambda cls: cls.__name__)
def test_a_trust_boundary_value_is_slotted_and_unfrozen_at_run_time(cls: type) -> None:
    assert dataclasses.is_dataclass(cls)
    assert "__slots__" in cls.__dict__
    assert not cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert cls.__setattr__ is object.__setattr__  # no per-field cost in __init__


def test_every_dataclass_in_the_core_is_frozen_statically_or_at_run_time() -> None:
    """A new per-request value in pylon/core must not come back as a plain, assignable one."""
    plain = []
    for path in sorted((ROOT / "pylon" / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name not in MUTABLE_STATE:
                plain += [f"{path.name}:{node.name}" for d in node.decorator_list if _plain(d)]
    assert plain == []


def _plain(decorator: ast.expr) -> bool:
    """Is `decorator` a `@dataclass` without `frozen=True`?"""
    call = decorator if isinstance(decorator, ast.Call) else None
    name = call.func if call is not None else decorator
    if not (isinstance(name, ast.Name) and name.id == "dataclass"):
        return False
    keywords = call.keywords if call is not None else []
    return not any(
        k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in keywords
    )


def test_the_decorator_keeps_defaults_and_field_options() -> None:
    @values.static_frozen
    class Sample:
        first: int
        second: list[int] = dataclasses.field(default_factory=list, repr=False)

    assert Sample(1) == Sample(1, [])
    assert repr(Sample(1)).endswith("Sample(first=1)")  # repr=False is honoured

"""`static_frozen`: a dataclass that is frozen for the type checker and costs nothing at run time.

A request's trust-boundary values (`TunnelRequest`, `RequestHead`, `ForwardPlan`, ...) are built
once or twice per request on the hot path. A `@dataclass(frozen=True)` pays one
`object.__setattr__` per field in its `__init__` (a measurable share of a request), so these are
plain slotted dataclasses at run time. `typing.dataclass_transform(frozen_default=True)` tells
mypy that a `@static_frozen` class is frozen all the same: assigning to any of its fields,
anywhere, is a type error under `mypy --strict` (tests/unit/test_values.py holds that).
Immutability is checked statically, as the rest of the contract is, instead of paid per request.

What differs from `frozen=True` at run time: an assignment is not refused there (mypy refuses it
first), and instances are not hashable (eq without frozen sets `__hash__` to None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

_Class = TypeVar("_Class")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def static_frozen(cls: type[_Class]) -> type[_Class]:
    """A slotted dataclass at run time; a frozen one to the type checker."""
    return dataclass(slots=True)(cls)

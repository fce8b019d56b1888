"""Fixtures every test directory shares: the one real stack (`tests/stack.py`)."""

from tests.fleet import make_fleet
from tests.stack import make_stack

__all__ = ["make_fleet", "make_stack"]

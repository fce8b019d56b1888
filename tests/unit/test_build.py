"""pylon.build: which modules of the optional mypyc build (setup.py) are loaded."""

from __future__ import annotations

import ast
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pylon.run  # noqa: F401  # the whole request path
from pylon.build import compiled_modules

ROOT = Path(__file__).resolve().parents[2]


def _listed() -> list[str]:
    """setup.py's COMPILED list, read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMPILED":
            return [str(ast.literal_eval(item)) for item in node.value.elts]  # type: ignore[attr-defined]
    raise AssertionError("setup.py has no COMPILED list")


def test_the_compiled_modules_are_extensions_from_the_list() -> None:
    compiled = compiled_modules()
    assert compiled == sorted(compiled)
    listed = {path.removesuffix(".py").replace("/", ".") for path in _listed()}
    for name in compiled:
        assert name in listed
        assert sys.modules[name].__file__.endswith(tuple(EXTENSION_SUFFIXES))  # type: ignore[union-attr]


def test_every_listed_module_exists() -> None:
    for path in _listed():
        assert (ROOT / path).is_file(), path

"""Fixtures every test directory shares: the one real stack (`tests/stack.py`), and the tiny
offline model dirs the tokenization tests use (`tests/tokenizer_models.py`).

No pylon a test starts binds the fixed default admin port (127.0.0.1:9089): settings built in
this process take an ephemeral one unless the test chooses (`tests/stack.py` and the CLI tests
also say so explicitly), so parallel or leftover processes never collide.
"""

import os
from pathlib import Path

import pytest

from pylon.build import compiled_modules
from tests.fleet import make_fleet
from tests.stack import make_stack

os.environ.setdefault("PYLON_ADMIN_LISTEN", "127.0.0.1:0")

__all__ = ["make_fleet", "make_stack", "tokenizer_models"]

# Whether pylon was imported from the mypyc build (`PYLON_MYPYC=1`, docs/mypyc-notes.md), whose
# compiled classes take no patched method, no fake in a typed slot and no interpreted subclass.
COMPILED = bool(compiled_modules())


def pytest_report_header() -> str:
    return f"pylon build: {'mypyc (compiled)' if COMPILED else 'pure Python'}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under the compiled build, skip the tests marked `interpreted` (they patch or fake a class
    it compiles: they run, and pin their contract, in the pure build)."""
    if not COMPILED:
        return
    skip = pytest.mark.skip(reason="patches or fakes a class the mypyc build compiles")
    for item in items:
        if item.get_closest_marker("interpreted") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model dirs by name (chatml, chatml_bos, parts, metaspace_first), built once."""
    pytest.importorskip("tokenizers", reason="pip install -e '.[dev]'")
    pytest.importorskip("jinja2", reason="pip install -e '.[dev]'")
    from tests.tokenizer_models import build_models

    return build_models(tmp_path_factory.mktemp("tokenizer-models"))

"""Fixtures every test directory shares: the one real stack (`tests/stack.py`), and the tiny
offline model dirs the tokenization tests use (`tests/tokenizer_models.py`)."""

from pathlib import Path

import pytest

from tests.stack import make_stack

__all__ = ["make_stack", "tokenizer_models"]


@pytest.fixture(scope="session")
def tokenizer_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model dirs by name (chatml, chatml_bos, parts, metaspace_first), built once."""
    pytest.importorskip("tokenizers", reason="pip install -e '.[dev]'")
    pytest.importorskip("jinja2", reason="pip install -e '.[dev]'")
    from tests.tokenizer_models import build_models

    return build_models(tmp_path_factory.mktemp("tokenizer-models"))

"""docs/api-contract.md names everything the code strips and every error code."""

from __future__ import annotations

from pathlib import Path

import pytest

from pylon.core.errors import ErrorCode
from pylon.core.sanitize import (
    DENIED_BODY_FIELDS,
    DENIED_NESTED_FIELDS,
    DENIED_NVEXT_FIELDS,
    DENIED_REQUEST_HEADER_PREFIXES,
    DENIED_REQUEST_HEADERS,
    DENIED_RESPONSE_HEADER_PREFIXES,
    HOP_BY_HOP,
    PYLON_OWNED_REQUEST_HEADERS,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "api-contract.md"


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.mark.parametrize("name", sorted(n.decode() for n in DENIED_REQUEST_HEADERS))
def test_denied_header_documented(doc: str, name: str) -> None:
    assert f"`{name}`" in doc


@pytest.mark.parametrize("prefix", [p.decode() for p, _ in DENIED_REQUEST_HEADER_PREFIXES])
def test_denied_prefix_documented(doc: str, prefix: str) -> None:
    assert f"`{prefix}*`" in doc


@pytest.mark.parametrize(
    "name", sorted(h.decode() for h in HOP_BY_HOP | PYLON_OWNED_REQUEST_HEADERS)
)
def test_hop_by_hop_and_owned_documented(doc: str, name: str) -> None:
    assert f"`{name}`" in doc


@pytest.mark.parametrize("field", sorted(DENIED_BODY_FIELDS))
def test_body_field_documented(doc: str, field: str) -> None:
    assert f"| `{field}` |" in doc


@pytest.mark.parametrize("field", sorted(DENIED_NVEXT_FIELDS))
def test_nvext_field_documented(doc: str, field: str) -> None:
    assert f"`nvext.{field}`" in doc


@pytest.mark.parametrize(("parent", "child"), sorted(DENIED_NESTED_FIELDS))
def test_nested_field_documented(doc: str, parent: str, child: str) -> None:
    assert f"`{parent}.{child}`" in doc


@pytest.mark.parametrize("prefix", [p.decode() for p in DENIED_RESPONSE_HEADER_PREFIXES])
def test_response_prefix_documented(doc: str, prefix: str) -> None:
    assert f"`{prefix}*`" in doc


@pytest.mark.parametrize("code", list(ErrorCode))
def test_error_code_documented(doc: str, code: ErrorCode) -> None:
    assert f"| `{code.value}` | {code.status} | {code.title} |" in doc

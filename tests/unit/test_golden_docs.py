"""docs/api-contract.md section 4 and the golden list (tests/golden.py), in both directions.

Golden -> docs: every name pylon must strip is documented as stripped. Docs -> golden: every name
the docs claim is stripped is in the golden list (so it is tested, and the docs cannot promise a
strip nobody checks). Known gaps must not be documented as stripped. The existing
`test_docs.py` keeps checking pylon's tables against the same page.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import golden
from tests.golden import (
    ALL_BODY_FIELDS,
    BODY_FIELDS,
    HOP_BY_HOP,
    NESTED_FIELDS,
    NVEXT_FIELDS,
    PYLON_OWNED,
    REQUEST_HEADER_PREFIXES,
    REQUEST_HEADERS,
    RESPONSE_HEADER_PREFIXES,
    RESPONSE_HEADERS,
    TUNNEL_HEADERS,
    Golden,
    enforced,
)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api-contract.md"
TICKED = re.compile(r"`([^`]+)`")

HEADER_NAMES = {e.name for e in enforced(REQUEST_HEADERS + HOP_BY_HOP + PYLON_OWNED)}
PREFIXES = {e.name for e in enforced(REQUEST_HEADER_PREFIXES)}
BODY_PATHS = {e.name for e in enforced(ALL_BODY_FIELDS)}


def subsections() -> dict[str, str]:
    """Section 4's subsections by number ("4.1" -> text)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## 4. ")
    end = text.index("\n## 5. ", start)
    parts = re.split(r"\n### (4\.\d+) ", text[start:end])
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def listed(section: str) -> set[str]:
    """Names the docs list as stripped: ticked tokens in table rows and bullet points."""
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith(("|", "- ")):
            names.update(TICKED.findall(line))
    return names


def documented(*numbers: str) -> set[str]:
    return set().union(*(TICKED.findall(subsections()[n]) for n in numbers))


# --- docs -> golden ------------------------------------------------------------------------------


def test_every_documented_stripped_header_is_golden() -> None:
    names = set().union(*(listed(subsections()[n]) for n in ("4.1", "4.2", "4.3")))
    assert names, "section 4 parsed to nothing"
    headers = {n.lower() for n in names if not n.endswith("*")}
    prefixes = {n[:-1] for n in names if n.endswith("*")}
    assert headers - HEADER_NAMES == set(), "documented as stripped, missing from tests/golden.py"
    assert prefixes - PREFIXES == set(), "documented as stripped, missing from tests/golden.py"


def test_every_documented_stripped_body_field_is_golden() -> None:
    top = listed(subsections()["4.4"])
    nested = listed(subsections()["4.5"]) | listed(subsections()["4.6"])
    assert top and nested
    assert top - BODY_PATHS == set()
    assert nested - BODY_PATHS == set()


def test_documented_underscore_twins_are_twins_of_golden_names() -> None:
    twins = {n for n in TICKED.findall(subsections()["4.1"]) if "_" in n and n != "_"}
    assert twins
    known = HEADER_NAMES | set(TUNNEL_HEADERS)
    assert {t for t in twins if t.replace("_", "-") not in known} == set()


def test_documented_response_strip_is_golden() -> None:
    names = {n.lower() for n in TICKED.findall(subsections()["4.8"])}
    response = {e.name for e in RESPONSE_HEADERS + HOP_BY_HOP}
    response |= {e.name + "*" for e in RESPONSE_HEADER_PREFIXES}
    assert names and names - response == set()


# --- golden -> docs ------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", enforced(REQUEST_HEADERS), ids=str)
def test_golden_header_documented(entry: Golden) -> None:
    assert entry.name in documented("4.1", "4.2"), entry.source


@pytest.mark.parametrize("entry", enforced(REQUEST_HEADER_PREFIXES), ids=str)
def test_golden_prefix_documented(entry: Golden) -> None:
    assert entry.name + "*" in documented("4.2"), entry.source


@pytest.mark.parametrize("entry", HOP_BY_HOP + PYLON_OWNED, ids=str)
def test_golden_hop_by_hop_and_owned_documented(entry: Golden) -> None:
    assert entry.name in {n.lower() for n in documented("4.3")}, entry.source


@pytest.mark.parametrize("entry", enforced(BODY_FIELDS), ids=str)
def test_golden_body_field_documented(entry: Golden) -> None:
    assert entry.name in listed(subsections()["4.4"]), entry.source


@pytest.mark.parametrize("entry", enforced(NVEXT_FIELDS + NESTED_FIELDS), ids=str)
def test_golden_nested_field_documented(entry: Golden) -> None:
    assert entry.name in documented("4.5", "4.6"), entry.source


@pytest.mark.parametrize("entry", RESPONSE_HEADERS + RESPONSE_HEADER_PREFIXES, ids=str)
def test_golden_response_header_documented(entry: Golden) -> None:
    text = DOC.read_text(encoding="utf-8")
    spelled = entry.name + "*" if entry in RESPONSE_HEADER_PREFIXES else entry.name
    assert f"`{spelled}`" in text, entry.source


def test_known_gaps_are_not_documented_as_stripped() -> None:
    every = REQUEST_HEADERS + REQUEST_HEADER_PREFIXES + ALL_BODY_FIELDS
    gaps = {e.name for e in every if e.gap}
    sections = subsections()
    stripped = set().union(*(listed(sections[n]) for n in ("4.1", "4.2", "4.4", "4.5", "4.6")))
    stripped = {n.removesuffix("*") for n in stripped}
    assert gaps & stripped == set()


# --- the golden list itself ----------------------------------------------------------------------


def test_golden_list_never_comes_from_pylon() -> None:
    # Only the standard library and pytest: no import of pylon, no way to read its tables.
    allowed = {"__future__", "collections", "dataclasses", "typing", "pytest"}
    imported: set[str] = set()
    for node in ast.walk(ast.parse(Path(golden.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in ("open", "__import__", "exec", "eval"), node.func.id
    assert imported <= allowed, imported - allowed


def test_golden_list_is_well_formed() -> None:
    groups = [
        REQUEST_HEADERS,
        REQUEST_HEADER_PREFIXES,
        HOP_BY_HOP,
        PYLON_OWNED,
        RESPONSE_HEADERS,
        RESPONSE_HEADER_PREFIXES,
        ALL_BODY_FIELDS,
    ]
    for group in groups:
        names = [e.name for e in group]
        assert len(names) == len(set(names)), names
        for entry in group:
            assert entry.name == entry.name.strip().lower(), entry
            assert entry.source.strip(), entry
    assert not {e.name for e in REQUEST_HEADERS} & {e.name for e in PYLON_OWNED}

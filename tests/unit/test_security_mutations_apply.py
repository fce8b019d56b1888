"""The mutation scripts stay in step with the code they mutate.

scripts/security_mutations.py and scripts/golden_mutations.py remove one control at a time from
pylon/, anchored on its syntax tree (scripts/mutations/anchors.py). When the code moves on, an
edit that no longer applies must fail loudly rather than silently stop checking its control:
here every mutation must apply and compile, every test named to catch it must exist, and the
anchors themselves must find what they name, ignore formatting, and refuse what is gone or
ambiguous.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

from mutations import runner  # noqa: E402
from mutations.anchors import (  # noqa: E402
    AddArguments,
    AnchorError,
    DropEntry,
    DropOperand,
    Edit,
    EmptyTable,
    InsertBefore,
    Never,
    ReplaceExpr,
    ReplaceStatements,
    ReturnAtOnce,
)
from mutations.catalogue import SECURITY  # noqa: E402
from mutations.golden import NAMED, table_entries  # noqa: E402
from mutations.spec import Mutation  # noqa: E402


def _script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_security_mutation_still_applies() -> None:
    result = _script("security_mutations.py", "--check")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "every named test exists" in result.stdout


def test_every_golden_mutation_still_applies() -> None:
    result = _script("golden_mutations.py", "--check")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "every test file exists" in result.stdout


@pytest.fixture
def in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the catalogue's paths are relative to the repository root


@pytest.mark.usefixtures("in_root")
@pytest.mark.parametrize(
    "mutation", [*SECURITY, *NAMED], ids=lambda m: m.name if isinstance(m, Mutation) else None
)
def test_mutation_builds_a_different_compiling_mutant(mutation: Mutation) -> None:
    assert runner.problem(mutation) is None
    for path, text in runner.build(mutation).items():
        assert text != (ROOT / path).read_text(encoding="utf-8")


def test_catalogue_labels_are_unique_and_every_mutation_names_a_test() -> None:
    names = [m.name for m in SECURITY]
    assert len(names) == len(set(names))
    assert all(m.tests and all(m.tests.values()) for m in SECURITY)


@pytest.mark.usefixtures("in_root")
def test_table_entries_cover_every_deny_table_of_the_strip() -> None:
    tables = {m.label.split(" ", 1)[0] for m in table_entries()}
    assert {
        "HOP_BY_HOP",
        "PYLON_OWNED_REQUEST_HEADERS",
        "DENIED_REQUEST_HEADERS",
        "DENIED_REQUEST_HEADER_PREFIXES",
        "DENIED_RESPONSE_HEADER_PREFIXES",
        "PYLON_OWNED_RESPONSE_HEADERS",
        "DENIED_BODY_FIELDS",
        "DENIED_NVEXT_FIELDS",
        "DENIED_NESTED_FIELDS",
        "_CONTRACT_TWINS",
    } <= tables


# --- the anchors, on a small module of their own ---

SAMPLE = '''
import dataclasses

LIMITS = {"a": 1, "b": 2}  # a table
NAMES = frozenset({b"x", b"y", b"z"})
PAIRS: tuple[str, ...] = ("first", *sorted({"second"}))
PREFIXES = ((b"p-", "one"), (b"q-", "two"))
ONLY = (b"only",)


class Guard:
    def check(self, size: int, kind: str) -> str:
        """Why not, or ok."""
        if kind == "ping":
            if size > LIMITS["a"]:
                return "ping flood"
        elif kind == "settings":
            if size > LIMITS["a"]:
                return "settings flood"
        if size > 10 or kind == "bad" or kind == "worse":
            return "refused"
        return "ok"


def build(limit: int) -> list[int]:
    values = [limit]
    values.append(limit * 2)
    return dataclasses.replace(Box(limit), extra=0).as_list(values)


@dataclasses.dataclass
class Box:
    limit: int
    extra: int = 1

    def as_list(self, values: list[int], *more: int) -> list[int]:
        return [*values, self.limit, self.extra, *more]
'''

# The same module formatted otherwise: line breaks, parentheses and comments move.
REFORMATTED = '''
import dataclasses

LIMITS = {
    "a": 1,  # the first
    "b": 2,
}
NAMES = frozenset(
    {b"x",
     b"y", b"z"}
)
PAIRS: tuple[str, ...] = (
    "first",
    *sorted({"second"}),
)
PREFIXES = (
    (b"p-", "one"),
    (b"q-", "two"),
)
ONLY = (b"only",)


class Guard:
    def check(self, size: int, kind: str) -> str:
        """Why not, or ok."""
        if kind == "ping":
            # pings
            if (size >
                    LIMITS["a"]):
                return "ping flood"
        elif (kind == "settings"):
            if size > LIMITS["a"]:
                return "settings flood"
        if (
            size > 10
            or kind == "bad"
            or kind == "worse"
        ):
            return "refused"
        return "ok"


def build(limit: int) -> list[int]:
    values = [limit]
    values.append(
        limit * 2
    )
    return dataclasses.replace(
        Box(limit), extra=0
    ).as_list(values)


@dataclasses.dataclass
class Box:
    limit: int
    extra: int = 1

    def as_list(self, values: list[int], *more: int) -> list[int]:
        return [*values, self.limit, self.extra, *more]
'''

PATH = "sample.py"


def _load(text: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(text, PATH, "exec"), namespace)
    return namespace


def _mutant(edit: Edit, text: str) -> dict[str, Any]:
    mutated = edit.apply(text)
    assert mutated != text
    return _load(mutated)


# (edit, what the mutant shows in place of the original's value)
CASES: list[tuple[Edit, str, object, object]] = [
    (
        Never(PATH, "Guard.check", 'size > LIMITS["a"]', under='kind == "ping"'),
        "Guard().check(50, 'ping')",
        "refused",
        "ping flood",
    ),
    (
        Never(PATH, "Guard.check", 'size > LIMITS["a"]', under='kind == "settings"'),
        "Guard().check(50, 'settings')",
        "refused",
        "settings flood",
    ),
    (
        ReplaceExpr(PATH, "Guard.check", "size > 10", "size > 100"),
        "Guard().check(50, 'x')",
        "ok",
        "refused",
    ),
    (
        DropOperand(PATH, "Guard.check", 'kind == "bad"'),
        "Guard().check(1, 'bad')",
        "ok",
        "refused",
    ),
    (
        ReplaceStatements(PATH, "Guard.check", 'return "refused"', 'return "let in"'),
        "Guard().check(50, 'x')",
        "let in",
        "refused",
    ),
    (
        ReplaceStatements(PATH, "build", "values.append(limit * 2)", ""),
        "build(3)",
        [3, 3, 0],
        [3, 6, 3, 0],
    ),
    (
        InsertBefore(PATH, "build", "values.append(limit * 2)", "values.append(-1)"),
        "build(3)",
        [3, -1, 6, 3, 0],
        [3, 6, 3, 0],
    ),
    (ReturnAtOnce(PATH, "Guard.check", '"always"'), "Guard().check(50, 'x')", "always", "refused"),
    # `limit` is used three times in `build`: `inside` picks the one passed to `Box`.
    (
        ReplaceExpr(PATH, "build", "limit", "limit + 1", inside="Box"),
        "build(3)",
        [3, 6, 4, 0],
        [3, 6, 3, 0],
    ),
    (
        AddArguments(PATH, "build", "dataclasses.replace(Box(limit), extra=0).as_list", "7, 8"),
        "build(3)",
        [3, 6, 3, 0, 7, 8],
        [3, 6, 3, 0],
    ),
    (DropEntry(PATH, "LIMITS", '"a"'), "sorted(LIMITS)", ["b"], ["a", "b"]),
    (DropEntry(PATH, "LIMITS", '"b"'), "sorted(LIMITS)", ["a"], ["a", "b"]),
    (DropEntry(PATH, "NAMES", 'b"y"'), "sorted(NAMES)", [b"x", b"z"], [b"x", b"y", b"z"]),
    (DropEntry(PATH, "NAMES", 'b"z"'), "sorted(NAMES)", [b"x", b"y"], [b"x", b"y", b"z"]),
    # A tuple left with one element stays a tuple (`("first")` would be a string).
    (DropEntry(PATH, "PAIRS", '*sorted({"second"})'), "PAIRS", ("first",), ("first", "second")),
    (DropEntry(PATH, "PAIRS", '"first"'), "PAIRS", ("second",), ("first", "second")),
    # A tuple element is named by its first item.
    (DropEntry(PATH, "PREFIXES", 'b"q-"'), "PREFIXES", ((b"p-", "one"),), None),
    (DropEntry(PATH, "ONLY", 'b"only"'), "ONLY", (), (b"only",)),
    (EmptyTable(PATH, "NAMES"), "NAMES", frozenset(), None),
]


@pytest.mark.parametrize("text", [SAMPLE, REFORMATTED], ids=["sample", "reformatted"])
@pytest.mark.parametrize(("edit", "probe", "mutated", "original"), CASES)
def test_an_anchor_makes_its_change_whatever_the_formatting(
    text: str, edit: Edit, probe: str, mutated: object, original: object
) -> None:
    if original is not None:
        assert eval(probe, _load(text)) == original
    assert eval(probe, _mutant(edit, text)) == mutated


def test_an_edit_changes_only_its_node() -> None:
    """The rest of the file, comments and parentheses included, stays byte for byte."""
    edit = Never(PATH, "Guard.check", 'size > LIMITS["a"]', under='kind == "ping"')
    test = 'size >\n                    LIMITS["a"]'
    assert REFORMATTED.count(test) == 1
    assert edit.apply(REFORMATTED) == REFORMATTED.replace(test, "False")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            Never(PATH, "Guard.inspect", "size > 10"),
            "no function, class or table named `Guard.inspect`",
        ),
        (Never(PATH, "Gate.check", "size > 10"), "no function, class or table named `Gate`"),
        (
            Never(PATH, "Guard.check", "size > 11"),
            "in `Guard.check`: `if size > 11:` not found",
        ),
        (
            Never(PATH, "Guard.check", 'size > LIMITS["a"]'),
            'in `Guard.check`: `if size > LIMITS["a"]:` found 2 times',
        ),
        (
            Never(PATH, "Guard.check", 'size > LIMITS["a"]', under='kind == "pong"'),
            "not found",
        ),
        (ReplaceExpr(PATH, "build", "limit * 3", "0"), "in `build`: expression `limit * 3`"),
        (ReplaceExpr(PATH, "build", "limit", "0"), "expression `limit` found"),
        (
            ReplaceStatements(PATH, "build", "values.append(limit * 3)", ""),
            "statements `values.append(limit * 3)` not found",
        ),
        (DropEntry(PATH, "LIMITS", '"c"'), 'in `LIMITS`: entry `"c"` not found'),
        (DropEntry(PATH, "Guard", '"c"'), "`Guard` is not a table"),
        (DropOperand(PATH, "Guard.check", 'kind == "good"'), 'operand `kind == "good"`'),
        (AddArguments(PATH, "build", "Crate", "1"), "call `Crate(...)` not found"),
        (ReturnAtOnce(PATH, "LIMITS"), "`LIMITS` is not a function"),
    ],
)
def test_an_edit_that_no_longer_applies_says_where_and_what(edit: Edit, message: str) -> None:
    with pytest.raises(AnchorError) as raised:
        edit.apply(SAMPLE)
    assert PATH in str(raised.value)
    assert message in str(raised.value)


def test_the_runner_reports_a_mutation_that_no_longer_applies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / PATH).write_text(SAMPLE, encoding="utf-8")
    gone = Mutation("guard", "size check off", Never(PATH, "Guard.check", "size > 99"))
    broken = Mutation("guard", "unbalanced", ReplaceExpr(PATH, "build", "limit * 2", "limit *"))
    works = Mutation("guard", "flood check off", DropOperand(PATH, "Guard.check", "size > 10"))
    moved = Mutation("guard", "moved", Never("gone.py", "Guard.check", "size > 10"))
    found = runner.problems([gone, works, broken, moved])
    assert found[0] == (
        "guard: size check off: does not apply: sample.py: in `Guard.check`: `if size > 99:` "
        "not found"
    )
    assert found[1].startswith("guard: unbalanced: the mutant does not compile")
    assert found[2] == (
        "guard: moved: does not apply: gone.py: no such file (the edit of `Guard.check` is there)"
    )
    assert len(found) == 3
    assert (tmp_path / PATH).read_text(encoding="utf-8") == SAMPLE  # nothing was written

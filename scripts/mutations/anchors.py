"""Edits of pylon's source anchored on its syntax tree, not on its exact text.

An edit names a file, a scope in it and what to change there. The scope is a function or method by
its qualified name (`Class.method`, `function`), or a module-level table by the name it is
assigned to (`DENIED_REQUEST_HEADERS`). Inside the scope the edit finds its node on the syntax
tree: an `if` by its test, an expression, a run of statements, a table entry by its key, an
operand of an `and`/`or`. Patterns are Python source, compared as syntax trees, so line breaks,
parentheses, comments and formatting are free to change, and so is all the code outside the scope.

An edit that no longer applies (the scope renamed or moved, the pattern gone, or found more than
once) raises `AnchorError`, naming the file, the scope and the pattern: a mutation must never
silently test nothing.

Each edit splices its text over the matched node's source span only, so the rest of the file,
comments included, stays byte for byte as it was.
"""

from __future__ import annotations

import ast
import re
import textwrap
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, TypeVar

# What a splice does: replace text[start:end] with the new text.
Splice = tuple[int, int, str]
Found = TypeVar("Found")

Table = ast.Dict | ast.Set | ast.Tuple | ast.List  # a table literal (see `DropEntry`)
_EMPTY_LITERAL = {ast.Dict: "{}", ast.Set: "set()", ast.Tuple: "()", ast.List: "[]"}


class AnchorError(Exception):
    """An edit that no longer applies to the code: the message names the file, the scope and
    what was looked for."""


def same(pattern: object, node: object) -> bool:
    """Whether two syntax trees are equal, ignoring positions and load/store context."""
    if type(pattern) is not type(node):
        return False
    if isinstance(pattern, ast.AST):
        return all(
            same(getattr(pattern, name, None), getattr(node, name, None))
            for name in pattern._fields
            if name not in ("ctx", "type_comment")
        )
    if isinstance(pattern, list):
        assert isinstance(node, list)
        return len(pattern) == len(node) and all(map(same, pattern, node))
    return pattern == node


def parse_expression(source: str) -> ast.expr:
    return ast.parse(textwrap.dedent(source).strip(), mode="eval").body


def parse_statements(source: str) -> list[ast.stmt]:
    return ast.parse(textwrap.dedent(source).strip("\n")).body


def parse_entry(source: str) -> ast.expr:
    """One element of a table, as written inside it (a starred element too: `*names`)."""
    single = ast.parse(f"({source.strip()},)", mode="eval").body
    assert isinstance(single, ast.Tuple) and len(single.elts) == 1, source
    return single.elts[0]


class Source:
    """One file's text and syntax tree, with node spans as offsets into the text."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        try:
            self.tree = ast.parse(text, path)
        except SyntaxError as exc:
            raise AnchorError(f"{path}: does not parse: {exc}") from exc
        # Only "\n" ends a line for ast (not the form feeds `str.splitlines` also splits on).
        self._line_starts = [0, *(m.end() for m in re.finditer("\n", text)), len(text) + 1]

    def offset(self, line: int, column: int) -> int:
        """The text offset of an ast position (its column counts UTF-8 bytes, not characters)."""
        start = self._line_starts[line - 1]
        text = self.text[start : self._line_starts[line]]
        return start + len(text.encode("utf-8")[:column].decode("utf-8"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end_line, end_column = node.end_lineno, node.end_col_offset  # type: ignore[attr-defined]
        return start, self.offset(end_line, end_column)

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def indent_before(self, node: ast.stmt) -> str | None:
        """The indentation a statement starts after, or None when code precedes it on its line."""
        start = self.offset(node.lineno, node.col_offset)
        before = self.text[self._line_starts[node.lineno - 1] : start]
        return before if not before.strip() else None

    def scope(self, name: str) -> ast.AST:
        """The function, class or module-level assignment named `name` (dotted for a method)."""
        node: ast.AST = self.tree
        parts = name.split(".")
        for depth in range(len(parts)):
            body: list[ast.stmt] = getattr(node, "body", [])
            found = [child for child in body if _defines(child, parts[depth])]
            if len(found) != 1:
                looked_for = ".".join(parts[: depth + 1])
                count = "no" if not found else str(len(found))
                raise AnchorError(
                    f"{self.path}: {count} function, class or table named `{looked_for}` "
                    f"(the edit of `{name}` needs exactly one)"
                )
            node = found[0]
        return node


def _defines(statement: ast.stmt, name: str) -> bool:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return statement.name == name
    if isinstance(statement, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in statement.targets)
    if isinstance(statement, ast.AnnAssign):
        return isinstance(statement.target, ast.Name) and statement.target.id == name
    return False


def _within(roots: Iterable[ast.AST]) -> set[int]:
    """The ids of every node under `roots` (the roots included)."""
    return {id(node) for root in roots for node in ast.walk(root)}


def _statement_lists(scope: ast.AST) -> Iterator[list[ast.stmt]]:
    for node in ast.walk(scope):
        for name in ("body", "orelse", "finalbody"):
            statements = getattr(node, name, None)
            if isinstance(statements, list) and statements and isinstance(statements[0], ast.stmt):
                yield statements


def _reindent(source: str, indent: str) -> str:
    """`source` (statements) for a place whose first line is already indented by `indent`."""
    lines = textwrap.dedent(source).strip("\n").splitlines() or ["pass"]
    return "\n".join([lines[0], *(indent + line if line else "" for line in lines[1:])])


@dataclass(frozen=True)
class Edit(ABC):
    """One change to one file, found inside `scope` (see the module docstring)."""

    path: str  # the file, relative to the repository root
    scope: str  # `Class.method`, `function` or a module-level table's name

    def apply(self, text: str) -> str:
        """`text` (the file's contents) with this edit made; raises `AnchorError`."""
        source = Source(self.path, text)
        start, end, new = self.splice(source, source.scope(self.scope))
        return text[:start] + new + text[end:]

    @abstractmethod
    def splice(self, source: Source, scope: ast.AST) -> Splice:
        """Where the change goes and what it writes there."""

    @abstractmethod
    def looked_for(self) -> str:
        """What the edit matches, for the error when it matches nothing or more than once."""

    def one(self, found: list[Found], what: str) -> Found:
        """The one match; `AnchorError` for none or several."""
        if len(found) == 1:
            return found[0]
        where = f"{self.path}: in `{self.scope}`: {what}"
        if not found:
            raise AnchorError(f"{where} not found")
        raise AnchorError(f"{where} found {len(found)} times (needs exactly one: narrow it)")


@dataclass(frozen=True)
class Never(Edit):
    """`if <condition>:` (or `elif`) becomes `if False:`: the check is there and never fires."""

    condition: str  # the whole test, as source
    # The test of an enclosing `if` whose body holds the check: tells apart identical checks in
    # the branches of one dispatch (`elif isinstance(event, PingReceived):`).
    under: str | None = None
    VERDICT: ClassVar[str] = "False"

    def looked_for(self) -> str:
        where = f" inside `if {self.under}:`" if self.under else ""
        return f"`if {self.condition}:`{where}"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        test = parse_expression(self.condition)
        found = [n for n in ast.walk(scope) if isinstance(n, ast.If) and same(test, n.test)]
        if self.under is not None:
            outer = parse_expression(self.under)
            outers = [n for n in ast.walk(scope) if isinstance(n, ast.If) and same(outer, n.test)]
            allowed = _within(s for n in outers for s in n.body)
            found = [n for n in found if id(n) in allowed]
        return (*source.span(self.one(found, self.looked_for()).test), self.VERDICT)


@dataclass(frozen=True)
class Always(Never):
    """`if <condition>:` becomes `if True:`: the branch (often an early return) always runs."""

    VERDICT: ClassVar[str] = "True"


@dataclass(frozen=True)
class ReplaceExpr(Edit):
    """The one expression equal to `old` becomes `(new)`."""

    old: str
    new: str
    # Only expressions among the arguments of a call to this (`StreamTable`): for a name that
    # the scope also uses elsewhere.
    inside: str | None = None

    def looked_for(self) -> str:
        where = f" in the arguments of `{self.inside}(...)`" if self.inside else ""
        return f"expression `{self.old}`{where}"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        pattern = parse_expression(self.old)
        found = [n for n in ast.walk(scope) if isinstance(n, ast.expr) and same(pattern, n)]
        if self.inside is not None:
            calls = [
                n
                for n in ast.walk(scope)
                if isinstance(n, ast.Call) and ast.unparse(n.func) == self.inside
            ]
            allowed = _within(a for c in calls for a in (*c.args, *(k.value for k in c.keywords)))
            found = [n for n in found if id(n) in allowed]
        return (*source.span(self.one(found, self.looked_for())), f"({self.new.strip()})")


@dataclass(frozen=True)
class ReplaceStatements(Edit):
    """The one run of consecutive statements equal to `old` becomes `new` (empty: `pass`)."""

    old: str
    new: str

    def looked_for(self) -> str:
        return "statements `" + " / ".join(textwrap.dedent(self.old).strip().splitlines()) + "`"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        pattern = parse_statements(self.old)
        width = len(pattern)
        runs = [
            statements[i : i + width]
            for statements in _statement_lists(scope)
            for i in range(len(statements) - width + 1)
            if all(map(same, pattern, statements[i : i + width]))
        ]
        run = self.one(runs, self.looked_for())
        first, last = run[0], run[-1]
        indent = source.indent_before(first)
        if indent is None:
            if "\n" in textwrap.dedent(self.new).strip():
                raise AnchorError(
                    f"{self.path}: in `{self.scope}`: {self.looked_for()} shares its line with "
                    "other code: a replacement of several lines cannot go there"
                )
            indent = ""
        start = source.span(first)[0]
        return start, source.span(last)[1], _reindent(self.new, indent)


@dataclass(frozen=True)
class InsertBefore(Edit):
    """`new` runs just before the one run of statements equal to `anchor`."""

    anchor: str
    new: str

    def looked_for(self) -> str:
        return ReplaceStatements(self.path, self.scope, self.anchor, "").looked_for()

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        both = textwrap.dedent(self.new).strip("\n") + "\n" + textwrap.dedent(self.anchor)
        return ReplaceStatements(self.path, self.scope, self.anchor, both).splice(source, scope)


@dataclass(frozen=True)
class ReturnAtOnce(Edit):
    """The function returns `value` before its first statement (after its docstring)."""

    value: str = ""  # empty: a bare `return`

    def looked_for(self) -> str:
        return "a function body"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        if not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            raise AnchorError(f"{self.path}: `{self.scope}` is not a function")
        body = scope.body
        has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        statements = body[1:] if has_docstring else body
        indent = source.indent_before(statements[0]) if statements else None
        if indent is None:
            raise AnchorError(f"{self.path}: `{self.scope}` has no statement on a line of its own")
        first = statements[0]
        start = source.span(first)[0]
        return start, start, f"return {self.value}".rstrip() + "\n" + indent


def table_of(statement: ast.AST) -> Table | None:
    """The literal an assignment binds, directly or as the one argument of a call
    (`frozenset({...})`); None for any other statement."""
    value = statement.value if isinstance(statement, ast.Assign | ast.AnnAssign) else None
    if isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords:
        value = value.args[0]
    return value if isinstance(value, Table) else None


def _table(source: Source, scope: ast.AST, edit: Edit) -> Table:
    table = table_of(scope)
    if table is None:
        raise AnchorError(
            f"{source.path}: `{edit.scope}` is not a table (a dict, set, tuple or list literal, "
            "or a call on one)"
        )
    return table


def table_keys(table: Table) -> list[ast.expr]:
    """What names each entry of a table: a dict's keys, or the elements of a set, tuple or
    list (of an element that is itself a tuple, its first item: `(prefix, reason)`)."""
    if isinstance(table, ast.Dict):
        return [k if k is not None else v for k, v in zip(table.keys, table.values, strict=True)]
    return [e.elts[0] if isinstance(e, ast.Tuple) and e.elts else e for e in table.elts]


@dataclass(frozen=True)
class DropEntry(Edit):
    """The entry of the table `scope` named `key` (a dict key, a set/tuple element, or the first
    item of a tuple element) is deleted, with its separator."""

    key: str

    def looked_for(self) -> str:
        return f"entry `{self.key}`"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        table = _table(source, scope, self)
        pattern = parse_entry(self.key)
        keys = table_keys(table)
        index = keys.index(self.one([k for k in keys if same(pattern, k)], self.looked_for()))
        spans = [_entry_span(source, table, i) for i in range(len(keys))]
        if len(spans) == 1:
            return (*source.span(table), _EMPTY_LITERAL[type(table)])
        if isinstance(table, ast.Tuple) and len(spans) == 2:  # `(a, b)` without b is `(a,)`
            kept = source.segment(table.elts[1 - index])
            return (*source.span(table), f"({kept},)")
        if index < len(spans) - 1:  # up to the next entry: its comma and line break go too
            return spans[index][0], spans[index + 1][0], ""
        return spans[index - 1][1], spans[index][1], ""  # the last: from the previous one's end


def _entry_span(source: Source, table: Table, index: int) -> tuple[int, int]:
    if isinstance(table, ast.Dict):
        key, value = table.keys[index], table.values[index]
        if key is None:  # `**other`
            return source.text.rindex("**", 0, source.span(value)[0]), source.span(value)[1]
        return source.span(key)[0], source.span(value)[1]
    return source.span(table.elts[index])


@dataclass(frozen=True)
class EmptyTable(Edit):
    """The table `scope` loses every entry (`frozenset({...})` becomes `frozenset(set())`)."""

    def looked_for(self) -> str:
        return "a table"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        table = _table(source, scope, self)
        return (*source.span(table), _EMPTY_LITERAL[type(table)])


@dataclass(frozen=True)
class DropOperand(Edit):
    """The one operand equal to `operand` leaves its `and`/`or` chain (`a or b or c` without
    `b` is `a or c`): one condition of a compound check removed, the others kept."""

    operand: str

    def looked_for(self) -> str:
        return f"`and`/`or` operand `{self.operand}`"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        pattern = parse_expression(self.operand)
        chains = [n for n in ast.walk(scope) if isinstance(n, ast.BoolOp)]
        found = [value for chain in chains for value in chain.values if same(pattern, value)]
        operand = self.one(found, self.looked_for())
        chain = next(c for c in chains if any(v is operand for v in c.values))
        rest = [v for v in chain.values if v is not operand]
        kept = rest[0] if len(rest) == 1 else ast.BoolOp(op=chain.op, values=rest)
        return (*source.span(chain), f"({ast.unparse(kept)})")


@dataclass(frozen=True)
class AddArguments(Edit):
    """The one call to `call` gets `arguments` (source, e.g. `a=1, b=2`) after its own."""

    call: str  # the callee as written: `QuicServer`, `self._make`
    arguments: str

    def looked_for(self) -> str:
        return f"call `{self.call}(...)`"

    def splice(self, source: Source, scope: ast.AST) -> Splice:
        calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call)]
        found = [n for n in calls if ast.unparse(n.func) == self.call]
        call = self.one(found, self.looked_for())
        given = [*call.args, *(k.value for k in call.keywords)]
        if not given:
            end = source.span(call)[1] - 1  # just inside the closing parenthesis
            return end, end, self.arguments
        end = max(source.span(node)[1] for node in given)
        return end, end, f", {self.arguments}"


def apply_all(edits: Iterable[Edit], texts: dict[str, str]) -> dict[str, str]:
    """Each file's text with `edits` made in order (later edits see the earlier ones); `texts`
    holds the originals by path and is not changed."""
    mutated = dict(texts)
    for edit in edits:
        mutated[edit.path] = edit.apply(mutated[edit.path])
    return mutated

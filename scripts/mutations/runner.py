"""Make a mutation, run the tests named for it per transport, restore pylon/, report.

Shared by scripts/security_mutations.py and scripts/golden_mutations.py. A mutant is built in
memory first (`build`): `check` proves every mutation applies and compiles without writing a
file. `mutated` writes it into pylon/ and restores pylon/ with `git checkout` however the run
ends, so the scripts belong in a scratch worktree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mutations.anchors import AnchorError, apply_all
from mutations.spec import Mutation

# The whole suite, for --full ("does any test at all catch it?").
SUITE = ["tests/unit", "tests/integration", "tests/transport"]
TEST_TIMEOUT_S = 900  # one pytest run of a mutant; a hung mutant counts as not caught


def build(mutation: Mutation) -> dict[str, str]:
    """The mutated text of each file the mutation edits (nothing is written); `AnchorError`
    when an edit no longer applies."""
    originals = {}
    for edit in mutation.all_edits:
        if not Path(edit.path).is_file():
            raise AnchorError(f"{edit.path}: no such file (the edit of `{edit.scope}` is there)")
        originals[edit.path] = Path(edit.path).read_text(encoding="utf-8")
    return apply_all(mutation.all_edits, originals)


def problem(mutation: Mutation) -> str | None:
    """Why the mutation cannot be used (it does not apply, or its mutant does not compile)."""
    try:
        mutated = build(mutation)
    except AnchorError as exc:
        return f"{mutation.name}: does not apply: {exc}"
    for path, text in mutated.items():  # a mutant that does not even compile would prove nothing
        try:
            compile(text, path, "exec")
        except SyntaxError as exc:
            return f"{mutation.name}: the mutant does not compile: {exc}"
    return None


def problems(mutations: Iterable[Mutation]) -> list[str]:
    return [found for m in mutations if (found := problem(m)) is not None]


def restore() -> None:
    subprocess.run(["git", "checkout", "--", "pylon"], check=True)


@contextmanager
def mutated(mutation: Mutation) -> Iterator[None]:
    """pylon/ with the mutation made, restored afterwards whatever happens."""
    texts = build(mutation)
    try:
        for path, text in texts.items():
            Path(path).write_text(text, encoding="utf-8")
        yield
    finally:
        restore()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path.cwd())}


@dataclass(frozen=True)
class TestRun:
    """What one pytest run said."""

    code: int  # pytest's exit status
    failed: list[str]  # node ids that failed or errored
    failures: list[str]  # their summary lines ("FAILED <id> - <reason>")
    last: str  # the last line of the output (pytest's tally), or the end of stderr

    @property
    def first_failure(self) -> str:
        return self.failures[0] if self.failures else self.last


def run_tests(nodes: Sequence[str], extra: Sequence[str] = ()) -> TestRun:
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *extra, *nodes]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=TEST_TIMEOUT_S)
    summary = done.stdout.partition("short test summary info")[2]
    failures = [line for line in summary.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    failed = [line.split(" ", 1)[1].split(" - ", 1)[0] for line in failures]
    lines = done.stdout.strip().splitlines()
    last = lines[-1] if lines else done.stderr.strip()[-200:]
    return TestRun(done.returncode, failed, failures, last)


# --- named tests ---


def _pattern(spec: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in spec.split("*")) + r"\Z")


def named_files(mutations: Iterable[Mutation]) -> set[str]:
    return {spec.split("::")[0] for m in mutations for specs in m.tests.values() for spec in specs}


def collect(files: set[str]) -> list[str]:
    """Every test node id in `files` (those that exist)."""
    present = sorted(f for f in files if Path(f).exists())
    if not present:
        return []
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run([*cmd, *present], capture_output=True, text=True, env=env())
    return [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def expand(spec: str, known: list[str]) -> list[str]:
    pattern = _pattern(spec)
    return [node for node in known if pattern.match(node)]


def missing_tests(mutations: Iterable[Mutation], known: list[str]) -> list[str]:
    return [
        f"{m.label} [{t}]: no test matches {spec}"
        for m in mutations
        for t, specs in m.tests.items()
        for spec in specs
        if not expand(spec, known)
    ]


def named_nodes(mutations: Iterable[Mutation], known: list[str]) -> list[str]:
    return sorted(
        {n for m in mutations for s in m.tests.values() for spec in s for n in expand(spec, known)}
    )


# --- auditing, per transport ---


@dataclass
class Result:
    mutation: Mutation
    caught: dict[str, list[str]]  # transport -> failing tests named for it
    missed: list[str]  # transports none of whose tests failed
    note: str
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.missed


def audit(mutation: Mutation, known: list[str]) -> Result:
    """The named tests against the mutant: caught when each transport has a failing one."""
    per = {t: [n for s in specs for n in expand(s, known)] for t, specs in mutation.tests.items()}
    nodes = sorted({n for found in per.values() for n in found})
    started = time.monotonic()
    with mutated(mutation):
        run = run_tests(nodes) if nodes else TestRun(5, [], [], "no tests named")
    caught = {t: [n for n in found if n in run.failed] for t, found in per.items()}
    missed = [t for t, found in caught.items() if not found]
    note = "" if run.code in (0, 1) else f"pytest exit {run.code}: {run.last}"
    return Result(mutation, caught, missed, note, time.monotonic() - started)


def audit_full(mutation: Mutation) -> Result:
    """The whole suite against the mutant (-x): caught when any test fails."""
    hints = sorted(h for h in named_files([mutation]) if Path(h).exists())
    started = time.monotonic()
    with mutated(mutation):
        # The likely catchers first (pytest would fold them into the suite's own order).
        run = run_tests(hints, extra=["-x"]) if hints else TestRun(5, [], [], "")
        if run.code != 1:
            run = run_tests(SUITE, extra=["-x"])
    if run.code == 1 and run.failed:
        return Result(mutation, {"any": run.failed[:1]}, [], "", time.monotonic() - started)
    note = "" if run.code == 0 else f"pytest exit {run.code}: {run.last}"
    return Result(mutation, {}, ["any"], note, time.monotonic() - started)


def _short(node: str) -> str:
    path, _, name = node.partition("::")
    return f"{Path(path).stem}::{name}"


def row(result: Result, markdown: bool) -> str:
    m = result.mutation
    verdict = "caught" if result.ok else f"SURVIVED ({', '.join(result.missed)})"
    by = "; ".join(f"{t}: {_short(tests[0])}" for t, tests in result.caught.items() if tests)
    if markdown:
        transports = ", ".join(m.tests) or "-"
        return f"| {m.control} | {m.label} | {transports} | {verdict} | {by or result.note} |"
    return f"{m.name:<88} {verdict:<20} {by or result.note}"


def report(results: Sequence[Result], markdown: bool) -> int:
    """Print the survivors (and the Markdown table); the exit status: 1 if any survived."""
    survivors = [r for r in results if not r.ok]
    print(f"\n{len(results)} mutations, {len(survivors)} survived")
    for r in survivors:
        print(f"  SURVIVED: {r.mutation.name} ({', '.join(r.missed)})")
    if markdown:
        print("\n| Control | Mutation | Transports | Verdict | Caught by |\n|---|---|---|---|---|")
        for r in results:
            print(row(r, True))
    return 1 if survivors else 0

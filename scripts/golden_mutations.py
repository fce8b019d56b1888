"""Delete deny-table entries and strip rules one at a time; the golden tests must fail for each.

Run it in a scratch git worktree, never in a checkout you care about: it edits pylon/ in place and
restores each file with `git checkout` after each mutation.

    git worktree add --detach /tmp/wt-mut golden-lists
    cd /tmp/wt-mut && python scripts/golden_mutations.py [--e2e] [--old] [--all-entries]

--e2e also runs tests/transport/test_golden_every_protocol.py for the named mutations; --old runs
the pre-existing (table-generated) tests too, for comparison; --all-entries deletes every entry
of every table, one at a time, against the golden unit tests; --check only checks that every
mutation (the named ones and every table entry) applies, and that the test files exist.

The mutations are in scripts/mutations/golden.py, anchored on the function or the table's name
(see scripts/mutations/anchors.py); the runner is shared with scripts/security_mutations.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mutations import runner
from mutations.golden import NAMED, table_entries

GOLDEN_UNIT = [
    "tests/unit/test_golden_headers.py",
    "tests/unit/test_golden_body.py",
    "tests/unit/test_golden_docs.py",
]
GOLDEN_E2E = ["tests/transport/test_golden_every_protocol.py"]
OLD = [
    "tests/unit/test_sanitize_headers.py",
    "tests/unit/test_sanitize_body.py",
    "tests/unit/test_docs.py",
    "tests/unit/test_plan.py",
    "tests/integration/test_forwarding.py",
    "tests/transport/test_contract_every_protocol.py",
]


def run(tests: list[str]) -> tuple[bool, str]:
    """(caught: the run failed, its first failure or its tally) of the tests against pylon/."""
    done = runner.run_tests(tests, extra=["-x"])
    return done.code != 0, done.first_failure


def check() -> None:
    mutations = NAMED + table_entries()
    found = runner.problems(mutations)
    found += [f"no test file {f}" for f in GOLDEN_UNIT + GOLDEN_E2E + OLD if not Path(f).exists()]
    if found:
        print("\n".join(found))
        sys.exit(2)
    print(f"{len(mutations)} mutations apply; every test file exists")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--old", action="store_true")
    parser.add_argument("--all-entries", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        check()
        return
    runner.restore()
    mutations = NAMED + (table_entries() if args.all_entries else [])
    unusable = runner.problems(mutations)
    if unusable:
        raise SystemExit("\n".join(unusable))
    caught, detail = run(GOLDEN_UNIT)
    assert not caught, f"the golden tests fail before any mutation: {detail}"
    survivors = []
    for mutation in mutations:
        with runner.mutated(mutation):
            results = {"golden unit": run(GOLDEN_UNIT)}
            if args.e2e and mutation in NAMED:
                results["golden e2e"] = run(GOLDEN_E2E)
            if args.old and mutation in NAMED:
                results["old suite"] = run(OLD)
        verdicts = "; ".join(
            f"{kind}: {'FAILS' if bad else 'passes'}" for kind, (bad, _) in results.items()
        )
        print(f"{mutation.label:<55} {verdicts}")
        print(f"    first failure: {results['golden unit'][1]}", flush=True)
        if not results["golden unit"][0]:
            survivors.append(mutation.label)
    print(f"\n{len(mutations)} mutations, {len(survivors)} survived the golden unit tests")
    for label in survivors:
        print(f"  SURVIVED: {label}")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()

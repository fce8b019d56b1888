"""Remove or weaken one security control at a time; some test must fail for each, per transport.

The project rule: every security control needs a test that fails when that control is removed, on
every transport it applies to. Each mutation (the catalogue is scripts/mutations/, one module per
control area) edits pylon/ in place, anchored on the syntax tree (a function and the `if`,
expression or statements in it), runs the tests named for each transport it applies to, and
restores pylon/ with `git checkout`. A mutation is caught when, for every transport it lists, at
least one of that transport's tests fails. `core` stands for a transport-neutral check reached
by unit tests. A mutation that no longer applies stops the run, naming the function and what was
not found in it.

Run it in a scratch git worktree, never in a checkout you care about:

    git worktree add --detach /tmp/wt-sec HEAD
    cd /tmp/wt-sec && python scripts/security_mutations.py [--only TEXT] [--full] [--check]

--only TEXT   run only the mutations whose label contains TEXT (repeatable)
--check       only check that every mutation applies and every named test exists
--full        instead of the named tests, run the whole suite (tests/unit, tests/integration,
              tests/transport) with -x and report the first failure: "does any test at all catch
              it?" (the audit's "before" column, where the named tests may not exist yet)
--markdown    print the final table as Markdown
"""

from __future__ import annotations

import argparse
import sys

from mutations import runner
from mutations.catalogue import SECURITY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    mutations = [m for m in SECURITY if not args.only or any(t in m.name for t in args.only)]
    if not args.check:
        runner.restore()  # --check writes nothing: it may run in a checkout with work in progress
    known = runner.collect(runner.named_files(mutations))
    # An edit that no longer applies is always fatal; a named test that does not exist is not
    # under --full (the audit's "before" column, where the named tests may not exist yet).
    found = runner.problems(mutations)
    if not args.full:
        found += runner.missing_tests(mutations, known)
    if found:
        print("\n".join(found))
        sys.exit(2)
    if args.check:
        print(f"{len(mutations)} mutations apply; every named test exists")
        return
    if not args.full:
        before = runner.run_tests(runner.named_nodes(mutations, known))
        failing = before.failed or before.last
        assert before.code == 0, f"the named tests fail before any mutation: {failing}"
    results = []
    for m in mutations:
        result = runner.audit_full(m) if args.full else runner.audit(m, known)
        results.append(result)
        print(runner.row(result, False), f"({result.seconds:.0f} s)", flush=True)
    sys.exit(runner.report(results, args.markdown))


if __name__ == "__main__":
    main()

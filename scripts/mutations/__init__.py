"""The mutation catalogue and its runner, shared by scripts/security_mutations.py and
scripts/golden_mutations.py.

A mutation removes or weakens one security control of pylon/ (`spec.Mutation`): its edits are
anchored on the syntax tree (`anchors`), so that a refactor which keeps the control keeps the
mutation applying, and one which moves or rewrites it makes the mutation fail loudly. The
catalogue is split by control area, one module each (`catalogue` lists them in order); `golden`
holds the deny-table and strip-rule mutations; `runner` applies a mutation, runs the tests named
for it per transport, restores pylon/ with `git checkout` and reports.

After a refactor, `python scripts/security_mutations.py --check` (and `golden_mutations.py
--check`; tests/unit/test_security_mutations_apply.py runs both) names each edit that no longer
applies: the file, the function and the pattern. Point the edit at the control's new home (its
`path` and `scope`, the pattern if the check itself was rewritten) and keep its label and tests:
the mutation must still remove the same control.
"""

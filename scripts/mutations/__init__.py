"""The mutation catalogue and its runner, shared by scripts/security_mutations.py and
scripts/golden_mutations.py.

A mutation removes or weakens one security control of pylon/ (`spec.Mutation`): its edits are
anchored on the syntax tree (`anchors`), so that a refactor which keeps the control keeps the
mutation applying, and one which moves or rewrites it makes the mutation fail loudly. The
catalogue is split by control area, one module each (`catalogue` lists them in order); `golden`
holds the deny-table and strip-rule mutations; `runner` applies a mutation, runs the tests named
for it per transport, restores pylon/ with `git checkout` and reports.
"""

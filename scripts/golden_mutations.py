"""Delete deny-table entries and strip rules one at a time; the golden tests must fail for each.

Run it in a scratch git worktree, never in a checkout you care about: it edits pylon/ in place and
restores each file with `git checkout` after each mutation.

    git worktree add --detach /tmp/wt-mut golden-lists
    cd /tmp/wt-mut && python scripts/golden_mutations.py [--e2e] [--old] [--all-entries]

--e2e also runs tests/transport/test_golden_every_protocol.py for the named mutations; --old runs
the pre-existing (table-generated) tests too, for comparison; --all-entries deletes every entry
of every table, one at a time, against the golden unit tests.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SANITIZE = "pylon/core/sanitize.py"
PLAN = "pylon/core/plan.py"
BODY = "pylon/core/body.py"
HEAD = "pylon/core/head.py"
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


@dataclass(frozen=True)
class Mutation:
    label: str
    path: str
    old: str
    new: str


def drop_line(label: str, path: str, line: str) -> Mutation:
    return Mutation(label, path, line + "\n", "")


NAMED = [
    drop_line(
        "header x-session-id", SANITIZE, '    b"x-session-id": "dynamo, vllm: session affinity",'
    ),
    drop_line(
        "header x-tenant-id",
        SANITIZE,
        '    b"x-tenant-id": "dynamo: becomes nvext.cache_salt (KV cache namespace)",',
    ),
    drop_line(
        "prefix x-dynamo-",
        SANITIZE,
        '    (b"x-dynamo-", "dynamo: pins, priority, session, metadata, routing mode"),',
    ),
    drop_line(
        "body cache_salt",
        SANITIZE,
        '    "cache_salt": "vllm, sglang, dynamo (legacy): KV cache namespace",',
    ),
    drop_line(
        "body priority",
        SANITIZE,
        '    "priority": "vllm, sglang: engine priority (pylon writes its own)",',
    ),
    drop_line("nvext.backend_instance_id", SANITIZE, '    "backend_instance_id": "worker pin",'),
    drop_line(
        "nvext.agent_hints",
        SANITIZE,
        '    "agent_hints": "priority, strict priority, latency sensitivity, osl, speculative '
        'prefill",',
    ),
    drop_line(
        "vllm_xargs.session_id",
        SANITIZE,
        '    ("vllm_xargs", "session_id"): "vllm: session affinity through extension args",',
    ),
    Mutation(
        "underscore-twin rule",
        SANITIZE,
        '    if name.find(b"_") >= 0:\n        # Underscore twins (`x_dynamo_request_priority`)',
        "    if False:\n        # Underscore twins (`x_dynamo_request_priority`)",
    ),
    Mutation(
        "connection-listed-names rule",
        SANITIZE,
        '    tokens.discard(b"")\n    return frozenset(tokens)\n',
        "    return frozenset()\n",
    ),
    Mutation(
        "duplicate-key check (body.py)",
        BODY,
        "        if keys.count(key) > 1:\n",
        "        if False:\n",
    ),
    # A few more rules than the brief asked for.
    Mutation(
        "duplicate-key check: escape screen",
        BODY,
        '        or body.find(b"\\\\") >= 0\n',
        "",
    ),
    Mutation(
        "duplicate-key check: repeated model in the fast path",
        BODY,
        "    if body.count(b'\"model\"') > 1:\n        return None\n",
        "",
    ),
    Mutation(
        "duplicate-key check: vllm_xargs container",
        BODY,
        'CONTAINER_KEYS: tuple[str, ...] = ("nvext", *sorted({parent for parent, _ in DENIED_NESTED'
        "_FIELDS}))",
        'CONTAINER_KEYS: tuple[str, ...] = ("nvext",)',
    ),
    # (Whitespace around a request name cannot reach the strip any more: llhttp refuses it, and
    # the head's wire check refuses any name that is not a token, on every transport.)
    Mutation(
        "case of request names",
        HEAD,
        "    names = [name.lower() for name, _ in fields]\n",
        "    names = [name for name, _ in fields]\n",
    ),
    Mutation(
        "hop-by-hop check in requests",
        SANITIZE,
        "    if name in HOP_BY_HOP:\n        return HOP_BY_HOP_REASON\n",
        "",
    ),
    Mutation(
        "response: content-length",
        SANITIZE,
        '            or name == b"content-length"\n',
        "",
    ),
    Mutation(
        "response: x-stargate-* prefix",
        SANITIZE,
        "            or name.startswith(DENIED_RESPONSE_HEADER_PREFIXES)\n",
        "",
    ),
    Mutation(
        "response: configured retry header", SANITIZE, "            or name in extra_denied\n", ""
    ),
    Mutation(
        "response: hop-by-hop",
        SANITIZE,
        "            name in HOP_BY_HOP\n            or ",
        "            ",
    ),
    Mutation(
        "plan: pylon's own x-request-id",
        PLAN,
        '        headers: list[Header] = [(b"x-request-id", request.request_id.encode("ascii"))]\n',
        "        headers: list[Header] = []\n",
    ),
]


def table_entries() -> list[Mutation]:
    """One mutation per entry of every deny table and set in sanitize.py."""
    text = Path(SANITIZE).read_text(encoding="utf-8")
    out: list[Mutation] = []
    table = ""
    for line in text.splitlines():
        if start := re.match(r"^(_?[A-Z][A-Z_]+)\b.* = ", line):
            table = start.group(1)
        entry = re.match(r'^    (?:    )?(b?"[^"]+"|\(b?"[^"]+", b?"[^"]+"\))[:,]', line)
        if entry:
            out.append(
                drop_line(f"{table} {entry.group(1).split(',')[0].lstrip('(')}", SANITIZE, line)
            )
    single = 'DENIED_RESPONSE_HEADER_PREFIXES: tuple[bytes, ...] = (b"x-stargate-",)'
    emptied = "DENIED_RESPONSE_HEADER_PREFIXES: tuple[bytes, ...] = ()"
    out.append(
        Mutation('DENIED_RESPONSE_HEADER_PREFIXES b"x-stargate-"', SANITIZE, single, emptied)
    )
    for table in ("PYLON_OWNED_REQUEST_HEADERS", "_CONTRACT_TWINS"):
        block = text[text.index(f"{table}: frozenset") :]
        body = block[block.index("{") : block.index("}") + 1]
        for name in re.findall(r'b"[^"]+"', body):
            smaller = body.replace(f"{name}, ", "").replace(f", {name}", "")
            out.append(Mutation(f"{table} {name}", SANITIZE, body, smaller))
    return out


def run(tests: list[str]) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONPATH": str(Path.cwd())}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return done.returncode != 0, (failed[0] if failed else done.stdout.strip().splitlines()[-1])


def apply(mutation: Mutation) -> None:
    path = Path(mutation.path)
    text = path.read_text(encoding="utf-8")
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"{mutation.label}: expected one match in {mutation.path}, got {count}")
    path.write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")


def restore() -> None:
    subprocess.run(["git", "checkout", "--", "pylon"], check=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--old", action="store_true")
    parser.add_argument("--all-entries", action="store_true")
    args = parser.parse_args()
    restore()
    caught, detail = run(GOLDEN_UNIT)
    assert not caught, f"the golden tests fail before any mutation: {detail}"
    mutations = NAMED + (table_entries() if args.all_entries else [])
    survivors = []
    for mutation in mutations:
        apply(mutation)
        try:
            results = {"golden unit": run(GOLDEN_UNIT)}
            if args.e2e and mutation in NAMED:
                results["golden e2e"] = run(GOLDEN_E2E)
            if args.old and mutation in NAMED:
                results["old suite"] = run(OLD)
        finally:
            restore()
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

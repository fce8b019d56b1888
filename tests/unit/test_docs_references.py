"""The docs and code point only at what the repository holds: no reference to a file of the
machine they were written on (docs/dynamo.md once sent readers to /work/shared/reference/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A path into the authors' workspace: its shared reference notes or another checkout's tree.
OUTSIDE = re.compile(r"(/work/shared|shared/reference/|\.\./shared/)")


def test_no_reference_points_outside_the_repository() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for folder in ("pylon", "scripts", "mock_dynamo", "router_ffi"):
        files += (ROOT / folder).rglob("*.py")
    assert len(files) > 20
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, found

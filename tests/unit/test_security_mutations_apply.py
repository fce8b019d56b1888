"""scripts/security_mutations.py stays in step with the code it mutates.

Each mutation is an exact text edit of pylon/; when the code moves on, an edit that no longer
applies would silently stop checking its control. `--check` applies nothing: it only verifies that
every edit matches exactly once and that every test named to catch it exists.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_security_mutation_still_applies() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "security_mutations.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "every named test exists" in result.stdout

"""scripts/import_graph.py: pylon's modules import each other without a cycle, and only the
assembly layer reads Settings (every other part takes its own frozen options)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "import_graph.py"
# The process layer: Settings in, each component's options and parts out (and the checks on
# Settings before anything starts).
READS_SETTINGS = {
    "pylon.assemble",
    "pylon.listeners",
    "pylon.run",
    "pylon.preflight",
    "pylon.cli",
    # `--processes N`: the supervisor, and the handover that carries the settings to a process.
    "pylon.supervisor.supervisor",
    "pylon.supervisor.handover",
}


def import_graph(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_pylon_has_no_import_cycle() -> None:
    result = import_graph()
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("no import cycle between the "), result.stdout


def test_a_cycle_fails_the_script_however_the_import_is_written(tmp_path: Path) -> None:
    package = tmp_path / "pylon"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from pylon import b\n",
        # A type-only import closes the circle all the same.
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pylon.a import X\n",
        "sub/__init__.py": "",
        "sub/c.py": "def later():\n    from . import d\n",  # lazy and relative
        "sub/d.py": "import pylon.sub.c\n",
        "leaf.py": "import pylon.a\n",  # reaches a cycle without being in one
    }
    for name, text in files.items():
        (package / name).write_text(text)
    result = import_graph("--root", tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "import cycle: pylon.a -> pylon.b -> pylon.a",
        "import cycle: pylon.sub.c -> pylon.sub.d -> pylon.sub.c",
    ]


def test_only_the_assembly_layer_reads_settings() -> None:
    result = import_graph("--importers-of", "pylon.settings.Settings")
    assert result.returncode == 0, result.stderr
    readers = {
        module for module in result.stdout.split() if not module.startswith("pylon.settings")
    }
    assert readers <= READS_SETTINGS, f"below the assembly layer: {readers - READS_SETTINGS}"
    assert "pylon.assemble" in readers  # the check sees the imports it is there to limit

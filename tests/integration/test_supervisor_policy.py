"""The supervisor's restart policy on real processes, in-process (`Supervisor.run`), with the
pylon process swapped for a tiny script whose exit status the test chooses: a crash is
restarted after the backoff and counted; a refused start (2), or an engine that never got
ready before the first ready (1), halts the node with that status."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

import pylon.supervisor.supervisor as supervisor_module
from pylon.settings import load_settings
from pylon.supervisor.supervisor import Supervisor, prepare_node, runtime_directory
from tests.observers import EventObserver

# First start: exit 3 (a crash); every later start: exit with the status in argv[2].
SCRIPT = """
import pathlib, sys
mark = pathlib.Path(sys.argv[1])
if not mark.exists():
    mark.write_text("started")
    sys.exit(3)
sys.exit(int(sys.argv[2]))
"""


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: int) -> tuple[int, EventObserver]:
    mark = tmp_path / "mark"
    monkeypatch.setattr(
        supervisor_module,
        "child_command",
        lambda _role, _handover: [sys.executable, "-c", SCRIPT, str(mark), str(then)],
    )
    # One slot (`pylon serve` would run no supervisor for it; the class does not mind).
    settings = load_settings({"processes": "1", "listen": "127.0.0.1:0", "admin_listen": ""})
    observer = EventObserver()
    with runtime_directory() as runtime:
        node = prepare_node(settings, runtime, observer)
        supervisor = Supervisor(settings, node, observer)
        try:
            status = asyncio.run(asyncio.wait_for(supervisor.run(), timeout=30))
        finally:
            node.sockets.close()
    assert supervisor.restarts == {"exit": 1, "signal": 0}
    return status, observer


@pytest.mark.parametrize(("then", "reason"), [(2, "start_refused"), (1, "engine_not_ready")])
def test_a_crash_is_restarted_and_a_start_that_cannot_succeed_halts_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: int, reason: str
) -> None:
    status, observer = _run(tmp_path, monkeypatch, then)
    assert status == then
    crashed, last = observer.of("process_exited")
    assert crashed["exit_code"] == 3 and crashed["restart_in_s"] == 0.5
    assert last["exit_code"] == then and last["restart_in_s"] is None
    assert [fields["restarts"] for fields in observer.of("process_started")] == [0, 1]
    halted = observer.of("supervisor_halted")
    assert [(fields["reason"], fields["exit_code"]) for fields in halted] == [(reason, then)]
    assert observer.of("stopped")[0]["exit_codes"] == [then]

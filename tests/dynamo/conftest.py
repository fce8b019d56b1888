"""Fixtures for the end-to-end tests against a real Dynamo 1.6.1 stack (``pytest -m dynamo``).

* ``dynamo_stack``: broker + frontend (KV router, router queue threshold 0.0) + 2 mocker workers
  at realistic speed (``--speedup-ratio 1``), all on 127.0.0.1, one per session.
* ``gateway``: pylon in front of the frontend (``pylon serve --backend dynamo``), one per session.
  ``DYNAMO_E2E_GATEWAY=reference`` swaps in tests/dynamo/reference_gateway.py (a stand-in that
  does what pylon should), ``=passthrough`` a proxy that strips nothing (tests 1-4 must fail).
* ``ledger``: every response that came back through the gateway, for test 5.

Everything skips with a reason when Dynamo is not installed (scripts/install_dynamo.sh).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

GATEWAY_START_TIMEOUT_S = 30.0


def _missing_dependency() -> str | None:
    for mod, hint in (
        ("dynamo.frontend", "ai-dynamo==1.6.1 (pip install --no-deps ai-dynamo==1.6.1)"),
        ("dynamo.mocker", "ai-dynamo==1.6.1 (pip install --no-deps ai-dynamo==1.6.1)"),
        ("dynamo._core", "ai-dynamo-runtime==1.6.1 (pip install -e '.[dynamo]')"),
        ("zmq", "pyzmq (pip install -e '.[dynamo]')"),
        ("tokenizers", "tokenizers (pip install -e '.[dynamo]')"),
        ("httpx", "httpx (pip install -e '.[dynamo]')"),
    ):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{mod} is not importable: install {hint}, or run scripts/install_dynamo.sh"
    return None


@pytest.fixture(scope="session")
def dynamo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    reason = _missing_dependency()
    if reason:
        pytest.skip(reason)
    from dynamo_stack import DynamoStack

    stack = DynamoStack(
        num_workers=2,
        speedup_ratio=1.0,  # realistic GPU timing, so the router queue really fills up
        router_queue_threshold=0.0,
        state_dir=tmp_path_factory.mktemp("dynamo-stack"),
        startup_timeout_s=60.0,
    )
    with stack:
        yield stack


@dataclass
class Gateway:
    name: str
    url: str
    log_path: Path
    popen: subprocess.Popen[bytes] = field(repr=False)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pylon_executable() -> str | None:
    beside = Path(sys.executable).with_name("pylon")
    if beside.exists():
        return str(beside)
    return shutil.which("pylon")


def _stop_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGTERM the gateway's process group, then SIGKILL it; bounded waits."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, sig)  # its own group (start_new_session): pgid == pid
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=5.0)


@pytest.fixture(scope="session")
def gateway(dynamo_stack: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    import httpx

    mode = os.environ.get("DYNAMO_E2E_GATEWAY", "pylon")
    upstream = dynamo_stack.frontend_url  # type: ignore[attr-defined]
    port = _free_port()
    if mode == "pylon":
        exe = _pylon_executable()
        if exe is None:
            pytest.fail("pylon executable not found (pip install -e '.[dynamo]')")
        cmd = [
            exe,
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            upstream,
            "--backend",
            "dynamo",
            "--log-level",
            "warning",
            "--admin-listen",
            "127.0.0.1:0",  # never the fixed default port in tests
        ]
    elif mode in ("reference", "passthrough"):
        cmd = [
            sys.executable,
            str(Path(__file__).with_name("reference_gateway.py")),
            "--port",
            str(port),
            "--upstream",
            upstream,
        ] + (["--passthrough"] if mode == "passthrough" else [])
    else:
        pytest.fail(f"DYNAMO_E2E_GATEWAY={mode!r}: expected pylon, reference or passthrough")

    log_path = tmp_path_factory.mktemp("gateway") / f"{mode}.log"
    with open(log_path, "wb") as log_file:
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
            start_new_session=True,
        )
    gw = Gateway(mode, f"http://127.0.0.1:{port}", log_path, popen)
    try:
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        while True:
            if popen.poll() is not None:
                pytest.fail(f"{mode} exited with {popen.returncode} at start:\n{gw.log()[-4000:]}")
            try:
                httpx.get(gw.url + "/health", timeout=2.0)
                # Any HTTP answer means it is serving; pylon also brings the engine up first
                # (health gate, model discovery) and says `ready` when it has.
                if mode != "pylon" or '"event":"ready"' in gw.log():
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{mode} not serving on {gw.url} after {GATEWAY_START_TIMEOUT_S}s")
            time.sleep(0.2)
        yield gw
    finally:
        _stop_group(popen)


@dataclass
class Ledger:
    """Every (test, status, body head) that came back through the gateway."""

    entries: list[tuple[str, int, str]] = field(default_factory=list)

    def add(self, what: str, status: int, body_head: str = "") -> None:
        self.entries.append((what, status, body_head[:300]))


@pytest.fixture(scope="session")
def ledger() -> Ledger:
    return Ledger()

"""Subprocess helpers for the benchmarks: start, wait for readiness, CPU accounting, cleanup."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
_LISTEN_RE = re.compile(r"listening on http://([\d.]+):(\d+)")


class ProcessGroup:
    """Tracks every subprocess we start; ``close()`` kills them all (their process groups)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []

    def track(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self._procs.append(proc)
        return proc

    def start(
        self, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start argv in its own session with stdout+stderr to log_path (`env`: the whole
        environment; None inherits this one)."""
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        return self.track(proc)

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(timeout)
        else:  # leader gone: make sure no orphans of its group survive
            _signal_group(proc, signal.SIGKILL)
        if proc in self._procs:
            self._procs.remove(proc)

    def close(self) -> None:
        for proc in list(reversed(self._procs)):
            try:
                self.stop(proc)
            except (OSError, subprocess.TimeoutExpired):
                _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(proc: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    """Wait until 127.0.0.1:port accepts connections; raise if the process dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} before listening")
        if port_open(port):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} not accepting connections after {timeout:.0f}s")


def start_listening(
    group: ProcessGroup, argv: list[str], timeout: float = 15.0, log_path: Path | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server that prints ``... listening on http://HOST:PORT``; return (proc, port)."""
    proc = group.track(
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if not ready:
            continue
        line = proc.stdout.readline().decode(errors="replace")
        seen.append(line.rstrip())
        match = _LISTEN_RE.search(line)
        if match:
            _drain(proc, log_path)
            return proc, int(match.group(2))
    group.stop(proc)
    raise RuntimeError(f"{argv[0]} did not report a listening port: {' | '.join(seen[-5:])}")


def _drain(proc: subprocess.Popen[bytes], log_path: Path | None) -> None:
    """Keep reading the child's stdout in the background (to log_path if given)."""

    def pump() -> None:
        assert proc.stdout is not None
        log = log_path.open("ab") if log_path else None
        try:
            for line in iter(proc.stdout.readline, b""):
                if log:
                    log.write(line)
                    log.flush()
        finally:
            if log:
                log.close()

    threading.Thread(target=pump, daemon=True).start()


def _tree(root: int) -> list[int]:
    """root and all its live descendants (scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _proc_ticks(pid: int, with_children: bool) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    # after ")": fields[0]=state ... utime=11 stime=12 cutime=13 cstime=14 (0-based)
    ticks = int(fields[11]) + int(fields[12])
    if with_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks


def cpu_seconds(root: int) -> float:
    """utime+stime of root (all threads) + its live descendants + reaped children."""
    total = 0
    for pid in _tree(root):
        total += _proc_ticks(pid, with_children=(pid == root))
    return total / CLK_TCK

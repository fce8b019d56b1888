"""The two commands a new user runs, and the settings surface, as real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

PYLON = [sys.executable, "-m", "pylon"]


def run_pylon(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYLON_")}
    return subprocess.run(
        [*PYLON, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**clean, **(env or {})},
    )


def effective(*args: str, env: dict[str, str] | None = None) -> dict[str, object]:
    result = run_pylon("config", *args, env=env)
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def test_defaults() -> None:
    config = effective()
    assert config["listen"] == "127.0.0.1:8080"
    assert config["backend"] == "dynamo"
    assert config["priority_ceiling"] == 3600
    assert config["derive_priority"] is True
    assert config["max_body_bytes"] == 64 * 1024 * 1024
    assert config["max_header_bytes"] == 60 * 1024
    assert config["retryable_status_codes"] == [429, 503]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--no-derive-priority"], False),
        (["--derive-priority=false"], False),
        (["--derive-priority=0"], False),
        (["--derive-priority=TRUE"], True),
        (["--derive-priority"], True),
    ],
)
def test_boolean_flags_bare_and_with_values(args: list[str], expected: bool) -> None:
    assert effective(*args)["derive_priority"] is expected


@pytest.mark.parametrize("value", ["false", "0", "no"])
def test_boolean_env(value: str) -> None:
    assert effective(env={"PYLON_DERIVE_PRIORITY": value})["derive_priority"] is False


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    config_file = tmp_path / "pylon.toml"
    config_file.write_text('backend = "sglang"\npriority_ceiling = 10\nmax_headers = 50\n')
    env = {"PYLON_PRIORITY_CEILING": "20", "PYLON_BACKEND": "vllm"}
    config = effective("--config", str(config_file), "--backend", "passthrough", env=env)
    assert config["backend"] == "passthrough"  # flag beats env and file
    assert config["priority_ceiling"] == 20  # env beats file
    assert config["max_headers"] == 50  # file beats default


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--backend", "trtllm"], {}, "backend"),
        (["--priority-ceiling", "0"], {}, "priority_ceiling"),
        (["--priority-ceiling", "2147483648"], {}, "priority_ceiling"),
        (["--derive-priority=maybe"], {}, "--derive-priority"),
        (["--listen", "nowhere"], {}, "listen"),
        (["--upstream", "https://x:1"], {}, "upstream"),
        (["--retryable-status-codes", "429,abc"], {}, "retryable_status_codes"),
        ([], {"PYLON_BACKEND": "nope"}, "backend"),
        (["--config", "/does/not/exist.toml"], {}, "config file"),
    ],
)
def test_bad_values_exit_nonzero_with_one_line(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    result = run_pylon("serve", *args, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]


def test_serve_with_no_upstream_runs_the_embedded_mock() -> None:
    """The README's run command, end to end: pylon serve, then a request through it."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYLON_")}
    proc = subprocess.Popen(
        [*PYLON, "serve", "--listen", "127.0.0.1:0"], stderr=subprocess.PIPE, text=True, env=clean
    )
    try:
        assert proc.stderr is not None
        lines: list[dict[str, object]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(e["event"] == "listening" for e in lines):
            line = proc.stderr.readline()
            assert line, "pylon exited before listening"
            lines.append(json.loads(line))
        events = {e["event"]: e for e in lines}
        assert "embedded_mock_started" in events, "the log must say the upstream is a mock"
        url = str(events["listening"]["url"])
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=10,
            headers={"x-request-id": "readme-1", "x-model": "mock-model", "x-priority": "5"},
            json={
                "model": "mock-model",
                "stream": True,
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "hello"}],
            },
        )
        assert reply.status_code == 200
        assert reply.text.rstrip().endswith("data: [DONE]")
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0

"""The `mock-dynamo` console script as a subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

from tests.mock_dynamo.conftest import MakeMock

EXE = Path(sys.executable).parent / "mock-dynamo"
PORT_LINE = re.compile(rb"mock-dynamo listening on http://127\.0\.0\.1:(\d+)\n")


async def _run_to_exit(*args: str) -> tuple[int, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        str(EXE), *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode is not None
    return proc.returncode, out, err


async def test_console_script_serves_on_ephemeral_port() -> None:
    proc = await asyncio.create_subprocess_exec(
        str(EXE),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--flavor",
        "vllm",
        "--model",
        "a",
        "--model",
        "b",
        "--num-tokens",
        "3",
        "--token-delay-ms",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        match = PORT_LINE.fullmatch(line)
        assert match, line
        base = f"http://127.0.0.1:{int(match.group(1))}"
        async with httpx.AsyncClient(base_url=base, timeout=5) as c:
            models = (await c.get("/v1/models")).json()
            chat = await c.post(
                "/v1/chat/completions", json={"model": "b", "messages": [], "priority": "x"}
            )
            ok = await c.post("/v1/chat/completions", json={"model": "b", "messages": []})
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 10)
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert chat.status_code == 400  # vllm flavor enforces integer priority
    assert ok.json()["usage"]["completion_tokens"] == 3
    assert rc == 0


@pytest.mark.parametrize(
    "args",
    [
        ("--flavor", "nope"),
        ("--port", "-1"),
        ("--num-tokens", "-2"),
        ("--capacity", "0"),
        ("--bogus",),
        ("--ttft-ms", "abc"),
    ],
)
async def test_invalid_flags_exit_nonzero_with_one_line(args: tuple[str, ...]) -> None:
    rc, out, err = await _run_to_exit(*args)
    assert rc == 2
    assert out == b""
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mock-dynamo: error: ")


async def test_port_in_use_exits_with_one_line(make_mock: MakeMock) -> None:
    server = await make_mock()
    rc, _, err = await _run_to_exit("--port", str(server.port))
    assert rc == 1
    assert len(err.decode().strip().splitlines()) == 1 and b"cannot listen" in err


async def test_python_dash_m_help() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mock_dynamo",
        "--help",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0 and b"--token-delay-ms" in out


# Every flag of `mock-dynamo` with a word of its own help (not pylon's help for a setting of
# the same name), written here by hand.
MOCK_FLAGS = {
    "--host": "bind.",
    "--port": "free",
    "--flavor": "contract",
    "--model": "Served",
    "--ttft-ms": "first",
    "--token-delay-ms": "between",
    "--num-tokens": "reply.",
    "--capacity": "Recorded",
    "--kv-block-size": "block",
    "--kv-cache-blocks": "capacity",
    "--prefill-tokens-per-s": "uncached",
    "--tokenizer": "word.",
    "--kv-events-port": "--kv-cache-blocks.",
    "--kv-events-encoding": "positional",
    "--log-level": "verbosity.",
}


@pytest.mark.parametrize("columns", [80, 400])
async def test_help_is_whole_at_80_columns(columns: int) -> None:
    """Each flag on its own line, its help whole below it: typer's table cut the --tokenizer
    help and the --log-level choices at 80 columns."""
    proc = await asyncio.create_subprocess_exec(
        str(EXE),
        "--help",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": str(columns), "TERM": "dumb"},
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0
    text = out.decode()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in text
    assert "PYLON_" not in text, "pylon's setting help in the mock's"
    assert "<debug|info|warning|error>" in text
    for flag, word in MOCK_FLAGS.items():
        row = next(i for i, line in enumerate(lines) if line.split(" ")[2:3] == [flag])
        following = next(i for i in range(row + 1, len(lines)) if lines[i].startswith("  -"))
        assert word in " ".join(lines[row:following]).split(), flag

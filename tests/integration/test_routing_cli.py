"""`pylon serve` with routing flags, as a real process: every routing configuration that could
not do what it says is refused before anything starts, in one line with exit status 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.test_cli import effective, refusal, run_pylon

W1 = "url=http://127.0.0.1:9001"
KV1 = W1 + ",kv-events=tcp://127.0.0.1:5557"


def without(module: str) -> list[str]:
    """`pylon` as installed without `module` (it cannot be imported)."""
    return [
        sys.executable,
        "-c",
        f"import sys; sys.modules[{module!r}] = None; "
        "from pylon.cli import main; sys.argv[0] = 'pylon'; main()",
    ]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--worker", W1], "--worker needs --routing round-robin, least-loaded or kv"),
        (["--routing", "least-loaded"], "--routing least-loaded needs at least one --worker"),
        (["--routing", "round-robin", "--worker", W1 + ",block-size=48"], "power of two"),
        (["--routing", "round-robin", "--worker", "url=ftp://x:1"], "url must be http://"),
        (["--routing", "round-robin", "--worker", W1, "--worker", W1], "is given twice"),
        (["--routing", "round-robin", "--worker", "instance-id=5"], "needs --upstream"),
        (
            [
                "--routing",
                "round-robin",
                "--worker",
                "instance-id=5",
                "--backend",
                "sglang",
                "--upstream",
                "http://127.0.0.1:8000",
            ],
            "needs --backend dynamo",
        ),
        (["--routing", "kv", "--worker", W1, "--tokenizer", "/"], "has no kv-events= endpoint"),
        (["--routing", "kv", "--worker", KV1], "--routing kv needs --tokenizer DIR"),
        (
            ["--routing", "kv", "--worker", KV1, "--tokenizer", "/no/such/dir"],
            "--tokenizer /no/such/dir: no such directory",
        ),
        (
            ["--routing", "round-robin", "--workers-file", "/no/such.toml", "--worker", W1],
            "--workers-file and --worker (or [[worker]] tables in --config) both give",
        ),
        (
            ["--routing", "round-robin", "--workers-file", "/no/such.toml"],
            "--workers-file /no/such.toml: no such file",
        ),
        (
            ["--routing", "round-robin", "--discover-instances"],
            "--discover-instances needs --backend dynamo and --upstream",
        ),
    ],
)
def test_routing_refusals_are_one_line(args: list[str], needle: str) -> None:
    line = refusal(run_pylon("serve", "--listen", "127.0.0.1:0", *args))
    assert needle in line, line


@pytest.mark.parametrize("missing", ["dynamo", "xxhash"])
def test_kv_routing_without_the_dynamo_extra_says_how_to_install_it(missing: str) -> None:
    args = ["serve", "--listen", "127.0.0.1:0", "--routing", "kv", "--worker", KV1]
    line = refusal(run_pylon(*args, "--tokenizer", "/", python=without(missing)))
    assert line.startswith("pylon: --routing kv:")
    assert "pip install 'pylon[dynamo]'" in line


def test_other_modes_need_no_dynamo_extra() -> None:
    result = run_pylon(
        "config", "--routing", "least-loaded", "--worker", KV1, python=without("dynamo")
    )
    assert result.returncode == 0, result.stderr


def test_workers_from_a_config_file_and_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "pylon.toml"
    config.write_text(
        'routing = "round-robin"\n[[worker]]\nurl = "http://127.0.0.1:9001"\n'
        '[[worker]]\nurl = "http://127.0.0.1:9002"\nblock-size = 32\n'
    )
    shown = effective("--config", str(config))
    assert shown["worker"] == [
        "url=http://127.0.0.1:9001,block-size=16,dp-size=1",
        "url=http://127.0.0.1:9002,block-size=32,dp-size=1",
    ]
    shown = effective(
        env={"PYLON_ROUTING": "least-loaded", "PYLON_WORKER": f"{KV1};url=http://h:2"}
    )
    assert shown["worker"] == [
        "url=http://127.0.0.1:9001,kv-events=tcp://127.0.0.1:5557,block-size=16,dp-size=1",
        "url=http://h:2,block-size=16,dp-size=1",
    ]
    line = refusal(run_pylon("config", env={"PYLON_ROUTING": "kv", "PYLON_WORKER": "url=x"}))
    assert "invalid setting worker (PYLON_WORKER)" in line

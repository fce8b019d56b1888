"""The Dockerfile and compose.yaml run only what exists: no Docker engine runs here, so these
checks read the two files and try every command they run against the installed package.

- every file a stage copies exists in the build context;
- every stage that runs a program drops root;
- every entrypoint is a console script of this package (or a file the stage copied), and its
  arguments parse with that program's own command line (pylon's through `pylon config`, which
  also validates the settings);
- every service builds a stage that exists, and publishes ports on the node's loopback only;
- `docker compose config` (or `docker-compose config`) accepts both profiles when a client is
  installed.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from mock_dynamo.cli import cli as mock_cli
from pylon.cli import app as pylon_app

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@dataclass
class Stage:
    name: str
    base: str
    copies: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None


def _instructions(text: str) -> list[tuple[str, str]]:
    lines: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        lines.append((keyword.upper(), rest.strip()))
        pending = ""
    return lines


def parse_dockerfile(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for keyword, rest in _instructions(text):
        if keyword == "FROM":
            parts = rest.split()
            base = next((s for s in stages if s.name == parts[0]), None)
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else f"#{len(stages)}"
            stage = Stage(name, parts[0])
            if base is not None:  # a stage built on another inherits its image settings
                stage.env = dict(base.env)
                stage.user, stage.entrypoint, stage.cmd = base.user, base.entrypoint, base.cmd
            stages.append(stage)
            continue
        stage = stages[-1]
        if keyword == "COPY":
            *sources, _dest = [p for p in rest.split() if not p.startswith("--")]
            stage.copies.extend(sources)
        elif keyword == "ENV":
            for pair in rest.split():
                key, _, value = pair.partition("=")
                stage.env[key] = value
        elif keyword == "USER":
            stage.user = rest
        elif keyword == "ENTRYPOINT":
            stage.entrypoint = json.loads(rest)  # exec form only: no shell in between
            stage.cmd = None  # Docker resets CMD when ENTRYPOINT is set
        elif keyword == "CMD":
            stage.cmd = json.loads(rest)
    return stages


STAGES = {stage.name: stage for stage in parse_dockerfile((ROOT / "Dockerfile").read_text())}
COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]


def test_the_default_target_is_the_small_runtime_image() -> None:
    last = list(STAGES.values())[-1]
    assert last.name == "runtime"
    assert last.entrypoint == ["pylon"] and last.cmd == ["serve"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_copied_file_exists(stage: str) -> None:
    for source in STAGES[stage].copies:
        assert (ROOT / source).exists(), f"{stage}: COPY {source} is not in the build context"


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_stages_that_run_a_program_drop_root(stage: str) -> None:
    if STAGES[stage].entrypoint is None:
        return
    assert STAGES[stage].user not in (None, "root", "0"), f"{stage} runs as root"


def _check_command(argv: list[str], env: dict[str, str], copied: list[str]) -> None:
    """Parse `argv` with the program it names; fail with the program's own message."""
    program, args = argv[0], argv[1:]
    if program == "pylon":
        assert "pylon" in SCRIPTS
        assert args[:1] == ["serve"], argv
        # `pylon config` takes every `serve` flag and validates the settings, starting nothing.
        pylon_env = {k: v for k, v in env.items() if k.startswith("PYLON_")}
        result = CliRunner().invoke(pylon_app, ["config", *args[1:]], env=pylon_env)
        assert result.exit_code == 0, f"{argv}: {result.output}"
    elif program == "mock-dynamo":
        assert "mock-dynamo" in SCRIPTS
        command = typer.main.get_command(mock_cli)
        command.make_context("mock-dynamo", list(args))  # raises on an unknown flag or value
    elif program == "python":
        script = args[0]
        assert script in copied, f"{script} is not copied into the image"
        spec = importlib.util.spec_from_file_location("_stack", ROOT / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        try:
            spec.loader.exec_module(module)
        finally:
            del sys.modules[spec.name]
        module.build_parser().parse_args(args[1:])  # exits 2 on an unknown flag
    else:
        pytest.fail(f"{argv}: {program} is not a program of this package")


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_service_runs_a_command_that_exists(name: str) -> None:
    service = SERVICES[name]
    build = service["build"]
    stage = STAGES[build["target"]]
    copied = [c for s in STAGES.values() for c in s.copies if s.name in (stage.name, stage.base)]
    entrypoint = service.get("entrypoint", stage.entrypoint)
    command = service.get("command", stage.cmd if "entrypoint" not in service else None) or []
    assert entrypoint, f"{name} runs nothing"
    _check_command([*entrypoint, *command], stage.env, copied)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_ports_are_published_on_loopback_only(name: str) -> None:
    for port in SERVICES[name].get("ports", []):
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_service_references_exist() -> None:
    for name, service in SERVICES.items():
        for other in service.get("depends_on", []):
            assert other in SERVICES, f"{name} depends on a missing service {other}"
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            assert mode.removeprefix("service:") in SERVICES


def _compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("profile", [None, "dynamo"])
def test_compose_client_accepts_the_file(profile: str | None) -> None:
    client = _compose_client()
    if client is None:
        pytest.skip("no docker compose client installed")
    argv = [*client, "-f", str(ROOT / "compose.yaml")]
    if profile is not None:
        argv += ["--profile", profile]
    result = subprocess.run([*argv, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

"""The two commands a new user runs, and the settings surface, as real processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from pylon.cli import field_group
from pylon.observe import LIFECYCLE_EVENTS
from pylon.settings import GROUPS, Settings
from router_ffi import native_available
from tests.certs import make_ca, make_leaf, write_pair

PYLON = [sys.executable, "-m", "pylon"]
ENGINE = [sys.executable, "-m", "mock_dynamo"]
# Every pylon started here has its admin listener on an ephemeral port, never the fixed default.
ADMIN = {"PYLON_ADMIN_LISTEN": "127.0.0.1:0"}


def clean_env() -> dict[str, str]:
    """The environment without any PYLON_* or OTEL_* variable but the ephemeral admin listener."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PYLON_", "OTEL_"))},
        **ADMIN,
    }


# --tokenizer is read by the kv router only (any other mode refuses it).
KV_ROUTING = ["--routing", "kv", "--worker", "url=http://127.0.0.1:9,kv-events=tcp://127.0.0.1:9"]
# Without the dynamo extra, --routing kv is refused for that before its tokenizer is looked at.
KV = pytest.mark.skipif(not native_available(), reason="--routing kv needs the dynamo extra")


def run_pylon(
    *args: str, env: dict[str, str] | None = None, python: list[str] = PYLON
) -> subprocess.CompletedProcess[str]:
    clean = clean_env()
    return subprocess.run(
        [*python, *args],
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
    with subprocess.Popen(
        [*PYLON, "serve", "--listen", "127.0.0.1:0"],
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    ) as proc:
        try:
            assert proc.stderr is not None
            lines: list[dict[str, object]] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(e["event"] == "ready" for e in lines):
                line = proc.stderr.readline()
                assert line, "pylon exited before it was ready"
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


# --- a configuration cannot silently do less than asked ------------------------------------------


def refusal(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start prints: exit 2, no traceback, no Python internals."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("pylon: "), line
    for leak in ("Traceback", "pydantic", "https://", "Value error", "_ssl.c", "Errno"):
        assert leak not in line, line
    return line


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Certificates, keys, CA bundles and token files, good and bad, by name."""
    ca = make_ca()
    good_cert, good_key = write_pair(tmp_path, make_leaf(ca), "good")
    other_cert, other_key = write_pair(tmp_path, make_leaf(None), "other")
    expired_cert, expired_key = write_pair(
        tmp_path, make_leaf(None, days=-1, start_days=-3), "expired"
    )
    made = {  # file names are the keys
        "ca": ca[0].public_bytes(Encoding.PEM),
        "garbage": b"not PEM at all\n",
        "empty-token": b"  \n",
        "two-lines-token": b"one\ntwo\n",
        "good-token": b"s3cret-token\n",
    }
    paths = {name: tmp_path / name for name in made}
    for name, data in made.items():
        paths[name].write_bytes(data)
    return {
        **{name: str(path) for name, path in paths.items()},
        "cert": str(good_cert),
        "key": str(good_key),
        "other-key": str(other_key),
        "leaf-as-ca": str(other_cert),
        "expired-cert": str(expired_cert),
        "expired-key": str(expired_key),
        "missing": str(tmp_path / "missing.pem"),
        "folder": str(tmp_path),
    }


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--tls-client-ca", "{ca}"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-reload-interval", "1"], "--tls-reload-interval needs --tls-cert"),
        (["--tls-cert", "{cert}"], "--tls-cert and --tls-key must be given together"),
        (["--tls-cert", "{missing}", "--tls-key", "{key}"], "missing.pem: no such file"),
        (["--tls-cert", "{cert}", "--tls-key", "{folder}"], "is a directory"),
        (["--tls-cert", "{cert}", "--tls-key", "{other-key}"], "does not match the certificate"),
        (["--tls-cert", "{garbage}", "--tls-key", "{key}"], "certificate is not valid PEM"),
        (["--tls-cert", "{cert}", "--tls-key", "{garbage}"], "not an unencrypted PEM key"),
        (["--tls-cert", "{expired-cert}", "--tls-key", "{expired-key}"], "has expired"),
        (
            ["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{garbage}"],
            "--tls-client-ca",
        ),
        (
            ["--tls-cert", "{cert}", "--tls-key", "{key}", "--tls-client-ca", "{leaf-as-ca}"],
            "no CA certificate in it",
        ),
        (["--tunnel-token-file", "{missing}"], "--tunnel-token-file"),
        (["--tunnel-token-file", "{empty-token}"], "the file is empty"),
        (["--tunnel-token-file", "{two-lines-token}"], "must be a single line"),
        (["--tunnel-token-file", "{folder}"], "is a directory"),
        (["--upstream", "http://user:hunter2@127.0.0.1:8000"], "pylon never sends credentials"),
        (["--quic-listen", "[zz]:1"], "not an IPv6 address"),
        pytest.param([*KV_ROUTING, "--tokenizer", "{folder}"], "has no tokenizer.json", marks=KV),
        ([*KV_ROUTING, "--tokenizer", "{missing}"], "no such directory"),
    ],
)
def test_start_refusals_are_one_line(files: dict[str, str], args: list[str], needle: str) -> None:
    """Whatever cannot take effect (a TLS or auth setting, a file, a URL) refuses the start,
    before any listener: one line, exit 2."""
    filled = [arg.format_map(files) for arg in args]
    line = refusal(run_pylon("serve", "--listen", "127.0.0.1:0", *filled))
    assert needle in line
    assert "hunter2" not in line and "s3cret" not in line


def test_bad_config_files_are_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("backend = \n")
    assert f"config file {broken} is not valid TOML" in refusal(
        run_pylon("serve", "--config", str(broken))
    )
    typo = tmp_path / "typo.toml"
    typo.write_text('upstrem = "http://127.0.0.1:8000"\n')
    line = refusal(run_pylon("config", "--config", str(typo)))
    assert f"config file {typo}: unknown setting 'upstrem' (did you mean 'upstream'?)" in line
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("priority_ceiling = 0\n")
    line = refusal(run_pylon("config", "--config", str(wrong)))
    assert line.startswith(f"pylon: invalid setting priority_ceiling (config file {wrong}): ")


def test_the_source_of_a_bad_value_is_named() -> None:
    line = refusal(run_pylon("config", env={"PYLON_MAX_HEADERS": "many"}))
    assert line.startswith("pylon: invalid setting max_headers (PYLON_MAX_HEADERS): ")
    line = refusal(run_pylon("config", "--max-headers", "1"))
    assert line.startswith("pylon: invalid setting max_headers (--max-headers): ")


def log_lines(proc: subprocess.Popen[str], until: str, limit: float = 20) -> list[dict[str, Any]]:
    """Read pylon's JSON log lines up to and including the first `until` event."""
    assert proc.stderr is not None
    lines: list[dict[str, Any]] = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, f"pylon exited before {until!r}: {lines}"
        lines.append(json.loads(line))  # every line is JSON, the native core's too
        if lines[-1].get("event") == until:
            return lines
    raise AssertionError(f"no {until!r} line within {limit} s: {lines}")


def start_pylon(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    clean = clean_env()
    return subprocess.Popen(
        [*PYLON, "serve", *args], stderr=subprocess.PIPE, text=True, env={**clean, **(env or {})}
    )


def test_warnings_at_start_and_lifecycle_lines_at_warning_level() -> None:
    """Open listeners, a /v1 upstream path, a setting with no effect and a misspelled variable
    are warned about; the start and stop lines survive --log-level warning."""
    with start_pylon(
        "--listen",
        "0.0.0.0:0",
        "--upstream",
        "http://127.0.0.1:9/v1",
        "--quic-max-data",
        "100000",
        "--log-level",
        "warning",
        env={"PYLON_LISTN": "127.0.0.1:1"},
    ) as proc:
        try:
            lines = log_lines(proc, "listening")
            proc.send_signal(signal.SIGTERM)
            lines += log_lines(proc, "drained")
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()
            proc.wait()
    events = {line["event"]: line for line in lines}
    assert events["unknown_env_var"]["variable"] == "PYLON_LISTN"
    assert events["unknown_env_var"]["did_you_mean"] == "PYLON_LISTEN"
    assert "/v1/v1/" in events["upstream_path_v1"]["detail"]
    assert events["setting_ignored"]["setting"] == "quic_max_data"
    insecure = events["insecure_listener"]
    assert insecure["listener"] == "tcp" and insecure["address"] == "0.0.0.0:0"
    for name in ("unknown_env_var", "upstream_path_v1", "setting_ignored", "insecure_listener"):
        assert events[name]["level"] == "warning"
    # Lifecycle lines bypass the level (written at info); nothing else at info got through.
    assert {"listening", "stopping", "drained"} <= set(events)
    assert {line["event"] for line in lines if line["level"] == "info"} <= LIFECYCLE_EVENTS


def test_a_tokenizer_is_loaded_at_start_and_what_it_cannot_do_is_said(
    tokenizer_models: dict[str, Path], tmp_path: Path
) -> None:
    """--tokenizer is loaded before the listeners; a dir without a chat template is warned
    about."""
    if not native_available():
        pytest.skip("--routing kv needs the dynamo extra (pip install -e '.[dynamo]')")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(
        (tokenizer_models["chatml"] / "tokenizer.json").read_bytes()
    )
    with start_pylon("--listen", "127.0.0.1:0", *KV_ROUTING, "--tokenizer", str(bare)) as proc:
        try:
            lines = log_lines(proc, "listening")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    events = [(line.get("event"), line.get("setting") or line.get("tokenizer")) for line in lines]
    assert ("tokenizer_without_chat_template", str(bare)) in events


def test_no_insecure_listener_warning_with_a_token_or_on_loopback(files: dict[str, str]) -> None:
    for args in (
        [
            "--listen",
            "0.0.0.0:0",
            "--quic-listen",
            "0.0.0.0:0",
            "--tunnel-token-file",
            "{good-token}",
        ],
        ["--listen", "127.0.0.1:0", "--quic-listen", "[::1]:0"],
    ):
        with start_pylon(*(arg.format_map(files) for arg in args)) as proc:
            try:
                lines = log_lines(proc, "listening_quic")
            finally:
                proc.terminate()
                proc.wait(timeout=10)
        assert "insecure_listener" not in {line["event"] for line in lines}, lines


def serve_help(columns: int) -> str:
    result = subprocess.run(
        [*PYLON, "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "COLUMNS": str(columns), "TERM": "dumb"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("columns", [80, 400])
def test_help_groups_flags_by_topic(columns: int) -> None:
    """Each flag on its own line under its topic, with its env var whole: at 80 columns no
    flag or env var name is cut (a table of columns cut 30 and 31 of them)."""
    text = serve_help(columns)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    headings = [lines.index(f"{topic}:") for topic in GROUPS]
    assert headings == sorted(headings), "topics out of order"
    words = text.split()
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        row = next(i for i, line in enumerate(lines) if line.split(" ")[2:3] == [flag])
        assert lines[row].startswith(f"  {flag}"), lines[row]
        # The flag's row sits in its topic's section.
        topic = max((h, GROUPS[n]) for n, h in enumerate(headings) if h < row)[1]
        assert topic == field_group(name), name
        env = f"PYLON_{name.upper()}]"
        assert env in words, name  # whole, as one word
        # Its env var comes in its own help, before the next flag.
        following = next((i for i in range(row + 1, len(lines)) if lines[i].startswith("  -")), 0)
        assert any(env in line for line in lines[row:following]), name
    assert "[choices: dynamo, vllm, sglang, passthrough]" in text
    assert "[default: 127.0.0.1:8080]" in text
    assert "SECONDS" in text and "BYTES" in text and "HOST:PORT" in text


def test_version() -> None:
    result = run_pylon("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"pylon \S+\n", result.stdout)


def test_config_warns_about_misspelled_environment_variables() -> None:
    result = run_pylon("config", env={"PYLON_BAKEND": "vllm"})
    assert result.returncode == 0
    assert json.loads(result.stdout)["backend"] == "dynamo"
    warning = json.loads(result.stderr.strip().splitlines()[-1])
    assert warning["event"] == "unknown_env_var"
    assert warning["variable"] == "PYLON_BAKEND" and warning["did_you_mean"] == "PYLON_BACKEND"


# --- signals ----------------------------------------------------------------------------------


@pytest.fixture
def slow_engine() -> Iterator[str]:
    """A mock_dynamo process that streams 2000 tokens, 50 ms apart: a request stays in flight."""
    with subprocess.Popen(
        [*ENGINE, "--port", "0", "--token-delay-ms", "50", "--num-tokens", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as engine:
        try:
            assert engine.stdout is not None
            announced = engine.stdout.readline()
            match = re.search(r"listening on (http://\S+)", announced)
            assert match, announced
            yield match.group(1)
        finally:
            engine.terminate()
            engine.wait(timeout=10)


def test_second_signal_during_the_drain_ends_it_at_once(slow_engine: str) -> None:
    """SIGTERM starts the drain (and pylon says what still runs); SIGINT then ends it at once,
    whatever the grace period, with status 128 + SIGINT."""
    with start_pylon(
        "--listen", "127.0.0.1:0", "--upstream", slow_engine, "--shutdown-grace", "60"
    ) as proc:
        try:
            lines = log_lines(proc, "ready")  # listening, then ready: the engine passed its gate
            listening = next(line for line in lines if line["event"] == "listening")
            host, port = listening["address"].rsplit(":", 1)
            body = json.dumps(
                {
                    "model": "mock-model",
                    "stream": True,
                    "max_tokens": 2000,
                    "messages": [{"role": "user", "content": "hi"}],
                }
            ).encode()
            with socket.create_connection((host, int(port)), timeout=10) as client:
                client.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: long-1\r\n"
                    b"x-model: mock-model\r\ncontent-length: %d\r\n\r\n" % len(body) + body
                )
                received = b""
                while b"data: {" not in received:  # the stream is flowing: in flight
                    chunk = client.recv(65536)
                    assert chunk, received
                    received += chunk
                proc.send_signal(signal.SIGTERM)
                draining = log_lines(proc, "draining")[-1]
                assert (draining["http1"], draining["h2"], draining["h3"]) == (1, 0, 0)
                assert 0 < draining["remaining_s"] <= 60
                started = time.monotonic()
                proc.send_signal(signal.SIGINT)
                lines = log_lines(proc, "forced_stop")
                assert proc.wait(timeout=10) == 128 + signal.SIGINT
                assert time.monotonic() - started < 10  # not the 60 s grace, nor the 100 s stream
                forced = lines[-1]
                assert forced["level"] == "warning" and forced["signal"] == "SIGINT"
                assert forced["http1"] == 1
                while client.recv(65536):  # the request was ended: the connection closes
                    pass
        finally:
            proc.kill()
            proc.wait()


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(
            run_pylon("serve", "--listen", f"127.0.0.1:{port}", "--upstream", "http://127.0.0.1:9")
        )
    assert line == f"pylon: --listen 127.0.0.1:{port}: cannot listen: address already in use"


@pytest.mark.parametrize("flag", ["--listen", "--admin-listen", "--quic-listen"])
def test_a_listener_host_that_does_not_resolve_is_named(flag: str) -> None:
    """Not `cannot start: Name or service not known`: the flag and the value it was given."""
    args = ["--listen", "127.0.0.1:0", "--upstream", "http://127.0.0.1:9", flag, "nohost.invalid:0"]
    result = run_pylon("serve", *args)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]  # after the QUIC identity's line, if any
    # The resolver's own words follow in parentheses (glibc: "Name or service not known").
    assert line.startswith(
        f"pylon: {flag} nohost.invalid:0: cannot listen: the host does not resolve ("
    )


def test_an_admin_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refusal(
            run_pylon(
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                f"127.0.0.1:{port}",
                "--upstream",
                "http://127.0.0.1:9",
            )
        )
    assert line == f"pylon: --admin-listen 127.0.0.1:{port}: cannot listen: address already in use"


def test_the_admin_listener_flag() -> None:
    assert Settings.model_fields["admin_listen"].default == "127.0.0.1:9089"
    assert effective("--admin-listen", "")["admin_listen"] == ""  # disabled
    assert effective("--admin-listen", "[::1]:0")["admin_listen"] == "[::1]:0"
    line = refusal(run_pylon("config", "--admin-listen", "nowhere"))
    assert line.startswith("pylon: invalid setting admin_listen (--admin-listen): ")


def test_a_refusal_comes_before_any_log_line(files: dict[str, str]) -> None:
    """Files are checked before logging starts: even with a warning due, the refusal is alone."""
    result = run_pylon("serve", "--tunnel-token-file", files["missing"], env={"PYLON_LISTN": "x"})
    assert "--tunnel-token-file" in refusal(result)


def test_otel_endpoint_from_flag_and_standard_env() -> None:
    config = effective("--otel-endpoint", "http://127.0.0.1:4318")
    assert config["otel_endpoint"] == "http://127.0.0.1:4318/"
    config = effective(
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SERVICE_NAME": "n1"}
    )
    assert config["otel_endpoint"] == "http://collector:4318/"
    assert config["otel_service_name"] == "n1"
    assert effective()["otel_endpoint"] is None


# `pylon` as installed without the otel extra: the exporter cannot be imported.
WITHOUT_OTEL = [
    sys.executable,
    "-c",
    "import sys; sys.modules['opentelemetry.exporter.otlp.proto.http.trace_exporter'] = None; "
    "from pylon.cli import main; sys.argv[0] = 'pylon'; main()",
]


def test_tracing_without_the_otel_extra_refuses_to_start() -> None:
    result = run_pylon(
        "serve",
        "--listen",
        "127.0.0.1:0",
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"},
        python=WITHOUT_OTEL,
    )
    line = refusal(result)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in line and "pip install 'pylon[otel]'" in line


# --- engine bring-up --------------------------------------------------------------------------


def test_repeatable_flags_collect_every_value() -> None:
    config = effective("--model", "a", "--model", "llama 3", "--upstream-health-path", "/ready")
    assert config["model"] == ["a", "llama 3"]
    assert config["upstream_health_path"] == ["/ready"]
    assert effective(env={"PYLON_MODEL": "x,y"})["model"] == ["x", "y"]


def test_static_models_with_a_discovery_interval_are_refused() -> None:
    line = refusal(run_pylon("serve", "--model", "m", "--model-discovery-interval", "1"))
    assert "--model-discovery-interval needs discovery" in line


def test_an_engine_that_never_gets_healthy_ends_pylon_with_the_reason() -> None:
    """The gate runs out: exit status 1, and one error line says what each path answered."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = run_pylon(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--upstream",
        f"http://127.0.0.1:{port}",
        "--upstream-health-wait",
        "0.3",
        "--upstream-health-interval",
        "0.05",
    )
    assert result.returncode == 1, result.stderr
    lines = [json.loads(line) for line in result.stderr.strip().splitlines()]
    errors = [line for line in lines if line["level"] == "error"]
    assert [line["event"] for line in errors] == ["engine_health_gate_failed"]
    assert lines[-1] is errors[0]  # the last word
    detail = errors[0]["detail"]
    assert f"127.0.0.1:{port}" in detail and "--upstream-health-wait 0.3 s" in detail
    assert "/health: cannot connect" in detail and "/v1/health/ready: cannot connect" in detail
    assert "Traceback" not in result.stderr
    assert "ready" not in {line["event"] for line in lines}

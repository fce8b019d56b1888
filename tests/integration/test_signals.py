"""Every signal `pylon serve` can catch does what docs/operations.md ("Signals") says, on a real
pylon process: SIGHUP reloads the TLS identity and the token file mid-stream, the report and
ignored signals leave it running, and none ends a stream."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import select
import signal
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio import connect

from pylon.signals import HANDLED, IGNORED, REPORT, STOP, signal_name
from tests.certs import fingerprint, make_leaf, write_pair
from tests.h3client import H3Client, client_configuration
from tests.integration.test_cli import ENGINE, clean_env, log_lines, start_pylon

TOKENS = 300  # the stream: 300 tokens, 20 ms apart (6 s), in flight through every signal


@pytest.fixture
def engine() -> Iterator[str]:
    with subprocess.Popen(
        [*ENGINE, "--port", "0", "--token-delay-ms", "20", "--num-tokens", str(TOKENS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            match = re.search(r"listening on (http://\S+)", proc.stdout.readline())
            assert match
            yield match.group(1)
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def _tls(host: str, port: int) -> ssl.SSLSocket:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context.wrap_socket(socket.create_connection((host, port), timeout=10))


def served_fingerprint(host: str, port: int) -> str:
    """The SHA-256 of the certificate a new TLS connection is handed."""
    with _tls(host, port) as client:
        der = client.getpeercert(binary_form=True)
    assert der is not None
    return hashlib.sha256(der).hexdigest()


def quic_fingerprint(address: str) -> str:
    """The SHA-256 of the certificate a new QUIC connection is handed."""

    async def handshake() -> str:
        host, port = address.rsplit(":", 1)
        async with asyncio.timeout(10):
            async with connect(
                host, int(port), configuration=client_configuration(), create_protocol=H3Client
            ) as client:
                assert isinstance(client, H3Client)
                return client.peer_fingerprint

    return asyncio.run(handshake())


def status_with(host: str, port: int, token: str) -> int:
    with _tls(host, port) as client:
        client.sendall(
            b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-request-id: auth-1\r\nx-model: mock-model\r\n"
            b"connection: close\r\n"
            b"authorization: Bearer " + token.encode() + b"\r\n\r\n"
        )
        head = client.recv(65536)
    return int(head.split(b" ", 2)[1])


def _stream(host: str, port: int, token: str) -> tuple[ssl.SSLSocket, bytes]:
    """A streaming chat request, read until its first chunk: in flight."""
    body = json.dumps(
        {
            "model": "mock-model",
            "stream": True,
            "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    client = _tls(host, port)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: hup-1\r\n"
        b"x-model: mock-model\r\nauthorization: Bearer " + token.encode() + b"\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    received = b""
    while b"data: {" not in received:
        chunk = client.recv(65536)
        assert chunk, received
        received += chunk
    return client, received


def _pending(client: ssl.SSLSocket) -> bytes:
    """What the stream has delivered so far, without waiting for more."""
    data = b""
    while client.pending() or select.select([client], [], [], 0)[0]:
        chunk = client.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _collect(proc: subprocess.Popen[str], wanted: dict[str, int]) -> list[dict[str, Any]]:
    """Log lines until `wanted` (event -> how many) have all been seen."""
    assert proc.stderr is not None
    said: list[dict[str, Any]] = []
    while any(sum(x["event"] == e for x in said) < n for e, n in wanted.items()):
        line = proc.stderr.readline()
        assert line, f"pylon exited with status {proc.wait(timeout=10)}: {said}"
        said.append(json.loads(line))
    return said


def _until_end(client: ssl.SSLSocket) -> bytes:
    data = b""
    while b"data: [DONE]" not in data:
        chunk = client.recv(65536)
        assert chunk, data[-200:]
        data += chunk
    return data


def test_the_signal_sets_are_what_the_docs_say() -> None:
    """An independent list: removing a signal from the handled set fails here."""
    assert set(STOP) == {signal.SIGINT, signal.SIGTERM, signal.SIGQUIT}
    assert set(REPORT) == {signal.SIGUSR1, signal.SIGUSR2}
    assert set(IGNORED) == {
        signal.SIGALRM,
        signal.SIGVTALRM,
        signal.SIGXCPU,
        signal.SIGXFSZ,
        signal.SIGIO,
        signal.SIGPWR,
        signal.SIGSTKFLT,
        *range(signal.SIGRTMIN, signal.SIGRTMAX + 1),
    }
    assert signal_name(signal.SIGRTMIN + 3) == "SIGRTMIN+3" and signal_name(1) == "SIGHUP"
    assert signal.SIGHUP in HANDLED and set(STOP) | set(REPORT) | set(IGNORED) <= set(HANDLED)


def test_sighup_reloads_mid_stream_and_no_other_signal_ends_pylon(
    engine: str, tmp_path: Path
) -> None:
    first, second = make_leaf(None), make_leaf(None)
    cert, key = write_pair(tmp_path, first)
    token_file = tmp_path / "token"
    token_file.write_text("old-token\n")
    args = ["--listen", "127.0.0.1:0", "--quic-listen", "127.0.0.1:0", "--upstream", engine]
    args += ["--tls-cert", str(cert)]
    args += ["--tls-key", str(key), "--tunnel-token-file", str(token_file)]
    # The poller never runs in this test: only SIGHUP can make pylon re-read the files.
    args += ["--tls-reload-interval", "3600", "--log-level", "warning"]
    client: ssl.SSLSocket | None = None
    with start_pylon(*args) as proc:
        try:
            lines = log_lines(proc, "ready")
            listening = next(line for line in lines if line["event"] == "listening")
            host, port_text = listening["address"].rsplit(":", 1)
            port = int(port_text)
            quic = next(line for line in lines if line["event"] == "listening_quic")["address"]
            assert served_fingerprint(host, port) == fingerprint(first[0])
            assert quic_fingerprint(quic) == fingerprint(first[0])
            client, received = _stream(host, port, "old-token")

            write_pair(tmp_path, second)
            token_file.write_text("new-token\n")
            proc.send_signal(signal.SIGHUP)
            reloaded = log_lines(proc, "reloaded")[-1]
            assert reloaded["signal"] == "SIGHUP" and reloaded["level"] == "info"
            assert reloaded["reloaded"] == ["tls", "tunnel_token"]
            assert reloaded["tls_sha256"] == fingerprint(second[0])
            assert reloaded["tunnel_token"] == "rotated" and reloaded["failed"] is None
            assert served_fingerprint(host, port) == fingerprint(second[0])
            assert quic_fingerprint(quic) == fingerprint(second[0])
            assert status_with(host, port, "old-token") == 401
            assert status_with(host, port, "new-token") == 200

            # A broken pair and an empty token file: an error line, the old ones kept.
            cert.write_bytes(b"not a certificate")
            token_file.write_text("")
            proc.send_signal(signal.SIGHUP)
            failed = log_lines(proc, "reload_failed")[-1]
            assert failed["level"] == "error" and failed["reloaded"] == []
            assert set(failed["failed"]) == {"tls", "tunnel_token"}
            assert "not valid PEM" in failed["failed"]["tls"]
            assert failed["tls_sha256"] == fingerprint(second[0])
            assert served_fingerprint(host, port) == fingerprint(second[0])
            assert quic_fingerprint(quic) == fingerprint(second[0])
            assert status_with(host, port, "new-token") == 200

            for sig in (*REPORT, *IGNORED, signal.SIGPIPE):
                proc.send_signal(sig)
            said = _collect(proc, {"status_report": len(REPORT), "signal_ignored": len(IGNORED)})
            reports = [line for line in said if line["event"] == "status_report"]
            assert {line["signal"] for line in reports} == {"SIGUSR1", "SIGUSR2"}
            assert reports[0]["phase"] == "ready" and reports[0]["http1"] == 1
            ignored = [line["signal"] for line in said if line["event"] == "signal_ignored"]
            # Each said once: a signal acted on twice would be a second SIGTERM in a drain.
            assert sorted(ignored) == sorted(signal_name(sig) for sig in IGNORED)
            assert proc.poll() is None

            # Every signal came while the stream ran; it ends whole, on the old identity.
            received += _pending(client)
            assert b"data: [DONE]" not in received, "the stream ended before the signals"
            received += _until_end(client)
            assert received.count(b"data: {") >= TOKENS
            proc.send_signal(signal.SIGTERM)
            late = log_lines(proc, "drained")
            assert [
                line for line in late if line["event"] in ("signal_ignored", "status_report")
            ] == []
            assert proc.wait(timeout=10) == 0
        finally:
            if client is not None:
                client.close()  # (also when an assertion failed: no socket left to the collector)
            proc.kill()
            proc.wait()


def test_sigquit_drains_like_sigterm(engine: str) -> None:
    """And SIGHUP with nothing to re-read says so."""
    with start_pylon("--listen", "127.0.0.1:0", "--upstream", engine) as proc:
        try:
            log_lines(proc, "ready")
            proc.send_signal(signal.SIGHUP)
            reloaded = log_lines(proc, "reloaded")[-1]
            assert reloaded["reloaded"] == [] and "nothing to re-read" in reloaded["detail"]
            proc.send_signal(signal.SIGQUIT)
            log_lines(proc, "drained")
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()
            proc.wait()


def test_a_signal_the_runtime_keeps_is_skipped_but_a_stop_signal_must_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under valgrind or a sanitizer some real-time signals cannot be caught (sigaction says
    EINVAL): pylon starts without them. A stop signal it cannot catch is no such case."""
    from pylon.signals import Signals

    real = signal.signal
    installed: list[int] = []
    refused = 0

    def sigaction(sig: int, handler: Any) -> Any:
        if handler in (signal.SIG_DFL, signal.default_int_handler):
            return real(sig, handler)  # the release after the block
        if sig == refused:
            raise OSError(22, "Invalid argument")
        installed.append(sig)
        return real(sig, handler)

    monkeypatch.setattr(signal, "signal", sigaction)

    async def main() -> None:
        with Signals(asyncio.Event(), asyncio.Event(), lambda *a, **k: None).handled():
            pass

    refused = signal.SIGRTMAX - 1
    asyncio.run(main())
    assert set(installed) == set(HANDLED) - {refused}
    refused = signal.SIGTERM
    with pytest.raises(OSError):
        asyncio.run(main())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # released again


# `pylon serve` with every stop, reload and report signal sent to itself while it loads its
# tokenizer (its start, before the event loop runs): what a signal during a slow start meets.
_EARLY = """
import os, signal, sys
import pylon.preflight
real = pylon.preflight.load_tokenizer
sent = []
def load_tokenizer(settings):
    if not sent:  # the command's own load, before the loop (start() calls it again)
        for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM, signal.SIGHUP):
            os.kill(os.getpid(), sig)  # the handler runs before kill returns (main thread)
            sent.append(sig)
    return real(settings)
pylon.preflight.load_tokenizer = load_tokenizer
sys.argv[0] = "pylon"
from pylon.cli import main
main()
"""


def test_signals_while_pylon_starts_are_acted_on_once_it_runs() -> None:
    """Before the event loop's handlers are in, each signal's default would end pylon with no
    line (SIGHUP, SIGTERM, SIGUSR1 all did, measured 0.3 s after the start): they are held and
    acted on once it runs, each once: SIGHUP and SIGUSR1 said as still starting, SIGTERM a
    graceful stop with nothing to drain (exit 0)."""
    args = ["serve", "--listen", "127.0.0.1:0", "--admin-listen", ""]
    proc = subprocess.run(
        [sys.executable, "-c", _EARLY, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=clean_env(),
    )
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert proc.returncode == 0, proc.stderr
    events = [line["event"] for line in lines]
    ignored = [line for line in lines if line["event"] == "signal_ignored"]
    assert [line["signal"] for line in ignored] == ["SIGHUP", "SIGUSR1"], ignored
    assert all(line["detail"].startswith("still starting") for line in ignored)
    assert "drained" in events and events.index("stopping") < events.index("drained"), events
    assert "forced_stop" not in events  # two SIGTERMs held: one stop, not a forced one

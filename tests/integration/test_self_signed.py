"""The self-signed QUIC identity can be trusted: pylon writes its certificate where
`--tls-self-signed-cert-file` says and logs its SHA-256, and a client that loads that file
completes a verified HTTP/3 handshake."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

from aioquic.asyncio import connect
from aioquic.quic.configuration import QuicConfiguration

from tests.certs import fingerprint
from tests.h3client import H3Client
from tests.integration.test_cli import log_lines, run_pylon, start_pylon


async def _verified_fingerprint(address: str, cafile: Path) -> str:
    host, port = address.rsplit(":", 1)
    configuration = QuicConfiguration(is_client=True, alpn_protocols=["h3"])
    configuration.server_name = "localhost"
    configuration.verify_mode = ssl.CERT_REQUIRED
    configuration.load_verify_locations(cafile=str(cafile))
    async with asyncio.timeout(10):
        async with connect(
            host, int(port), configuration=configuration, create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            return client.peer_fingerprint


def test_the_self_signed_certificate_is_written_logged_and_trusted(tmp_path: Path) -> None:
    out = tmp_path / "pylon-quic.pem"
    args = ["--listen", "127.0.0.1:0", "--quic-listen", "127.0.0.1:0"]
    args += ["--upstream", "http://127.0.0.1:9", "--tls-self-signed-cert-file", str(out)]
    with start_pylon(*args) as proc:
        try:
            lines = log_lines(proc, "listening_quic")
            said = next(line for line in lines if line["event"] == "tls_self_signed")
            assert said["level"] == "warning" and said["cert_file"] == str(out)
            pem = out.read_bytes()
            assert b"PRIVATE KEY" not in pem and oct(out.stat().st_mode & 0o777) == "0o644"
            assert said["fingerprint_sha256"] == fingerprint(pem)
            quic = next(line for line in lines if line["event"] == "listening_quic")
            served = asyncio.run(_verified_fingerprint(quic["address"], out))
            assert served == fingerprint(pem)
        finally:
            proc.kill()
            proc.wait()


def test_the_self_signed_file_is_refused_with_a_certificate_and_named_when_unwritable(
    tmp_path: Path,
) -> None:
    result = run_pylon(
        "serve",
        "--quic-listen",
        "127.0.0.1:0",
        "--upstream",
        "http://127.0.0.1:9",
        "--tls-self-signed-cert-file",
        str(tmp_path / "missing-dir" / "x.pem"),
    )
    assert result.returncode == 2
    assert (
        f"--tls-self-signed-cert-file {tmp_path / 'missing-dir' / 'x.pem'}: cannot write"
        in (result.stderr.strip().splitlines()[-1])
    )


def test_the_self_signed_file_with_a_certificate_is_refused(tmp_path: Path) -> None:
    result = run_pylon(
        "config",
        "--tls-cert",
        str(tmp_path / "c.pem"),
        "--tls-key",
        str(tmp_path / "k.pem"),
        "--tls-self-signed-cert-file",
        str(tmp_path / "x.pem"),
    )
    assert result.returncode == 2
    assert "--tls-self-signed-cert-file has no effect with --tls-cert" in result.stderr

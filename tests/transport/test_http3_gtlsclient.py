"""An independent HTTP/3 implementation against pylon: ngtcp2's `gtlsclient` (Debian package
ngtcp2-client; GnuTLS + nghttp3), through `pylon.app.serve` with --quic-listen.

gtlsclient cannot add request headers, so it proves the wire format (QUIC v1, Retry, TLS 1.3,
QPACK, ALPN h3) and the contract path: /health reaches the engine, a POST without the tunnel
headers gets pylon's 400 problem+json. Tunnel-header requests over HTTP/3 are covered with
aioquic's client in the other test modules.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from mock_dynamo.server import MockConfig, start_mock
from pylon.app import serve
from pylon.logs import configure_logging
from pylon.settings import load_settings
from tests.h3client import MODEL

GTLSCLIENT = shutil.which("gtlsclient")
pytestmark = pytest.mark.skipif(
    GTLSCLIENT is None, reason="gtlsclient not installed (apt-get install ngtcp2-client)"
)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, str]]:
    """pylon.app.serve with an HTTP/3 listener; yields (quic host:port, mock base URL)."""
    configure_logging("json", "warning")
    engine = await start_mock(MockConfig(models=(MODEL,)), host="127.0.0.1", port=0)
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "quic_listen": "127.0.0.1:0",
            "upstream": engine.base_url,
            "log_level": "warning",
        }
    )
    loop = asyncio.get_running_loop()
    quic: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(settings, stop=stop, handle_signals=False, on_quic_ready=quic.set_result)
    )
    try:
        yield await asyncio.wait_for(quic, 5), str(engine.base_url)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await engine.stop()


async def _gtlsclient(address: str, path: str, *options: str) -> tuple[int, str]:
    host, port = address.rsplit(":", 1)
    assert GTLSCLIENT is not None
    proc = await asyncio.create_subprocess_exec(
        GTLSCLIENT,
        "--exit-on-all-streams-close",
        "--no-quic-dump",
        "--timeout=5s",
        *options,
        host,
        port,
        f"https://localhost:{port}{path}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 15)
    return proc.returncode or 0, out.decode(errors="replace")


async def test_gtlsclient_health_through_pylon(served: tuple[str, str]) -> None:
    address, mock_url = served
    rc, out = await _gtlsclient(address, "/health")
    assert rc == 0, out
    assert "HTTP stream 0 closed with error code 256" in out  # 0x100 = H3_NO_ERROR
    async with httpx.AsyncClient(timeout=5) as http:
        records = (await http.get(f"{mock_url}/test-control")).json()["requests"]
    assert [r["path"] for r in records] == ["/health"]


async def test_gtlsclient_post_without_tunnel_headers_gets_problem_json(
    served: tuple[str, str], tmp_path: Path
) -> None:
    address, mock_url = served
    body = tmp_path / "body.json"
    body.write_text('{"model": "mock-model", "messages": []}')
    rc, out = await _gtlsclient(address, "/v1/chat/completions", "-m", "POST", "-d", str(body))
    assert rc == 0, out
    dump = "".join(
        line.split("|", 1)[1].rsplit("|", 1)[0] for line in out.splitlines() if "|" in line
    )
    assert "missing_request_id" in dump, out
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(f"{mock_url}/test-control")).json()["requests"] == []

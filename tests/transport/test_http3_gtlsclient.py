"""An independent HTTP/3 implementation against pylon: ngtcp2's `gtlsclient` (Debian package
ngtcp2-client; GnuTLS + nghttp3), on the test stack's QUIC listener.

gtlsclient cannot add request headers, so it proves the wire format (QUIC v1, Retry, TLS 1.3,
QPACK, ALPN h3) and the contract path: /health reaches the engine, a POST without the tunnel
headers gets pylon's 400 problem+json. Tunnel-header requests over HTTP/3 are covered with
aioquic's client in the other test modules.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.stack import StackFactory

GTLSCLIENT = shutil.which("gtlsclient")
pytestmark = pytest.mark.skipif(
    GTLSCLIENT is None, reason="gtlsclient not installed (apt-get install ngtcp2-client)"
)


async def _gtlsclient(host: str, port: int, path: str, *options: str) -> tuple[int, str]:
    assert GTLSCLIENT is not None
    proc = await asyncio.create_subprocess_exec(
        GTLSCLIENT,
        "--exit-on-all-streams-close",
        "--no-quic-dump",
        "--timeout=5s",
        *options,
        host,
        str(port),
        f"https://localhost:{port}{path}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 15)
    return proc.returncode or 0, out.decode(errors="replace")


async def test_gtlsclient_health_through_pylon(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    rc, out = await _gtlsclient(stack.host, stack.port, "/health")
    assert rc == 0, out
    assert "HTTP stream 0 closed with error code 256" in out  # 0x100 = H3_NO_ERROR
    assert [r["path"] for r in await stack.records()] == ["/health"]


async def test_gtlsclient_post_without_tunnel_headers_gets_problem_json(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    stack = await make_stack("dynamo")
    body = tmp_path / "body.json"
    body.write_text('{"model": "mock-model", "messages": []}')
    rc, out = await _gtlsclient(
        stack.host, stack.port, "/v1/chat/completions", "-m", "POST", "-d", str(body)
    )
    assert rc == 0, out
    dump = "".join(
        line.split("|", 1)[1].rsplit("|", 1)[0] for line in out.splitlines() if "|" in line
    )
    assert "missing_request_id" in dump, out
    assert await stack.records() == []

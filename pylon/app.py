"""Process wiring: build the pool, the proxy and the listener from Settings, run until stopped."""

from __future__ import annotations

import asyncio
import signal
import ssl
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Literal

from pylon.logs import get_logger
from pylon.proxy import Proxy
from pylon.server.http1 import Http1Connection
from pylon.server.http2 import H2Limits, Http2Connection, ProtocolSwitch
from pylon.settings import Settings, split_host_port
from pylon.upstream.pool import UpstreamPool, UpstreamTarget

if TYPE_CHECKING:
    from pylon.tls import TlsIdentity

# Which mock_dynamo flavour stands in for each backend when no --upstream is given.
_MOCK_FLAVOR: dict[str, Literal["dynamo", "vllm", "sglang"]] = {
    "dynamo": "dynamo",
    "passthrough": "dynamo",
    "vllm": "vllm",
    "sglang": "sglang",
}
EMBEDDED_MOCK_MODEL = "mock-model"
# Seconds in-flight HTTP/3 streams get to finish after GOAWAY when pylon stops.
QUIC_SHUTDOWN_GRACE = 1.0


def upstream_target(url: str) -> UpstreamTarget:
    _, _, rest = url.partition("://")
    authority, _, path = rest.partition("/")
    host, port = (
        split_host_port(authority)
        if authority.rpartition(":")[2].isdigit()
        else (authority.strip("[]"), 80)
    )
    return UpstreamTarget(host=host, port=port, base_path=("/" + path).rstrip("/"))


async def _embedded_mock(settings: Settings, stack: AsyncExitStack) -> str:
    from mock_dynamo.server import MockConfig, start_mock

    mock = await start_mock(
        MockConfig(
            flavor=_MOCK_FLAVOR[settings.backend],
            models=(EMBEDDED_MOCK_MODEL,),
            ttft_ms=50,
            token_delay_ms=20,
            num_tokens=16,
        ),
        host="127.0.0.1",
        port=0,
    )
    stack.push_async_callback(mock.stop)
    get_logger().info(
        "embedded_mock_started",
        detail="no --upstream given: serving an embedded mock_dynamo engine",
        upstream=mock.base_url,
        flavor=_MOCK_FLAVOR[settings.backend],
        model=EMBEDDED_MOCK_MODEL,
    )
    return str(mock.base_url)


def _tls_identity(settings: Settings, stack: AsyncExitStack) -> TlsIdentity | None:
    """One hot-reloaded identity for every TLS listener (TCP with a certificate, and QUIC)."""
    if settings.tls_cert is None and settings.quic_listen is None:
        return None
    from pylon.tls import TlsIdentity

    identity = TlsIdentity.from_paths(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    reloader = asyncio.create_task(identity.watch(settings.tls_reload_interval))
    stack.callback(reloader.cancel)
    return identity


def tcp_ssl_context(identity: TlsIdentity) -> ssl.SSLContext:
    """The TCP listener's context: ALPN h2 and http/1.1, client certificates per --tls-client-ca.

    asyncio fixes a server's context at creation; to serve a reloaded certificate without a
    restart, each handshake switches to the identity's current context in the servername
    callback (OpenSSL runs it for every ClientHello, with or without SNI).
    """
    alpn = ("h2", "http/1.1")
    base = identity.current_ssl_context(alpn)

    def current(ssl_object: ssl.SSLObject, _name: str | None, context: ssl.SSLContext) -> None:
        latest = identity.current_ssl_context(alpn)
        if latest is not context:
            ssl_object.context = latest

    base.sni_callback = current
    return base


async def _start_quic(
    settings: Settings, proxy: Proxy, stack: AsyncExitStack, identity: TlsIdentity
) -> str:
    """The HTTP/3 listener (direct tunnel mode), with its hot-reloaded TLS identity."""
    from pylon.server.http3 import Http3Server

    assert settings.quic_listen is not None
    h3 = Http3Server(settings, proxy, identity)
    host, port = await h3.start(*split_host_port(settings.quic_listen))
    stack.push_async_callback(h3.shutdown, QUIC_SHUTDOWN_GRACE)
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    get_logger().info("listening_quic", address=address, alpn="h3", retry=settings.quic_retry)
    return address


def tcp_protocol_factory(settings: Settings, proxy: Proxy) -> Callable[[], asyncio.Protocol]:
    """HTTP/1.1 and HTTP/2 share the TCP port: `ProtocolSwitch` picks one per connection."""
    limits = H2Limits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        max_body=settings.max_body_bytes,
        max_streams=settings.h2_max_concurrent_streams,
        stream_window=settings.h2_stream_window,
        header_timeout=settings.header_timeout,
        idle_timeout=settings.client_idle_timeout,
        max_stream_resets=settings.max_stream_resets,
        max_control_frames=settings.max_control_frames,
        flood_window=settings.flood_window,
    )

    def http1() -> asyncio.Protocol:
        return Http1Connection(
            proxy,
            settings.max_header_bytes,
            settings.max_headers,
            settings.max_body_bytes,
            header_timeout=settings.header_timeout,
            idle_timeout=settings.client_idle_timeout,
        )

    def http2() -> asyncio.Protocol:
        return Http2Connection(proxy, limits)

    return lambda: ProtocolSwitch(http1, http2, settings.header_timeout)


async def serve(
    settings: Settings,
    on_ready: Callable[[str], Any] | None = None,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
    on_quic_ready: Callable[[str], Any] | None = None,
) -> None:
    """Run pylon until `stop` is set or SIGINT/SIGTERM arrives."""
    loop = asyncio.get_running_loop()
    log = get_logger()
    stop = stop or asyncio.Event()
    async with AsyncExitStack() as stack:
        upstream = (
            str(settings.upstream) if settings.upstream else await _embedded_mock(settings, stack)
        )
        pool = UpstreamPool(
            upstream_target(upstream),
            connect_timeout=settings.upstream_connect_timeout,
            idle_timeout=settings.upstream_idle_timeout,
            max_idle=settings.upstream_max_idle,
        )
        stack.callback(pool.close)
        proxy = Proxy(settings, pool)
        host, port = settings.listen_host_port
        identity = _tls_identity(settings, stack)
        tls = settings.tls_cert is not None and identity is not None
        server = await loop.create_server(
            tcp_protocol_factory(settings, proxy),
            host,
            port,
            reuse_address=True,
            backlog=2048,
            ssl=tcp_ssl_context(identity) if tls and identity is not None else None,
        )
        stack.callback(server.close)
        bound = server.sockets[0].getsockname()
        address = f"{bound[0]}:{bound[1]}" if ":" not in bound[0] else f"[{bound[0]}]:{bound[1]}"
        if settings.quic_listen is not None:
            assert identity is not None
            quic_address = await _start_quic(settings, proxy, stack, identity)
            if on_quic_ready is not None:
                on_quic_ready(quic_address)
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
                stack.callback(loop.remove_signal_handler, sig)
        log.info(
            "listening",
            address=address,
            url=f"{'https' if tls else 'http'}://{address}",
            upstream=upstream,
            backend=settings.backend,
            derive_priority=settings.derive_priority,
        )
        if on_ready is not None:
            on_ready(address)
        await stop.wait()
        log.info("stopping", address=address)

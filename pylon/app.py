"""Process wiring: build the pool, the proxy and the listener from Settings, run until stopped."""

from __future__ import annotations

import asyncio
import signal
import ssl
import weakref
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pylon.logs import get_logger
from pylon.proxy import Proxy
from pylon.server.http1 import Http1Connection
from pylon.server.http2 import H2Limits, Http2Connection, ProtocolSwitch
from pylon.settings import Settings, split_host_port
from pylon.upstream.pool import UpstreamPool, UpstreamTarget

if TYPE_CHECKING:
    from pylon.server.http3 import Http3Server
    from pylon.tls import TlsIdentity

_Conn = TypeVar("_Conn", Http1Connection, Http2Connection, ProtocolSwitch)

# Which mock_dynamo flavour stands in for each backend when no --upstream is given.
_MOCK_FLAVOR: dict[str, Literal["dynamo", "vllm", "sglang"]] = {
    "dynamo": "dynamo",
    "passthrough": "dynamo",
    "vllm": "vllm",
    "sglang": "sglang",
}
EMBEDDED_MOCK_MODEL = "mock-model"


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
) -> tuple[Http3Server, str]:
    """The HTTP/3 listener (direct tunnel mode), with its hot-reloaded TLS identity."""
    from pylon.server.http3 import Http3Server

    assert settings.quic_listen is not None
    h3 = Http3Server(settings, proxy, identity)
    host, port = await h3.start(*split_host_port(settings.quic_listen))
    stack.callback(h3.close)
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    get_logger().info("listening_quic", address=address, alpn="h3", retry=settings.quic_retry)
    return h3, address


class LiveConnections:
    """The TCP listener's open connections, so shutdown can drain them (weakly held)."""

    def __init__(self) -> None:
        self._connections: weakref.WeakSet[Http1Connection | Http2Connection | ProtocolSwitch] = (
            weakref.WeakSet()
        )

    def add(self, connection: _Conn) -> _Conn:
        self._connections.add(connection)
        return connection

    def drain(self) -> None:
        for connection in list(self._connections):
            connection.graceful_close()

    @property
    def busy(self) -> int:
        return sum(1 for connection in list(self._connections) if connection.busy)


async def drain_and_wait(live: LiveConnections, h3: Http3Server | None, grace: float) -> None:
    """Stop admitting work everywhere, then let requests in flight finish for up to `grace` s."""
    loop = asyncio.get_running_loop()
    live.drain()
    if h3 is not None:
        h3.drain()
    deadline = loop.time() + grace
    while loop.time() < deadline and (live.busy or (h3 is not None and h3.connections)):
        await asyncio.sleep(0.02)
    get_logger().info(
        "drained", unfinished_tcp=live.busy, unfinished_quic=h3.connections if h3 else 0
    )


def tcp_protocol_factory(
    settings: Settings, proxy: Proxy, live: LiveConnections | None = None
) -> Callable[[], asyncio.Protocol]:
    """HTTP/1.1 and HTTP/2 share the TCP port: `ProtocolSwitch` picks one per connection."""
    live = live or LiveConnections()
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
        return live.add(
            Http1Connection(
                proxy,
                settings.max_header_bytes,
                settings.max_headers,
                settings.max_body_bytes,
                header_timeout=settings.header_timeout,
                idle_timeout=settings.client_idle_timeout,
            )
        )

    def http2() -> asyncio.Protocol:
        return live.add(Http2Connection(proxy, limits))

    return lambda: live.add(ProtocolSwitch(http1, http2, settings.header_timeout))


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
        live = LiveConnections()
        server = await loop.create_server(
            tcp_protocol_factory(settings, proxy, live),
            host,
            port,
            reuse_address=True,
            backlog=2048,
            ssl=tcp_ssl_context(identity) if tls and identity is not None else None,
        )
        stack.callback(server.close)
        bound = server.sockets[0].getsockname()
        address = f"{bound[0]}:{bound[1]}" if ":" not in bound[0] else f"[{bound[0]}]:{bound[1]}"
        h3: Http3Server | None = None
        if settings.quic_listen is not None:
            assert identity is not None
            h3, quic_address = await _start_quic(settings, proxy, stack, identity)
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
        # Graceful stop: no new connections, no new requests (GOAWAY on HTTP/2 and HTTP/3, idle
        # HTTP/1.1 keep-alives closed), and requests in flight get the grace period to finish.
        log.info("stopping", address=address, grace_s=settings.shutdown_grace)
        server.close()
        await drain_and_wait(live, h3, settings.shutdown_grace)

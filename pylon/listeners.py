"""The listeners of one pylon, on the parts `pylon.assemble.build_core` built: the admin listener
(`--admin-listen`), the TCP listener (HTTP/1.1 and HTTP/2 on one port, TLS with `--tls-cert`)
and the QUIC listener (HTTP/3, `--quic-listen`), with the one hot-reloaded TLS identity they
share and the TCP listener's open connections (so a drain can wait for them).

A supervised process (`pylon serve --processes N`, `pylon.supervisor`) binds nothing itself: it
adopts the sockets its supervisor bound (`Inherited`), serves its admin on a Unix socket, and
presents the supervisor's one certificate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import weakref
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pylon.assemble import Core, quic_options
from pylon.server.http1 import Http1Connection
from pylon.server.http2 import Http2Connection, ProtocolSwitch
from pylon.settings import Settings, split_host_port
from pylon.startup import StartupError, cannot_listen

if TYPE_CHECKING:
    from pylon.admin import AdminServer
    from pylon.observe import Observer
    from pylon.server.http3 import Http3Server
    from pylon.tls import TlsIdentity


@dataclass(frozen=True)
class Inherited:
    """What a supervised process is handed instead of binding (`pylon.supervisor`)."""

    tcp: socket.socket  # bound with SO_REUSEPORT, not listening yet: `listen` happens here
    udp: socket.socket | None = None  # bound with SO_REUSEPORT; with --quic-listen
    admin_socket: str | None = None  # the Unix socket to serve the admin on (no TCP admin)
    tls_pair: tuple[Path, Path] | None = None  # the supervisor's self-signed cert and key
    reset_key: bytes | None = None  # the QUIC stateless-reset key of the whole node
    # The node's booking authority (`pylon.routing.authority`), when one runs: routing books
    # there (`build_routing(..., authority=)`) instead of in this process alone.
    booking_socket: Path | None = None


TCP_BACKLOG = 2048


class LiveConnections:
    """The TCP listener's open connections, so shutdown can wait for them (weakly held)."""

    def __init__(self) -> None:
        self._connections: weakref.WeakSet[Http1Connection | Http2Connection] = weakref.WeakSet()

    def add(self, connection: Http1Connection | Http2Connection) -> asyncio.Protocol:
        self._connections.add(connection)
        return connection

    def close_all(self) -> None:
        """End every connection now: what still runs is cancelled (outcome `shutdown`)."""
        for connection in list(self._connections):
            connection.close_now()

    @property
    def busy(self) -> int:
        """Connections with a response in progress."""
        return sum(1 for connection in list(self._connections) if connection.busy)

    @property
    def in_progress(self) -> int:
        """Requests started on TCP connections and not answered yet (heads included)."""
        return sum(connection.in_progress for connection in list(self._connections))

    def in_progress_by_transport(self) -> dict[str, int]:
        """`in_progress`, per transport: {"http1": n, "h2": n}."""
        counts = {"http1": 0, "h2": 0}
        for connection in list(self._connections):
            kind = "h2" if isinstance(connection, Http2Connection) else "http1"
            counts[kind] += connection.in_progress
        return counts


@dataclass
class Listeners:
    """Every listener of one pylon, started: where each listens, and what runs on them."""

    address: str  # the TCP listener, host:port
    url: str  # the TCP listener as a base URL (https:// with --tls-cert)
    live: LiveConnections
    tcp_server: asyncio.AbstractServer
    h3: Http3Server | None = None  # None without --quic-listen
    quic_address: str | None = None
    admin: AdminServer | None = None  # None when the admin listener is disabled
    admin_address: str | None = None  # the admin listener, host:port
    identity: TlsIdentity | None = None  # the TLS listeners' identity (SIGHUP re-reads it)
    http2_codec: str = "h2"  # the HTTP/2 codec in use (--http2-codec)
    http2_fallback: str | None = None  # --http2-codec auto: why it is not ngh2

    @property
    def busy(self) -> bool:
        """A response is still in progress on TCP, or a QUIC connection is still open."""
        return bool(self.live.busy or (self.h3 is not None and self.h3.connections))

    def in_flight(self) -> dict[str, int]:
        """Requests still running, per transport: what the drain is waiting for."""
        counts = self.live.in_progress_by_transport()
        counts["h3"] = self.h3.in_progress if self.h3 is not None else 0
        return counts

    def unfinished(self) -> dict[str, int]:
        """What a drain leaves behind: busy TCP connections, open QUIC connections."""
        return {
            "unfinished_tcp": self.live.busy,
            "unfinished_quic": self.h3.connections if self.h3 is not None else 0,
        }

    def close_all(self) -> None:
        """End every connection now; their requests are cancelled (outcome `shutdown`)."""
        self.live.close_all()
        if self.h3 is not None:
            self.h3.close_connections()


async def start_listeners(
    settings: Settings, core: Core, stack: AsyncExitStack, inherited: Inherited | None = None
) -> Listeners:
    """Every listener of `settings`, each closed by `stack`. The admin listener first, so that
    /live and /ready answer (not ready yet) while the rest starts. `inherited`: the sockets
    and identity a supervisor handed this process (`pylon.supervisor`)."""
    admin, admin_address = await start_admin(settings, core, stack, inherited)
    identity = tls_identity(settings, stack, core.observer, inherited)
    live = LiveConnections()
    http2_class, http2_fallback = select_codec(settings.http2_codec)
    server, address, tls = await start_tcp(
        settings, core, live, identity, stack, inherited, http2_class
    )
    listeners = Listeners(address, f"{'https' if tls else 'http'}://{address}", live, server)
    listeners.http2_codec, listeners.http2_fallback = http2_class.codec, http2_fallback
    listeners.admin, listeners.admin_address = admin, admin_address
    listeners.identity = identity
    if settings.quic_listen is not None:
        assert identity is not None
        listeners.h3, listeners.quic_address = await start_quic(
            settings, core, stack, identity, inherited
        )
    return listeners


async def start_admin(
    settings: Settings, core: Core, stack: AsyncExitStack, inherited: Inherited | None = None
) -> tuple[AdminServer | None, str | None]:
    """The admin listener (`--admin-listen`, or the Unix socket a supervisor gave), unless it
    is disabled; a bind failure refuses the start (`StartupError`)."""
    if core.metrics is None:
        return None, None
    from pylon.admin import AdminRoutes, AdminServer

    admin = AdminServer(AdminRoutes(core.lifecycle, core.metrics.registry))
    if inherited is not None and inherited.admin_socket is not None:
        address = await admin.start_unix(inherited.admin_socket)
    else:
        address = await admin.start(settings.admin_listen)
    stack.callback(admin.close)
    return admin, address


def tls_identity(
    settings: Settings,
    stack: AsyncExitStack,
    observer: Observer,
    inherited: Inherited | None = None,
) -> TlsIdentity | None:
    """One hot-reloaded identity for every TLS listener (TCP with a certificate, and QUIC); it
    reports its loads and reloads to `observer` as process events. A supervised process
    without --tls-cert presents its supervisor's self-signed pair (published by the supervisor)."""
    if settings.tls_cert is None and settings.quic_listen is None:
        return None
    from pylon.tls import TlsIdentity

    if settings.tls_cert is None and inherited is not None and inherited.tls_pair is not None:
        return TlsIdentity.shared(
            *inherited.tls_pair, settings.tls_client_ca, observer.process_event
        )
    identity = TlsIdentity.from_paths(
        settings.tls_cert, settings.tls_key, settings.tls_client_ca, observer.process_event
    )
    if identity.current.source == "self-signed":
        publish_self_signed(identity, settings.tls_self_signed_cert_file, observer)
    reloader = asyncio.create_task(identity.watch(settings.tls_reload_interval))
    stack.callback(reloader.cancel)
    return identity


def publish_self_signed(identity: TlsIdentity, path: Path | None, observer: Observer) -> None:
    """A certificate generated at start (a new one at every start) is of use to a client only
    if it can trust it: written to `--tls-self-signed-cert-file`, and said, with its SHA-256,
    in a warning (a production node gives --tls-cert and --tls-key)."""
    from pylon.tls import SELF_SIGNED_DNS, SELF_SIGNED_IPS, TlsMaterialError, write_certificate

    material = identity.current
    if path is not None:
        try:
            write_certificate(material, path)
        except TlsMaterialError as exc:
            raise StartupError(f"--tls-self-signed-cert-file {path}: {exc}") from None
    observer.process_event(
        "tls_self_signed",
        fingerprint_sha256=material.fingerprint,
        cert_file=str(path) if path is not None else None,
        names=",".join(
            [*(f"DNS:{n}" for n in SELF_SIGNED_DNS), *(f"IP:{a}" for a in SELF_SIGNED_IPS)]
        ),
        detail="HTTP/3 serves a certificate generated at this start (a new one at every "
        "start): clients trust cert_file or pin fingerprint_sha256; give --tls-cert and "
        "--tls-key for a stable identity",
    )


async def start_tcp(
    settings: Settings,
    core: Core,
    live: LiveConnections,
    identity: TlsIdentity | None,
    stack: AsyncExitStack,
    inherited: Inherited | None = None,
    http2_class: type[Http2Connection] = Http2Connection,
) -> tuple[asyncio.AbstractServer, str, bool]:
    """The TCP listener, TLS with `--tls-cert`: the server, its bound host:port, and whether
    it speaks TLS. With `inherited`, on the socket the supervisor bound."""
    context = None
    if settings.tls_cert is not None and identity is not None:
        context = tcp_ssl_context(identity)
    host, port = settings.listen_host_port
    loop = asyncio.get_running_loop()
    factory = tcp_protocol_factory(core, live, http2_class)
    try:
        if inherited is not None:
            server = await loop.create_server(
                factory, sock=inherited.tcp, backlog=TCP_BACKLOG, ssl=context
            )
        else:
            server = await loop.create_server(
                factory, host, port, reuse_address=True, backlog=TCP_BACKLOG, ssl=context
            )
    except OSError as exc:
        raise cannot_listen("--listen", settings.listen, exc) from None
    stack.callback(server.close)
    bound = server.sockets[0].getsockname()
    return server, host_port(bound[0], bound[1]), context is not None


def tcp_protocol_factory(
    core: Core, live: LiveConnections, http2_class: type[Http2Connection] = Http2Connection
) -> Callable[[], asyncio.Protocol]:
    """HTTP/1.1 and HTTP/2 share the TCP port: `ProtocolSwitch` picks one per connection.
    `http2_class`: the HTTP/2 codec's connection (`select_codec`, --http2-codec)."""

    def http1() -> asyncio.Protocol:
        return live.add(Http1Connection(core.ingress))

    def http2() -> asyncio.Protocol:
        return live.add(http2_class(core.ingress))

    return lambda: ProtocolSwitch(http1, http2, core.limits.stall_timeout, core.lifecycle)


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


async def start_quic(
    settings: Settings,
    core: Core,
    stack: AsyncExitStack,
    identity: TlsIdentity,
    inherited: Inherited | None = None,
) -> tuple[Http3Server, str]:
    """The HTTP/3 listener (direct tunnel mode), with its hot-reloaded TLS identity; with
    `inherited`, on the supervisor's UDP socket and with the node's stateless-reset key."""
    from pylon.server.http3 import Http3Server

    assert settings.quic_listen is not None
    options = quic_options(settings)
    sock = None
    if inherited is not None:
        options = dataclasses.replace(options, reset_key=inherited.reset_key)
        sock = inherited.udp
    h3 = Http3Server(core.ingress, identity, options)
    try:
        host, port = await h3.start(*split_host_port(settings.quic_listen), sock=sock)
    except OSError as exc:
        raise cannot_listen("--quic-listen", settings.quic_listen, exc) from None
    stack.callback(h3.close)
    address = host_port(host, port)
    core.observer.process_event(
        "listening_quic", address=address, alpn="h3", retry=settings.quic_retry
    )
    return h3, address


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"


def select_codec(choice: str) -> tuple[type[Http2Connection], str | None]:
    """`--http2-codec`: the connection class, and (with `auto`) why ngh2 was not taken.

    `h2` is h2; `ngh2` is ngh2 or a refusal to start (`StartupError`), never a silent h2;
    `auto` is ngh2 where it imports and passes its start check, else h2 with the reason."""
    if choice == "h2":
        return Http2Connection, None
    try:
        from pylon.server.http2_ngh2 import Ngh2Connection, check_codec

        check_codec()
    except (ImportError, RuntimeError) as exc:
        if choice == "ngh2":
            raise StartupError(f"--http2-codec ngh2: cannot use ngh2 ({exc})") from None
        return Http2Connection, f"ngh2 unavailable ({exc})"
    return Ngh2Connection, None

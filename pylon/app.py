"""Process wiring, the one place parts are built: Settings in, listeners running, until stopped.

`build_core` assembles the transport-neutral parts (lifecycle, observers, metrics, admission,
pool, router, tracer, queue admission, proxy) from Settings; the listeners get them injected.
Nothing below this module reads Settings: each component takes its own frozen options,
built from Settings in `pylon.assemble`.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pylon.adapters import build_adapter
from pylon.assemble import (
    bring_up_options,
    ingress_limits,
    pool_options,
    quic_options,
    relay_limits,
    routing_options,
    tracing_options,
)
from pylon.auth import TokenAuth
from pylon.bringup import BringUp, EngineNotReady, bring_up
from pylon.core.intake import IngressLimits
from pylon.core.plan import Planner
from pylon.core.queue import QueueAdmission, QueueTable
from pylon.core.target import UpstreamTarget
from pylon.lifecycle import Lifecycle
from pylon.metrics import MetricsObserver
from pylon.observe import LogObserver, Observer, Observers
from pylon.preflight import (
    StartupError,
    check_files,
    check_routing,
    check_tracing,
    config_warnings,
    insecure_listeners,
    load_tokenizer,
    tokenizer_warnings,
)
from pylon.proxy import Proxy, ProxyAdmission
from pylon.routing import Router, SingleUpstream
from pylon.routing.build import Routing, build_routing
from pylon.server.budget import BodyBudget
from pylon.server.http1 import Http1Connection
from pylon.server.http2 import Http2Connection, ProtocolSwitch
from pylon.server.streams import Ingress
from pylon.settings import Settings, split_host_port
from pylon.tracing import ExchangeTracer
from pylon.upstream.pool import UpstreamPool

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pylon.admin import AdminServer
    from pylon.server.http3 import Http3Server
    from pylon.tls import TlsIdentity
    from pylon.tokenize import Tokenizer

# Which mock_dynamo flavour stands in for each backend when no --upstream is given.
_MOCK_FLAVOR: dict[str, Literal["dynamo", "vllm", "sglang"]] = {
    "dynamo": "dynamo",
    "passthrough": "dynamo",
    "vllm": "vllm",
    "sglang": "sglang",
}
EMBEDDED_MOCK_MODEL = "mock-model"
DRAIN_REPORT_INTERVAL = 1.0  # seconds between `draining` lines
EXIT_ENGINE_NOT_READY = 1  # the engine never passed its health gate
READY_LINE_MODELS = 32  # model names the `ready` line lists (then only the count says more)


@dataclass(frozen=True, slots=True)
class Core:
    """The transport-neutral parts every listener shares."""

    lifecycle: Lifecycle
    observer: Observer
    admission: ProxyAdmission
    proxy: Proxy
    pool: UpstreamPool
    limits: IngressLimits
    ingress: Ingress  # what every client connection shares
    queue: QueueAdmission  # the live request tables and queue estimates (`queue.table`)
    tracer: ExchangeTracer | None = None  # None: tracing is off
    metrics: MetricsObserver | None = None  # None when there is no admin listener to serve them
    tokenizer: Tokenizer | None = None  # --tokenizer, loaded once (pylon.tokenize)


def build_core(
    settings: Settings,
    upstream: str,
    *,
    observer: Observer | None = None,
    lifecycle: Lifecycle | None = None,
    router: Router | None = None,
    span_exporter: SpanExporter | None = None,
    tokenizer: Tokenizer | None = None,
) -> Core:
    """Assemble the proxy and its parts. Must run inside the event loop (the pool binds it).

    `router`: who picks the engine worker; default, every request to `upstream`.
    `observer`: who hears the events (default, the log lines); with an admin listener, the
    metrics hear them too (`Observers`).
    `span_exporter`: where spans go instead of the OTLP collector (tests); tracing is on when
    it is given or `settings.otel_endpoint` is set, and nothing of it is built otherwise.
    `tokenizer`: the `--tokenizer` model dir as `preflight.load_tokenizer` loaded it.
    """
    metrics = (
        MetricsObserver(
            settings.backend,
            priority_ceiling=settings.priority_ceiling,
            local_connect_retryable=settings.local_connect_failures_retryable,
        )
        if settings.admin_listen
        else None
    )
    observer = observer or LogObserver()
    if metrics is not None:
        observer = Observers(observer, metrics)
    lifecycle = lifecycle or Lifecycle()
    path = settings.tunnel_token_file
    auth = TokenAuth(path) if path is not None else None
    pool = UpstreamPool(pool_options(settings))
    adapter = build_adapter(
        settings.backend, settings.adapter_options, derive=settings.derive_priority
    )
    planner = Planner(adapter, consumed=auth.consumed if auth is not None else frozenset())
    queue = QueueAdmission(QueueTable(settings.initial_input_tps), settings.queue_policy, adapter)
    # A re-published model is a new generation: its throughput is measured afresh.
    lifecycle.models.on_retire(queue.table.retire)
    if metrics is not None:
        metrics.queue_snapshot = queue.table.snapshot
    tracer: ExchangeTracer | None = None
    if settings.otel_endpoint is not None or span_exporter is not None:
        from pylon.otel import OtelTracer

        tracer = OtelTracer.build(tracing_options(settings), pool.loop, observer, span_exporter)
    proxy = Proxy(
        planner=planner,
        router=router or SingleUpstream(UpstreamTarget.from_url(upstream)),
        pool=pool,
        observer=observer,
        relay=relay_limits(settings),
        retry=settings.retry_policy,
        tracer=tracer,
        queue=queue,
    )
    admission = ProxyAdmission(lifecycle, auth)
    limits = ingress_limits(settings)
    ingress = Ingress(
        proxy, admission, limits, lifecycle, BodyBudget(settings.max_total_body_bytes)
    )
    return Core(
        lifecycle,
        observer,
        admission,
        proxy,
        pool,
        limits,
        ingress,
        queue,
        tracer,
        metrics,
        tokenizer,
    )


async def _embedded_mock(settings: Settings, stack: AsyncExitStack, observer: Observer) -> str:
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
    observer.process_event(
        "embedded_mock_started",
        detail="no --upstream given: serving an embedded mock_dynamo engine",
        upstream=mock.base_url,
        flavor=_MOCK_FLAVOR[settings.backend],
        model=EMBEDDED_MOCK_MODEL,
    )
    return str(mock.base_url)


def _tls_identity(
    settings: Settings, stack: AsyncExitStack, observer: Observer
) -> TlsIdentity | None:
    """One hot-reloaded identity for every TLS listener (TCP with a certificate, and QUIC); it
    reports its loads and reloads to `observer` as process events."""
    if settings.tls_cert is None and settings.quic_listen is None:
        return None
    from pylon.tls import TlsIdentity

    identity = TlsIdentity.from_paths(
        settings.tls_cert, settings.tls_key, settings.tls_client_ca, observer.process_event
    )
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
    settings: Settings, core: Core, stack: AsyncExitStack, identity: TlsIdentity
) -> tuple[Http3Server, str]:
    """The HTTP/3 listener (direct tunnel mode), with its hot-reloaded TLS identity."""
    from pylon.server.http3 import Http3Server

    assert settings.quic_listen is not None
    h3 = Http3Server(core.ingress, identity, quic_options(settings))
    host, port = await h3.start(*split_host_port(settings.quic_listen))
    stack.callback(h3.close)
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    core.observer.process_event(
        "listening_quic", address=address, alpn="h3", retry=settings.quic_retry
    )
    return h3, address


async def _start_admin(
    settings: Settings, core: Core, stack: AsyncExitStack
) -> tuple[AdminServer | None, str | None]:
    """The admin listener (`--admin-listen`), unless it is disabled; a bind failure refuses
    the start (`StartupError`)."""
    if core.metrics is None:
        return None, None
    from pylon.admin import AdminRoutes, AdminServer

    admin = AdminServer(AdminRoutes(core.lifecycle, core.metrics.registry))
    address = await admin.start(settings.admin_listen)
    stack.callback(admin.close)
    return admin, address


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


def in_flight(live: LiveConnections, h3: Http3Server | None) -> dict[str, int]:
    """Requests still running, per transport: what the drain is waiting for."""
    counts = live.in_progress_by_transport()
    counts["h3"] = h3.in_progress if h3 is not None else 0
    return counts


async def drain_and_wait(
    core: Core, live: LiveConnections, h3: Http3Server | None, grace: float
) -> None:
    """Stop admitting work everywhere, then let requests in flight finish for up to `grace` s."""
    loop = asyncio.get_running_loop()
    core.lifecycle.drain()
    deadline = loop.time() + grace
    report_at = loop.time()  # what is still running: now, then once a second
    while loop.time() < deadline and (live.busy or (h3 is not None and h3.connections)):
        if loop.time() >= report_at:
            report_at += DRAIN_REPORT_INTERVAL
            remaining = round(max(0.0, deadline - loop.time()), 1)
            core.observer.process_event("draining", **in_flight(live, h3), remaining_s=remaining)
        await asyncio.sleep(0.02)
    core.observer.process_event(
        "drained", unfinished_tcp=live.busy, unfinished_quic=h3.connections if h3 else 0
    )


def tcp_protocol_factory(core: Core, live: LiveConnections) -> Callable[[], asyncio.Protocol]:
    """HTTP/1.1 and HTTP/2 share the TCP port: `ProtocolSwitch` picks one per connection."""

    def http1() -> asyncio.Protocol:
        return live.add(Http1Connection(core.ingress))

    def http2() -> asyncio.Protocol:
        return live.add(Http2Connection(core.ingress))

    return lambda: ProtocolSwitch(http1, http2, core.limits.stall_timeout, core.lifecycle)


@dataclass
class Running:
    """A started pylon: its listeners' addresses and parts, until its context exits."""

    core: Core
    address: str  # the TCP listener, host:port
    url: str
    upstream: str
    live: LiveConnections
    tcp_server: asyncio.AbstractServer
    h3: Http3Server | None = None
    quic_address: str | None = None
    # Bring-up (`pylon.bringup`): done when the engine passed its health gate and the first
    # model set is in (raises `EngineNotReady` when the gate ran out). The task that runs it
    # keeps running model discovery afterwards.
    ready: asyncio.Future[BringUp] | None = None
    engine: asyncio.Task[None] | None = None
    admin: AdminServer | None = None
    admin_address: str | None = None  # the admin listener, host:port; None when disabled
    # `--routing` other than off: the workers, their health checks and the router.
    routing: Routing | None = None

    @property
    def admin_url(self) -> str | None:
        return f"http://{self.admin_address}" if self.admin_address is not None else None

    async def shutdown(self, grace: float) -> None:
        """Graceful stop: no new connections or requests, in-flight ones get `grace` s."""
        self.tcp_server.close()
        await drain_and_wait(self.core, self.live, self.h3, grace)
        self.close_all()

    def close_all(self) -> None:
        """End every connection now; their requests are cancelled (outcome `shutdown`)."""
        self.live.close_all()
        if self.h3 is not None:
            self.h3.close_connections()


async def _close_tracer(tracer: ExchangeTracer) -> None:
    """Flush the spans not exported yet, off the event loop (the export may take a while)."""
    await asyncio.sleep(0)  # requests cancelled at close end their spans first
    await asyncio.to_thread(tracer.close)


async def _engine(
    settings: Settings,
    core: Core,
    upstream: str,
    ready: asyncio.Future[BringUp],
    routing: Routing | None = None,
) -> None:
    """Bring the engine up (health gate, first models), settle `ready`, then keep discovering.

    With `routing`, the gate is the workers' health checks (see `pylon.bringup`)."""
    try:
        result = await bring_up(
            bring_up_options(settings),
            UpstreamTarget.from_url(upstream) if routing is None else None,
            core.lifecycle,
            core.observer,
            workers=routing.checks if routing is not None else None,
            prepare=_token_data_proof(core, routing),
        )
    except asyncio.CancelledError:
        ready.cancel()
        raise
    except Exception as exc:  # EngineNotReady, or a bug: whoever waits for `ready` decides
        ready.set_exception(exc)
        return
    ready.set_result(result)
    if core.lifecycle.ready:  # not when a drain started meanwhile
        published = sorted(core.lifecycle.models.published)
        core.observer.process_event(
            "ready",
            upstream=upstream,
            health_path=result.health_path,
            models=published[:READY_LINE_MODELS],
            model_count=len(published),
            model_source="discovery" if result.discovery is not None else "static",
            **(
                {}
                if routing is None
                else {"routing": routing.mode, "workers_admitted": len(routing.fleet.admitted)}
            ),
        )
    if result.discovery is not None:
        await result.discovery.run()


def _token_data_proof(core: Core, routing: Routing | None) -> Callable[[], Awaitable[None]] | None:
    """With `--kv-token-data`: prove every model published at start (a mismatch refuses it)."""
    prover = routing.kv.token_data if routing is not None and routing.kv is not None else None
    if prover is None:
        return None

    async def prove() -> None:
        from pylon.routing.token_data import TokenDataMismatch

        try:
            await prover.prove_all(core.lifecycle.models.published)
        except TokenDataMismatch as exc:
            raise StartupError(
                f"--kv-token-data: pylon's rendering differs from the Dynamo frontend's: {exc}"
            ) from None

    return prove


@asynccontextmanager
async def start(
    settings: Settings,
    observer: Observer | None = None,
    router: Router | None = None,
    span_exporter: SpanExporter | None = None,
    *,
    wait_ready: bool = True,
    tokenizer: Tokenizer | None = None,
    routing: Routing | None = None,
) -> AsyncIterator[Running]:
    """Start every listener of `settings`, then bring the engine up; exiting the context
    closes everything at once.

    `span_exporter`: see `build_core`.
    `routing`: the routing parts already built (`pylon.routing.build.build_routing`, e.g. with
    a test's tokenizer or native core); by default they are built from `settings`. Either
    way `start` runs their health checks and closes them.
    `wait_ready`: enter the context only once bring-up passed (raises `EngineNotReady` when the
    engine never passed its health gate); False enters at once, with bring-up running (tunnel
    requests get `503 not_ready` until `running.ready` is done).
    `tokenizer`: `--tokenizer` already loaded (`preflight.load_tokenizer`); None loads it here.
    """
    loop = asyncio.get_running_loop()
    observer = observer or LogObserver()
    check_files(settings)  # StartupError before anything starts
    check_tracing(settings)
    if routing is None:  # prebuilt routing parts (tests) bring their own core and tokenizer
        check_routing(settings)
        if tokenizer is None:
            tokenizer = load_tokenizer(settings)
    for warning in [*config_warnings(settings), *tokenizer_warnings(tokenizer)]:
        observer.process_event(warning.event, **warning.fields)
    async with AsyncExitStack() as stack:
        if routing is None and settings.routing != "off" and router is None:
            routing = await build_routing(routing_options(settings), observer, tokenizer=tokenizer)
        if routing is not None:
            # Closed last: the requests cancelled at close release their bookings first.
            stack.push_async_callback(routing.aclose)
            router = routing.router
        if settings.upstream:
            upstream = str(settings.upstream)
        elif settings.routing != "off":
            upstream = ""  # url= workers only: each request goes to its worker's own URL
        else:
            upstream = await _embedded_mock(settings, stack, observer)
        core = build_core(
            settings,
            upstream,
            observer=observer,
            router=router,
            span_exporter=span_exporter,
            tokenizer=tokenizer,
        )
        if core.metrics is not None and routing is not None:
            core.metrics.routing_snapshot = routing.snapshot
        if core.tracer is not None:  # closed last, once every exchange has ended
            stack.push_async_callback(_close_tracer, core.tracer)
            observer.process_event(
                "tracing",
                endpoint=settings.otel_traces_url,
                service_name=settings.otel_service_name,
            )
        stack.callback(core.pool.close)
        # The admin listener first: /live and /ready answer (not ready yet) while the rest starts.
        admin, admin_address = await _start_admin(settings, core, stack)
        host, port = settings.listen_host_port
        identity = _tls_identity(settings, stack, core.observer)
        tls = settings.tls_cert is not None and identity is not None
        live = LiveConnections()
        server = await loop.create_server(
            tcp_protocol_factory(core, live),
            host,
            port,
            reuse_address=True,
            backlog=2048,
            ssl=tcp_ssl_context(identity) if tls and identity is not None else None,
        )
        stack.callback(server.close)
        bound = server.sockets[0].getsockname()
        address = f"{bound[0]}:{bound[1]}" if ":" not in bound[0] else f"[{bound[0]}]:{bound[1]}"
        running = Running(
            core, address, f"{'https' if tls else 'http'}://{address}", upstream, live, server
        )
        running.admin, running.admin_address = admin, admin_address
        running.routing = routing
        if settings.quic_listen is not None:
            assert identity is not None
            running.h3, running.quic_address = await _start_quic(settings, core, stack, identity)
        if admin_address is not None:  # said once every listener is up: a refusal stays alone
            observer.process_event(
                "listening_admin", address=admin_address, paths="/metrics,/live,/ready"
            )
        observer.process_event(
            "listening",
            address=address,
            url=running.url,
            upstream=upstream,
            backend=settings.backend,
            derive_priority=settings.derive_priority,
            routing=settings.routing,
            workers=[spec.label for spec in settings.worker] or None,
        )
        for warning in insecure_listeners(settings):
            observer.process_event(warning.event, **warning.fields)
        # Bring-up runs with the listeners up: requests that come meanwhile get `not_ready`.
        running.ready = ready = loop.create_future()
        if routing is not None:
            routing.start()  # the workers' health checks: bring-up's gate waits on them
        running.engine = engine = asyncio.create_task(
            _engine(settings, core, upstream, ready, routing)
        )
        stack.push_async_callback(_cancel, engine)
        if wait_ready:
            await asyncio.shield(ready)
        try:
            yield running
        finally:
            running.close_all()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def serve(
    settings: Settings,
    on_ready: Callable[[str], Any] | None = None,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
    on_quic_ready: Callable[[str], Any] | None = None,
    observer: Observer | None = None,
    force: asyncio.Event | None = None,
    tokenizer: Tokenizer | None = None,
) -> int:
    """Run pylon until `stop` is set or SIGINT/SIGTERM arrives, then stop gracefully.

    A second signal during the drain (or `force`) ends what still runs at once. Returns the
    exit status: 0 after a graceful stop, 128 + the signal's number after a forced one (1 when
    `force` was set without a signal).
    """
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    force = force or asyncio.Event()
    forced_by: list[signal.Signals] = []  # the signal that cut the drain short, if one did

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            forced_by.append(sig)
            force.set()
        else:
            stop.set()

    if handle_signals:  # before the listeners start: a signal during the start stops it too
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
    try:
        async with start(settings, observer, wait_ready=False, tokenizer=tokenizer) as running:
            assert running.ready is not None
            if not await _ready_unless_stopped(running.ready, stop):
                if not stop.is_set():  # the health gate ran out (logged): nothing was admitted
                    return EXIT_ENGINE_NOT_READY
            else:
                if on_quic_ready is not None and running.quic_address is not None:
                    on_quic_ready(running.quic_address)
                if on_ready is not None:
                    on_ready(running.address)
            await stop.wait()
            # Graceful stop: no new connections, no new requests (GOAWAY on HTTP/2 and HTTP/3,
            # idle HTTP/1.1 keep-alives closed), and requests in flight get the grace period.
            running.core.observer.process_event(
                "stopping", address=running.address, grace_s=settings.shutdown_grace
            )
            if await _drain_unless_forced(running, settings.shutdown_grace, force):
                return 0
            running.core.observer.process_event(
                "forced_stop",
                signal=forced_by[0].name if forced_by else None,
                **in_flight(running.live, running.h3),
            )
            running.close_all()
            return 128 + forced_by[0].value if forced_by else 1
    finally:
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


async def _ready_unless_stopped(ready: asyncio.Future[BringUp], stop: asyncio.Event) -> bool:
    """Wait for bring-up, or for `stop`; True when bring-up passed. A failure other than the
    health gate running out is a bug and is raised."""
    stopped = asyncio.ensure_future(stop.wait())
    waiting: set[asyncio.Future[Any]] = {ready, stopped}
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not ready.done():
        return False
    failure = ready.exception()
    if failure is None:
        return True
    if isinstance(failure, EngineNotReady):
        return False
    raise failure


async def _drain_unless_forced(running: Running, grace: float, force: asyncio.Event) -> bool:
    """The graceful drain, cut short by `force`; True when it ran to its end."""
    drain = asyncio.ensure_future(running.shutdown(grace))
    forced = asyncio.ensure_future(force.wait())
    try:
        await asyncio.wait({drain, forced}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        forced.cancel()
        if not drain.done():
            drain.cancel()
        await asyncio.gather(drain, forced, return_exceptions=True)
    if drain.cancelled():
        return False
    drain.result()  # a failure of the drain itself is a bug: let it surface
    return True

"""Running pylon: `start` (Settings in, listeners up, bring-up running, until its context exits)
and `serve` (`start` until SIGINT/SIGTERM/SIGQUIT or `stop`, then the graceful drain; SIGHUP
reloads, `Running.reload`; every signal: `pylon.signals`).

`start` reads as the order things happen: the refusals and warnings (`pylon.preflight`), the
routing parts, the engine (or an embedded mock), the shared parts (`pylon.assemble`), the
listeners (`pylon.listeners`), then bring-up (`pylon.bringup`) with the listeners already up.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pylon.assemble import Core, bring_up_options, build_core, gateway_options, routing_options
from pylon.auth import TokenFileError
from pylon.bringup import BringUp, BringUpOptions, EngineNotReady, EngineWatch, bring_up
from pylon.core.upstream import Upstream
from pylon.lifecycle import NOT_READY_NO_WORKER
from pylon.listeners import Inherited, Listeners, start_listeners
from pylon.observe import LogObserver, Observer, Observers
from pylon.preflight import (
    check_files,
    check_routing,
    check_tracing,
    config_warnings,
    insecure_listeners,
    load_tokenizer,
    registered_url,
    tokenizer_warnings,
)
from pylon.routing import Router
from pylon.routing.build import Routing, build_routing
from pylon.routing.catalogue import InstanceDiscovery
from pylon.settings import Settings
from pylon.signals import EarlySignals, Signals
from pylon.startup import StartupError
from pylon.tracing import ExchangeTracer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pylon.gateway.options import GatewayOptions
    from pylon.gateway.side import GatewaySide
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


@dataclass
class Running:
    """A started pylon: its parts and listeners, until its context exits."""

    core: Core
    upstream: str  # the engine's URL; "" when each request goes to its worker's own URL
    listeners: Listeners
    # Bring-up (`pylon.bringup`): done when the engine passed its health gate and the first
    # model set is in (raises `EngineNotReady` when the gate ran out). The task that runs it
    # keeps running model discovery afterwards.
    ready: asyncio.Future[BringUp]
    engine: asyncio.Task[None]
    # `--routing` other than off: the workers, their health checks and the router.
    routing: Routing | None = None
    # `--gateway` (or an explicit `--canary-interval`): registration, canaries, reverse tunnels.
    gateway: GatewaySide | None = None

    @property
    def address(self) -> str:
        """The TCP listener, host:port."""
        return self.listeners.address

    @property
    def url(self) -> str:
        return self.listeners.url

    @property
    def quic_address(self) -> str | None:
        return self.listeners.quic_address

    @property
    def admin_url(self) -> str | None:
        address = self.listeners.admin_address
        return f"http://{address}" if address is not None else None

    async def shutdown(self, grace: float) -> None:
        """Graceful stop: the gateways told first (every model INACTIVE, acked), then no new
        connections or requests, and in-flight ones (the reverse tunnels' too) get `grace` s."""
        if self.gateway is not None:
            await self.gateway.advertise_drain()
        self.listeners.tcp_server.close()
        draining = [drain_and_wait(self.core, self.listeners, grace)]
        if self.gateway is not None:
            draining.append(self.gateway.drain_tunnels(grace))
        await asyncio.gather(*draining)
        self.close_all()

    def close_all(self) -> None:
        """End every connection now; their requests are cancelled (outcome `shutdown`)."""
        self.listeners.close_all()

    def reload(self, sig: signal.Signals | None = None) -> dict[str, str]:
        """Re-read what can be re-read while serving (SIGHUP): the TLS identity's cert and key
        files (new handshakes get the new pair; established connections keep theirs), the
        tunnel token file and the workers file (`--workers-file`: `workers`, applied as
        `pylon.routing.catalogue` says). A part that fails keeps what it had in use. One line
        says what was re-read and what failed (`reloaded`, or `reload_failed` at error); returns the
        failures, part -> reason. Every other setting needs a restart."""
        fields: dict[str, Any] = {"signal": sig.name if sig is not None else None}
        reloaded: list[str] = []
        failed: dict[str, str] = {}
        identity = self.listeners.identity
        if identity is not None and identity.cert_path is not None:
            reason = identity.reload()
            if reason is None:
                reloaded.append("tls")
            else:
                failed["tls"] = reason
            fields["tls_sha256"] = identity.current.fingerprint
        auth = self.core.admission.auth
        if auth is not None:
            try:
                fields["tunnel_token"] = "rotated" if auth.reload() else "unchanged"
                reloaded.append("tunnel_token")
            except TokenFileError as exc:
                failed["tunnel_token"] = str(exc)
        catalogue = self.routing.catalogue if self.routing is not None else None
        if isinstance(catalogue, InstanceDiscovery):
            catalogue.wake()  # the read is a request to the frontend: its own line says more
            reloaded.append("workers")
            fields["workers"] = "rediscovering"
        elif catalogue is not None:
            result = catalogue.reload()
            if result.failed is not None:
                failed["workers"] = result.failed
            else:
                reloaded.append("workers")
                fields["workers"] = "changed" if result.change is not None else "unchanged"
            fields["catalogue_digest"] = catalogue.digest
        event = "reload_failed" if failed else "reloaded"
        detail = None
        if failed:
            detail = "kept what was in use for what failed"
        elif not reloaded:
            detail = (
                "nothing to re-read: no --tls-cert/--tls-key, no --tunnel-token-file, "
                "no --workers-file"
            )
        self.core.observer.process_event(
            event, **fields, reloaded=reloaded, failed=failed or None, detail=detail
        )
        return failed

    def report(self, sig: signal.Signals | None = None) -> None:
        """SIGUSR1/SIGUSR2: one `status_report` line, what runs now; nothing changes."""
        lifecycle = self.core.lifecycle
        self.core.observer.process_event(
            "status_report",
            signal=sig.name if sig is not None else None,
            phase=lifecycle.phase.value,
            models=len(lifecycle.models.published),
            **self.listeners.in_flight(),
        )


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
    inherited: Inherited | None = None,
) -> AsyncIterator[Running]:
    """Start every listener of `settings`, then bring the engine up; exiting the context
    closes everything at once.

    `span_exporter`: see `pylon.assemble.build_core`.
    `routing`: the routing parts already built (`pylon.routing.build.build_routing`, e.g. with
    a test's tokenizer or native core); by default they are built from `settings`. Either
    way `start` runs their health checks and closes them.
    `wait_ready`: enter the context only once bring-up passed (raises `EngineNotReady` when the
    engine never passed its health gate); False enters at once, with bring-up running (tunnel
    requests get `503 not_ready` until `running.ready` is done).
    `tokenizer`: `--tokenizer` already loaded (`pylon serve` loads it before logging starts);
    None loads it here. Either way it is loaded once, and handed down from here.
    `inherited`: a supervised process's sockets and identity (`pylon.supervisor`); its
    supervisor said the start's warnings once for the node, so they are not said here again.
    """
    observer = observer or LogObserver()
    tokenizer = _preflight(
        settings, observer, tokenizer, prebuilt=routing is not None, warn=inherited is None
    )
    gateway = gateway_options(settings)
    meter = None
    if gateway is not None:
        from pylon.gateway.model_stats import OutputMeter

        meter = OutputMeter()  # the registration's output tokens/s: it hears every exchange
        observer = Observers(observer, meter)
    async with AsyncExitStack() as stack:
        if routing is None and settings.routing != "off" and router is None:
            # A supervised process of a node with a booking authority books there.
            authority = inherited.booking_socket if inherited is not None else None
            routing = await build_routing(
                routing_options(settings), observer, tokenizer=tokenizer, authority=authority
            )
        if routing is not None:
            # Closed last: the requests cancelled at close release their bookings first.
            stack.push_async_callback(routing.aclose)
            router = routing.router
        upstream = await _upstream(settings, stack, observer)
        core = build_core(
            settings,
            upstream,
            observer=observer,
            router=router,
            span_exporter=span_exporter,
            tokenizer=tokenizer,
        )
        _close_with(stack, settings, core, routing, observer)
        _follow_readiness(core, routing)
        listeners = await start_listeners(settings, core, stack, inherited)
        if listeners.admin is not None and routing is not None:
            listeners.admin.routes.workers = routing.workers_report
        _announce(settings, listeners, upstream, observer, routing, warn=inherited is None)
        ready, engine = _start_bring_up(bring_up_options(settings), core, upstream, routing, stack)
        side = None
        if gateway is not None and meter is not None:
            side = await _start_gateway(
                gateway,
                core,
                meter,
                upstream,
                routing,
                ready,
                stack,
                registered_url(settings, listeners.quic_address),
            )
        running = Running(core, upstream, listeners, ready, engine, routing, side)
        if wait_ready:
            await asyncio.shield(ready)
        try:
            yield running
        finally:
            running.close_all()


async def _start_gateway(
    options: GatewayOptions,
    core: Core,
    meter: Any,
    upstream: str,
    routing: Routing | None,
    ready: asyncio.Future[BringUp],
    stack: AsyncExitStack,
    url: str,
) -> GatewaySide:
    """The gateway side, started once bring-up passed (no gateway hears of this node before
    its first models are ready, as the reference); closed at exit before the listeners."""
    from pylon.gateway.side import GatewaySide

    side = GatewaySide(
        options,
        core,
        meter,
        upstream=Upstream.from_url(upstream) if routing is None else None,
        routing=routing,
        observer=core.observer,
    )

    async def start_when_ready() -> None:
        try:
            await asyncio.shield(ready)
        except Exception:  # EngineNotReady: `serve` exits; nothing to register
            return
        if not core.lifecycle.draining:
            await side.start(url)

    starting = asyncio.create_task(start_when_ready())
    stack.push_async_callback(side.close)
    stack.push_async_callback(_cancel, starting)
    return side


def _preflight(
    settings: Settings,
    observer: Observer,
    tokenizer: Tokenizer | None,
    *,
    prebuilt: bool,
    warn: bool = True,
) -> Tokenizer | None:
    """Refuse what cannot work (`StartupError`) before anything starts, report what will not
    do what it says (unless not `warn`), and return the `--tokenizer` (loaded here unless it
    is given).

    `prebuilt`: the routing parts come built (tests), with their own core and tokenizer."""
    check_files(settings)
    check_tracing(settings)
    if not prebuilt:
        check_routing(settings)
        if tokenizer is None:
            tokenizer = load_tokenizer(settings)
    if warn:
        for warning in [*config_warnings(settings), *tokenizer_warnings(tokenizer)]:
            observer.process_event(warning.event, **warning.fields)
    return tokenizer


async def _upstream(settings: Settings, stack: AsyncExitStack, observer: Observer) -> str:
    """The engine's URL: `--upstream`; none with url= workers only (each request goes to its
    worker's own URL); else an embedded mock_dynamo, started here."""
    if settings.upstream:
        return str(settings.upstream)
    if settings.routing != "off":
        return ""
    return await _embedded_mock(settings, stack, observer)


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


def _close_with(
    stack: AsyncExitStack,
    settings: Settings,
    core: Core,
    routing: Routing | None,
    observer: Observer,
) -> None:
    """Hand the routing view to the metrics, and close the pool, then flush the tracer, at
    exit (after every listener)."""
    if core.metrics is not None and routing is not None:
        core.metrics.routing_snapshot = routing.snapshot
    if core.tracer is not None:  # closed last, once every exchange has ended
        stack.push_async_callback(_close_tracer, core.tracer)
        observer.process_event(
            "tracing", endpoint=settings.otel_traces_url, service_name=settings.otel_service_name
        )
    stack.callback(core.pool.close)


def _follow_readiness(core: Core, routing: Routing | None) -> None:
    """Readiness follows the fleet's in-rotation view (every ejection, whatever ejected the
    worker), and each change of it is reported (`readiness_changed`, the `pylon_ready` gauge)."""
    lifecycle = core.lifecycle
    observer = core.observer

    def changed(ready: bool, reason: str, detail: str | None) -> None:
        observer.process_event("readiness_changed", ready=ready, reason=reason, detail=detail)

    lifecycle.on_readiness(changed)
    if routing is None:
        return
    fleet = routing.fleet

    def rotation_changed() -> None:
        if fleet.in_rotation:
            lifecycle.set_engine(None)
        else:
            detail = f"no engine worker is in rotation ({fleet.describe_health()})"
            lifecycle.set_engine((NOT_READY_NO_WORKER, detail))

    fleet.on_change(rotation_changed)


async def _close_tracer(tracer: ExchangeTracer) -> None:
    """Flush the spans not exported yet, off the event loop (the export may take a while)."""
    await asyncio.sleep(0)  # requests cancelled at close end their spans first
    await asyncio.to_thread(tracer.close)


def _announce(
    settings: Settings,
    listeners: Listeners,
    upstream: str,
    observer: Observer,
    routing: Routing | None,
    *,
    warn: bool,
) -> None:
    """Said once every listener is up, so that a refusal stays alone on its line."""
    if listeners.admin_address is not None:
        paths = "/metrics,/live,/ready" + (",/workers" if settings.routing != "off" else "")
        observer.process_event("listening_admin", address=listeners.admin_address, paths=paths)
    observer.process_event(
        "listening",
        address=listeners.address,
        url=listeners.url,
        upstream=upstream,
        backend=settings.backend,
        derive_priority=settings.derive_priority,
        routing=settings.routing,
        http2_codec=listeners.http2_codec,
        **({"http2_codec_fallback": listeners.http2_fallback} if listeners.http2_fallback else {}),
        workers=[w.label for w in routing.fleet.workers] if routing is not None else None,
        **(
            {"catalogue_digest": routing.fleet.digest, "catalogue": routing.catalogue_source}
            if routing is not None
            else {}
        ),
    )
    if warn:
        for warning in insecure_listeners(settings):
            observer.process_event(warning.event, **warning.fields)


def _start_bring_up(
    options: BringUpOptions,
    core: Core,
    upstream: str,
    routing: Routing | None,
    stack: AsyncExitStack,
) -> tuple[asyncio.Future[BringUp], asyncio.Task[None]]:
    """Bring-up runs with the listeners up: requests that come meanwhile get `not_ready`.
    Returns its outcome (`ready`) and the task that runs it, then model discovery."""
    ready: asyncio.Future[BringUp] = asyncio.get_running_loop().create_future()
    if routing is not None:
        routing.start()  # the workers' health checks: bring-up's gate waits on them
    engine = asyncio.create_task(_engine(options, core, upstream, ready, routing))
    stack.push_async_callback(_cancel, engine)
    return ready, engine


async def _engine(
    options: BringUpOptions,
    core: Core,
    upstream: str,
    ready: asyncio.Future[BringUp],
    routing: Routing | None = None,
) -> None:
    """Bring the engine up (health gate, first models), settle `ready`, then keep discovering.

    With `routing`, the gate is the workers' health checks (see `pylon.bringup`)."""
    try:
        result = await bring_up(
            options,
            Upstream.from_url(upstream) if routing is None else None,
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
        _report_ready(core, upstream, result, routing)
    loops = []
    if routing is None and result.health_path is not None:
        loops.append(_engine_watch(options, core, upstream, result.health_path).run())
    if result.discovery is not None:
        loops.append(result.discovery.run())
    await asyncio.gather(*loops)


def _engine_watch(options: BringUpOptions, core: Core, upstream: str, path: str) -> EngineWatch:
    """`--routing off`: the engine's health after start-up, which readiness follows."""
    return EngineWatch(
        Upstream.from_url(upstream),
        path,
        core.lifecycle,
        interval=options.health_check_interval,
        timeout=options.health_timeout,
        observer=core.observer,
    )


def _report_ready(core: Core, upstream: str, result: BringUp, routing: Routing | None) -> None:
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
            else {"routing": routing.mode, "workers_in_rotation": len(routing.fleet.in_rotation)}
        ),
    )


def _token_data_proof(core: Core, routing: Routing | None) -> Callable[[], Awaitable[None]] | None:
    """With `--kv-token-data`: prove every model published at start (a mismatch refuses it)."""
    prover = routing.token_data if routing is not None else None
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


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


# --- serve: start, until a signal; then the drain ----------------------------------------------


async def serve(
    settings: Settings,
    on_ready: Callable[[str], Any] | None = None,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
    on_quic_ready: Callable[[str], Any] | None = None,
    observer: Observer | None = None,
    force: asyncio.Event | None = None,
    tokenizer: Tokenizer | None = None,
    early: EarlySignals | None = None,
    inherited: Inherited | None = None,
) -> int:
    """Run pylon until `stop` is set or SIGINT/SIGTERM/SIGQUIT arrives, then stop gracefully
    (what every other signal does: `pylon.signals`).

    A second signal during the drain (or `force`) ends what still runs at once. Returns the
    exit status: 0 after a graceful stop, 128 + the signal's number after a forced one (1 when
    `force` was set without a signal). `early`: the signals held since the command started,
    acted on once the loop's handlers are in (`pylon.signals.EarlySignals`). `inherited`: a
    supervised process's sockets (`pylon.supervisor`).
    """
    observer = observer or LogObserver()
    signals = Signals(stop or asyncio.Event(), force or asyncio.Event(), observer.process_event)
    # Handled before the listeners start: a signal during the start stops it too.
    with signals.handled(early) if handle_signals else nullcontext():
        async with start(
            settings, observer, wait_ready=False, tokenizer=tokenizer, inherited=inherited
        ) as running:
            signals.on_reload = running.reload
            signals.on_report = running.report
            if await _ready_unless_stopped(running.ready, signals.stop):
                if on_quic_ready is not None and running.quic_address is not None:
                    on_quic_ready(running.quic_address)
                if on_ready is not None:
                    on_ready(running.address)
            elif not signals.stop.is_set():  # the health gate ran out (logged): none in rotation
                return EXIT_ENGINE_NOT_READY
            await signals.stop.wait()
            return await _stop(running, settings.shutdown_grace, signals)


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


async def _stop(running: Running, grace: float, signals: Signals) -> int:
    """Graceful stop: no new connections, no new requests (GOAWAY on HTTP/2 and HTTP/3, idle
    HTTP/1.1 keep-alives closed), and requests in flight get `grace` s, unless a second
    signal (or `force`) ends them first. Returns the exit status."""
    observer = running.core.observer
    observer.process_event("stopping", address=running.address, grace_s=grace)
    if await _drain_unless_forced(running, grace, signals.force):
        return 0
    forced_by = signals.forced_by
    observer.process_event(
        "forced_stop",
        signal=forced_by.name if forced_by is not None else None,
        **running.listeners.in_flight(),
    )
    running.close_all()
    return 128 + forced_by.value if forced_by is not None else 1


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


async def drain_and_wait(core: Core, listeners: Listeners, grace: float) -> None:
    """Stop admitting work everywhere, then let requests in flight finish for up to `grace` s."""
    loop = asyncio.get_running_loop()
    core.lifecycle.drain()
    deadline = loop.time() + grace
    report_at = loop.time()  # what is still running: now, then once a second
    while loop.time() < deadline and listeners.busy:
        if loop.time() >= report_at:
            report_at += DRAIN_REPORT_INTERVAL
            remaining = round(max(0.0, deadline - loop.time()), 1)
            core.observer.process_event("draining", **listeners.in_flight(), remaining_s=remaining)
        await asyncio.sleep(0.02)
    core.observer.process_event("drained", **listeners.unfinished())

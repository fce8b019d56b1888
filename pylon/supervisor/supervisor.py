"""The supervisor of `pylon serve --processes N`: what is done once for the node, then N
pylon processes kept running until a stop signal drains them all.

`supervise` is the whole life: a private runtime directory (0700, removed at exit), the
node's self-signed certificate and QUIC stateless-reset key, the sockets
(`pylon.supervisor.sockets`), the admin listener (`pylon.supervisor.admin`), then
`Supervisor.run`.

With `--routing` on, one more process runs beside the N: the node's booking authority (role
"router", `pylon.routing.authority`), its socket in the runtime directory, named in every
serving process's handover. It is started first and kept like the others (the same backoff;
its lines and metrics say `process="router"`), hears SIGHUP (it owns the workers file), and is
stopped last, once the serving processes drained, so their last bookings are still exact. The
serving processes do not wait for it: until it answers they book alone
(`pylon.routing.remote`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pylon.listeners import host_port, publish_self_signed
from pylon.preflight import StartupWarning, config_warnings, insecure_listeners
from pylon.settings import Settings, split_host_port
from pylon.signals import EarlySignals, Signals
from pylon.startup import StartupError
from pylon.supervisor.admin import NodeAdmin, ProcessView
from pylon.supervisor.backoff import EXIT_START_REFUSED, Backoff, halt_status
from pylon.supervisor.handover import (
    READY_MESSAGE,
    Handover,
    Role,
    child_command,
    settings_values,
)
from pylon.supervisor.metrics import RESTART_REASONS, ROUTER_RESTART_REASONS, SupervisorCounts
from pylon.supervisor.sockets import NodeSockets, bind_node

if TYPE_CHECKING:
    from pylon.observe import Observer

STOP_MARGIN = 5.0  # seconds past --shutdown-grace a process gets to exit before SIGKILL
FORCED_WAIT = 5.0  # seconds a forced process gets to exit before SIGKILL
RESET_KEY_BYTES = 32
# A Unix socket's path must fit `sun_path` (108 bytes on Linux, the NUL included).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class Node:
    """What the supervisor did once for the node, handed to every process."""

    runtime: Path  # the private runtime directory
    sockets: NodeSockets
    tls_pair: tuple[Path, Path] | None  # the self-signed cert and key every process presents
    reset_key: bytes | None  # the QUIC stateless-reset key every process uses


@dataclass
class Slot:
    """One process slot: its index, the process in it now, and its restart history."""

    index: int
    admin_socket: str | None
    role: Role = "pylon"
    process: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    ever_ready: bool = False  # a process in this slot passed bring-up once
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def name(self) -> int | str:
        """What its lines and metrics call it: its index, or "router"."""
        return "router" if self.role == "router" else self.index


@contextmanager
def runtime_directory() -> Iterator[Path]:
    """A directory only this user can enter (mkdtemp: 0700), removed at exit: the handovers,
    the self-signed key and the processes' admin sockets live there."""
    path = Path(tempfile.mkdtemp(prefix="pylon-node-"))
    try:
        longest = path / "admin-99.sock"
        if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
            raise StartupError(
                f"--processes: the runtime directory {path} is too deep for the processes' "
                "admin sockets (a Unix socket path fits 107 bytes): set TMPDIR shorter"
            )
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def supervise(
    settings: Settings,
    observer: Observer,
    early: EarlySignals | None = None,
    warnings: Sequence[StartupWarning] = (),
) -> int:
    """Run the node until a stop signal (or a halt); returns the exit status. The settings
    were validated and the refusals checked (`pylon.cli.serve`) before this; the start's
    warnings (`warnings`, the tokenizer's, and the settings' own) are said here, once for the
    node (its processes do not say them again)."""
    for warning in [*config_warnings(settings), *warnings, *insecure_listeners(settings)]:
        observer.process_event(warning.event, **warning.fields)
    with runtime_directory() as runtime:
        node = prepare_node(settings, runtime, observer)
        try:
            return asyncio.run(Supervisor(settings, node, observer).run(early))
        finally:
            node.sockets.close()


def prepare_node(settings: Settings, runtime: Path, observer: Observer) -> Node:
    """Once for the node: the self-signed pair (with --quic-listen and no --tls-cert; written
    to --tls-self-signed-cert-file and said once), the reset key, the sockets."""
    tls_pair = None
    if settings.quic_listen is not None and settings.tls_cert is None:
        tls_pair = _self_signed_pair(settings, runtime, observer)
    reset_key = os.urandom(RESET_KEY_BYTES) if settings.quic_listen is not None else None
    quic = split_host_port(settings.quic_listen) if settings.quic_listen is not None else None
    sockets = bind_node(settings.listen_host_port, quic, settings.processes)
    return Node(runtime, sockets, tls_pair, reset_key)


def _self_signed_pair(settings: Settings, runtime: Path, observer: Observer) -> tuple[Path, Path]:
    from pylon.tls import TlsIdentity

    identity = TlsIdentity.from_paths(None, None, settings.tls_client_ca, observer.process_event)
    publish_self_signed(identity, settings.tls_self_signed_cert_file, observer)
    cert, key = runtime / "self-signed-cert.pem", runtime / "self-signed-key.pem"
    for path, data in ((cert, identity.current.cert_pem), (key, identity.current.key_pem)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    return cert, key


class Supervisor:
    """N process slots: each started, restarted with backoff when its process exits, and
    stopped with the node."""

    def __init__(self, settings: Settings, node: Node, observer: Observer) -> None:
        self._settings = settings
        self._values = settings_values(settings)
        self._node = node
        self._observer = observer
        self._say = observer.process_event
        admin = bool(settings.admin_listen)
        self.slots = [
            Slot(i, str(node.runtime / f"admin-{i}.sock") if admin else None)
            for i in range(settings.processes)
        ]
        # The node's booking authority: with --routing on (a single pylon books alone).
        self.router: Slot | None = None
        self.booking_socket: Path | None = None
        if settings.routing != "off":
            router_admin = str(node.runtime / "admin-router.sock") if admin else None
            self.router = Slot(settings.processes, router_admin, role="router")
            self.booking_socket = node.runtime / "booking.sock"
        reasons = RESTART_REASONS + (ROUTER_RESTART_REASONS if self.router else ())
        self.restarts = dict.fromkeys(reasons, 0)
        self._stopping = asyncio.Event()
        self._halted: int | None = None
        self._halt = asyncio.Event()

    # --- the node's life ---
    async def run(self, early: EarlySignals | None = None) -> int:
        signals = Signals(asyncio.Event(), asyncio.Event(), self._say)
        with signals.handled(early):
            signals.on_reload = self._reload
            signals.on_report = self._report
            admin = await self._start_admin()
            try:
                # The router first: its socket is up soonest for the processes' first bookings.
                router = asyncio.create_task(self._keep(self.router)) if self.router else None
                keepers = [asyncio.create_task(self._keep(slot)) for slot in self.slots]
                self._announce(admin)
                await _first(signals.stop.wait(), self._halt.wait())
                status = await self._stop_all(signals, keepers, router)
            finally:
                if admin is not None:
                    await admin.close()
        return status

    async def _start_admin(self) -> NodeAdmin | None:
        if not self._settings.admin_listen:
            return None
        admin = NodeAdmin(self._views, self.counts)
        await admin.start(self._settings.admin_listen)
        return admin

    def _announce(self, admin: NodeAdmin | None) -> None:
        sockets = self._node.sockets
        self._say(
            "supervisor_started",
            processes=len(self.slots),
            router=str(self.booking_socket) if self.booking_socket else None,
            address=host_port(sockets.tcp_host, sockets.tcp_port),
            quic_port=sockets.quic_port,
            admin=admin.address if admin is not None else None,
            pid=os.getpid(),
            runtime=str(self._node.runtime),
        )

    # --- one slot ---
    async def _keep(self, slot: Slot) -> None:
        """Start the slot's process, and again each time it exits, until the node stops."""
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            try:
                process, control = await self._spawn(slot)
            except (StartupError, OSError) as exc:  # the port is gone, the runtime dir, ...
                self._say("process_start_failed", process=slot.name, reason=str(exc))
                self._halt_node(slot, None, EXIT_START_REFUSED)
                return
            reader = asyncio.create_task(self._read_control(slot, control))
            status = await process.wait()
            reader.cancel()
            control.close()
            uptime = loop.time() - slot.started_at
            if self._stopping.is_set():
                self._exited("process_stopped", slot, process.pid, status, uptime, None)
                return
            halt = halt_status(status, ever_ready=slot.ever_ready)
            if slot.role == "router" and halt != EXIT_START_REFUSED:
                halt = None  # it has no engine to wait for: anything but a refusal restarts
            if halt is not None:
                self._exited("process_exited", slot, process.pid, status, uptime, None)
                self._halt_node(slot, status, halt)
                return
            delay = slot.backoff.after_exit(uptime)
            reason = "signal" if status < 0 else "exit"
            self.restarts[f"router_{reason}" if slot.role == "router" else reason] += 1
            slot.restarts += 1
            self._exited("process_exited", slot, process.pid, status, uptime, delay)
            await _first(asyncio.sleep(delay), self._stopping.wait())

    async def _spawn(self, slot: Slot) -> tuple[asyncio.subprocess.Process, socket.socket]:
        """Start the slot's process with a fresh TCP socket, the slot's UDP socket and a new
        control socket (its end closed here once the process holds it). The router gets the
        control socket only."""
        tcp = self._node.sockets.tcp_for_start() if slot.role == "pylon" else None
        mine, theirs = socket.socketpair()
        try:
            process = await self._exec(slot, tcp, theirs)
        except BaseException:
            mine.close()
            raise
        finally:
            if tcp is not None:
                tcp.close()
            theirs.close()
        slot.process = process
        slot.started_at = asyncio.get_running_loop().time()
        if self._stopping.is_set():  # the stop came while it started: it drains at once
            process.send_signal(signal.SIGTERM)
        self._say("process_started", process=slot.name, pid=process.pid, restarts=slot.restarts)
        return process, mine

    async def _exec(
        self, slot: Slot, tcp: socket.socket | None, control: socket.socket
    ) -> asyncio.subprocess.Process:
        """Write the slot's handover and start its process with `tcp`, the slot's UDP socket
        and `control`."""
        node = self._node
        udp = node.sockets.udp[slot.index] if node.sockets.udp and tcp is not None else None
        if slot.admin_socket is not None:
            Path(slot.admin_socket).unlink(missing_ok=True)
        handover = Handover(
            settings=self._values,
            process=slot.index,
            processes=len(self.slots),
            tcp_fd=tcp.fileno() if tcp is not None else None,
            udp_fd=udp.fileno() if udp is not None else None,
            control_fd=control.fileno(),
            admin_socket=slot.admin_socket,
            tls_cert=str(node.tls_pair[0]) if node.tls_pair else None,
            tls_key=str(node.tls_pair[1]) if node.tls_pair else None,
            reset_key=node.reset_key.hex() if node.reset_key else None,
            booking_socket=str(self.booking_socket) if self.booking_socket else None,
        )
        path = node.runtime / f"process-{slot.name}.json"
        handover.write(path)
        fds = [control.fileno(), *(s.fileno() for s in (tcp, udp) if s is not None)]
        return await asyncio.create_subprocess_exec(
            *child_command(slot.role, path),
            pass_fds=fds,
            stdin=asyncio.subprocess.DEVNULL,
            # Its own process group: a terminal's Ctrl-C reaches the supervisor only, which
            # forwards one stop (a second would force the process's drain).
            process_group=0,
        )

    async def _read_control(self, slot: Slot, control: socket.socket) -> None:
        """The process's bring-up passing (`ready`): from then on, the slot has been ready."""
        control.setblocking(False)
        loop = asyncio.get_running_loop()
        received = b""
        while len(received) < 1024:
            chunk = await loop.sock_recv(control, 64)
            if not chunk:
                return
            received += chunk
            if READY_MESSAGE in received:
                slot.ever_ready = True
                return

    def _halt_node(self, slot: Slot, status: int | None, halt: int) -> None:
        self._halted = halt
        reason = "start_refused" if halt == EXIT_START_REFUSED else "engine_not_ready"
        self._say(
            "supervisor_halted",
            process=slot.name,
            exit_code=status,
            reason=reason,
            detail="a process could not start, and another start would fail the same way: "
            "the node stops",
        )
        self._halt.set()

    def _exited(
        self,
        kind: str,
        slot: Slot,
        pid: int,
        status: int,
        uptime: float,
        restart_in: float | None,
    ) -> None:
        """`process_exited` (unasked: restarted after `restart_in` s, unless the node halts)
        or `process_stopped` (in the node's stop), with the exit code or the signal."""
        fields: dict[str, object] = {"process": slot.name, "pid": pid}
        if status < 0:
            fields["signal"] = _signal_name(-status)
        else:
            fields["exit_code"] = status
        self._say(
            kind,
            **fields,
            uptime_s=round(uptime, 3),
            restart_in_s=restart_in,
            restarts=slot.restarts,
        )

    # --- signals ---
    def _reload(self, sig: signal.Signals) -> None:
        """SIGHUP: every process re-reads what it can (`pylon.run.Running.reload`); the router
        re-reads the workers file (the serving processes follow its catalogue)."""
        self._say("reload_forwarded", signal=sig.name, processes=self._signal_all(sig))

    def _report(self, sig: signal.Signals) -> None:
        """SIGUSR1/2: the supervisor's `status_report`, then each process's own."""
        self._say(
            "status_report",
            signal=sig.name,
            role="supervisor",
            processes=len(self.slots),
            up=sum(slot.running for slot in self.slots),
            pids=[
                slot.process.pid if slot.running and slot.process else None for slot in self.slots
            ],
            router=self.router.process.pid
            if self.router and self.router.running and self.router.process
            else None,
            restarts=self.restarts,
        )
        self._signal_all(sig)

    def _signal_all(self, sig: signal.Signals, *, router: bool = True) -> list[int | str]:
        sent: list[int | str] = []
        for slot in [*self.slots, *([self.router] if router and self.router else [])]:
            if slot.running and slot.process is not None:
                try:
                    slot.process.send_signal(sig)
                except ProcessLookupError:
                    continue
                sent.append(slot.name)
        return sent

    async def _stop_all(
        self,
        signals: Signals,
        keepers: list[asyncio.Task[None]],
        router: asyncio.Task[None] | None = None,
    ) -> int:
        """Every process gets SIGTERM (its graceful drain: --shutdown-grace) and then
        `STOP_MARGIN` to exit; a second signal here is forwarded (it forces their drains,
        which then get `FORCED_WAIT`); what still runs then is killed. The router is stopped
        once the serving processes are gone (their drains still book through it). Returns
        the exit status: 0 when every process exited 0 (drained)."""
        self._stopping.set()
        grace = self._settings.shutdown_grace
        self._say("stopping", role="supervisor", processes=len(self.slots), grace_s=grace)
        self._signal_all(signal.SIGTERM, router=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace + STOP_MARGIN
        pending: set[asyncio.Future[None]] = {task for task in keepers if not task.done()}
        forced: asyncio.Future[Any] | None = asyncio.ensure_future(signals.force.wait())
        try:
            while pending and (remaining := deadline - loop.time()) > 0:
                waits: set[asyncio.Future[Any]] = {*pending, *([forced] if forced else [])}
                done, _ = await asyncio.wait(
                    waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= done
                if forced is not None and forced in done:
                    forced = None
                    self._signal_all(signals.forced_by or signal.SIGTERM)
                    deadline = min(deadline, loop.time() + FORCED_WAIT)
        finally:
            if forced is not None:
                forced.cancel()
        if router is not None:
            await self._stop_router(router, deadline)
        killed = self._kill_rest()
        await asyncio.gather(*keepers, *([router] if router else []), return_exceptions=True)
        return self._exit_status(signals, killed)

    async def _stop_router(self, router: asyncio.Task[None], deadline: float) -> None:
        """The router's stop: SIGTERM, then until the node's deadline (at least
        `FORCED_WAIT`) to close its socket."""
        if self.router is None or not self.router.running or self.router.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.router.process.send_signal(signal.SIGTERM)
        remaining = max(deadline - asyncio.get_running_loop().time(), FORCED_WAIT)
        await asyncio.wait([router], timeout=remaining)

    def _kill_rest(self) -> list[int | str]:
        killed: list[int | str] = []
        for slot in [*self.slots, *([self.router] if self.router else [])]:
            if slot.running and slot.process is not None:
                slot.process.kill()
                killed.append(slot.name)
        if killed:
            self._say("processes_killed", processes=killed, detail="still running after the stop")
        return killed

    def _exit_status(self, signals: Signals, killed: list[int | str]) -> int:
        codes = [slot.process.returncode if slot.process else None for slot in self.slots]
        self._say("stopped", role="supervisor", exit_codes=codes, killed=killed or None)
        if self._halted is not None:
            return self._halted
        if signals.forced_by is not None:
            return 128 + signals.forced_by.value
        # A slot whose process never started (the stop came first) has nothing to drain.
        return 0 if not killed and all(code in (0, None) for code in codes) else 1

    # --- what the admin reads ---
    def _views(self) -> list[ProcessView]:
        slots = [*self.slots, *([self.router] if self.router else [])]
        return [ProcessView(slot.name, slot.running, slot.admin_socket) for slot in slots]

    def counts(self, scraped: Sequence[bool] = ()) -> SupervisorCounts:
        return SupervisorCounts(
            configured=len(self.slots),
            up=[slot.running for slot in self.slots],
            restarts=dict(self.restarts),
            scraped=scraped[: len(self.slots)],
            router=self.router.running if self.router else None,
        )


async def _first(*waits: Coroutine[Any, Any, Any]) -> None:
    """Wait until the first of `waits` is done; cancel the rest."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)

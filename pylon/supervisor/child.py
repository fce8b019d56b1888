"""One supervised process: `python -m pylon.supervisor.child --role pylon HANDOVER`
(`pylon.supervisor.handover.child_command`).

Role "pylon" serves: the supervisor's settings rebuilt from the handover, every log line with
`process` (its index), the inherited sockets adopted (`pylon.listeners.Inherited`), then
`pylon.run.serve` as `pylon serve` runs it, with its signals. Bring-up passing is told to the
supervisor on the control socket (`ready`).

The supervisor's death: the control socket's EOF starts the graceful drain (`supervisor_gone`).
A socket rather than PR_SET_PDEATHSIG: the death signal follows the *thread* that forked, is
Linux-only, and is lost if the supervisor died before the child asked for it; an EOF cannot be
missed (the kernel closes the supervisor's end whenever and however it dies) and costs one
reader on the event loop.

Role "router" runs the node's booking authority (`pylon.routing.authority.run_authority`) on
the socket its handover names, with its admin (the routing figures, for the node's scrape) on
its admin socket; every log line says `process="router"`.

Exit status as `pylon serve`'s: 0 after a graceful stop, 1 when the engine never passed its
health gate, 2 when the start is refused (`StartupError`, one line), 128 + n when forced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from pylon.listeners import Inherited
from pylon.signals import EarlySignals
from pylon.startup import StartupError
from pylon.supervisor.backoff import EXIT_START_REFUSED
from pylon.supervisor.handover import READY_MESSAGE, Handover


def main(argv: list[str] | None = None) -> int:
    early = EarlySignals()  # first: no signal may end the process silently while it starts
    early.install()
    parser = argparse.ArgumentParser(prog="pylon.supervisor.child")
    parser.add_argument("--role", choices=("pylon", "router"), default="pylon")
    parser.add_argument("handover", type=Path)
    args = parser.parse_args(argv)
    handover = Handover.read(args.handover)
    if args.role == "router":
        return _serve_authority(handover, early, args.handover.parent)
    return _serve_process(handover, early, args.handover.parent)


def _serve_authority(handover: Handover, early: EarlySignals, runtime: Path) -> int:
    """Role "router": the node's booking authority on `handover.booking_socket`
    (`pylon.routing.authority.run_authority`), until a stop signal or the supervisor's death.
    Its socket listening is its bring-up (`ready` to the supervisor); SIGHUP re-reads the
    workers file (`BookingAuthority.reload`); its admin (`pylon.supervisor.router_admin`, on
    `handover.admin_socket`) serves its routing figures for the node's scrape."""
    from pylon.assemble import routing_options
    from pylon.logs import configure_logging, flush_logs
    from pylon.observe import LogObserver
    from pylon.routing.authority import BookingAuthority, run_authority
    from pylon.signals import REPORT, STOP
    from pylon.supervisor.router_admin import RouterAdmin

    settings = handover.rebuild_settings()
    configure_logging(settings.log_format, settings.log_level, process="router")
    observer = LogObserver()
    booking_socket = handover.booking_socket
    assert booking_socket is not None, "a router is started with its socket's path"

    async def run() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in STOP:
            loop.add_signal_handler(sig, stop.set)
        control = socket.socket(fileno=handover.control_fd)
        control.setblocking(False)
        admin = RouterAdmin()

        def report(sig: signal.Signals) -> None:
            """SIGUSR1/2: one `status_report` line, as each serving process says its own."""
            fleet = admin.authority.fleet if admin.authority is not None else None
            observer.process_event(
                "status_report",
                signal=sig.name,
                role="router",
                clients=admin.authority.clients if admin.authority is not None else 0,
                workers=len(fleet.workers) if fleet is not None else 0,
                workers_in_rotation=len(fleet.in_rotation) if fleet is not None else 0,
            )

        def started(authority: BookingAuthority) -> None:
            loop.add_signal_handler(signal.SIGHUP, authority.reload, signal.SIGHUP)
            for sig in REPORT:
                loop.add_signal_handler(sig, report, sig)
            admin.authority = authority
            with contextlib.suppress(OSError):
                control.send(READY_MESSAGE)

        early_signals = early.take()
        if any(sig in STOP for sig in early_signals):
            stop.set()  # a stop before the loop's handlers: the authority stops at once
        _watch_supervisor(loop, control, stop, observer, runtime)
        if handover.admin_socket is not None:
            await admin.start(handover.admin_socket)
        try:
            await run_authority(
                routing_options(settings),
                Path(booking_socket),
                observer,
                stop,
                started=started,
            )
        finally:
            await admin.close()
        return 0

    try:
        return asyncio.run(run())
    except StartupError as exc:
        return _refused(handover, str(exc), "router")
    finally:
        flush_logs()


def _serve_process(handover: Handover, early: EarlySignals, runtime: Path) -> int:
    from pylon.logs import configure_logging, flush_logs
    from pylon.observe import LogObserver

    settings = handover.rebuild_settings()
    configure_logging(settings.log_format, settings.log_level, process=handover.process)
    observer = LogObserver()
    native = None
    if settings.routing == "kv":
        from pylon.native_logs import NativeStderr

        native = NativeStderr()
        native.start()
    import uvloop

    try:
        return uvloop.run(_serving(settings, handover, observer, native, early, runtime))
    except StartupError as exc:
        return _refused(handover, str(exc))
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename is not None else ""
        return _refused(handover, f"cannot start: {exc.strerror or exc}{where}")
    finally:
        if native is not None:
            native.stop()
        flush_logs()


def _refused(handover: Handover, reason: str, name: int | str | None = None) -> int:
    name = handover.process if name is None else name
    print(f"pylon: process {name}: {reason}", file=sys.stderr, flush=True)
    return EXIT_START_REFUSED


def inherited(handover: Handover) -> Inherited:
    """The sockets and identity named in the handover, adopted."""
    assert handover.tcp_fd is not None
    tls_pair = None
    if handover.tls_cert is not None and handover.tls_key is not None:
        tls_pair = (Path(handover.tls_cert), Path(handover.tls_key))
    return Inherited(
        tcp=socket.socket(fileno=handover.tcp_fd),
        udp=socket.socket(fileno=handover.udp_fd) if handover.udp_fd is not None else None,
        admin_socket=handover.admin_socket,
        tls_pair=tls_pair,
        reset_key=bytes.fromhex(handover.reset_key) if handover.reset_key else None,
        booking_socket=Path(handover.booking_socket) if handover.booking_socket else None,
    )


async def _serving(
    settings: Any,
    handover: Handover,
    observer: Any,
    native: Any,
    early: EarlySignals,
    runtime: Path,
) -> int:
    from pylon.run import serve

    loop = asyncio.get_running_loop()
    if native is not None:
        native.attach(loop)
    stop = asyncio.Event()
    control = socket.socket(fileno=handover.control_fd)
    control.setblocking(False)
    _watch_supervisor(loop, control, stop, observer, runtime)

    def ready(_address: str) -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: the watcher stops this
            control.send(READY_MESSAGE)

    try:
        return await serve(
            settings,
            on_ready=ready,
            stop=stop,
            observer=observer,
            early=early,
            inherited=inherited(handover),
        )
    finally:
        loop.remove_reader(control.fileno())
        control.close()


def _watch_supervisor(
    loop: asyncio.AbstractEventLoop,
    control: socket.socket,
    stop: asyncio.Event,
    observer: Any,
    runtime: Path,
) -> None:
    """The control socket's EOF (the supervisor died): the graceful drain. The supervisor
    could not remove its runtime directory (it holds the self-signed key): removed here."""

    def readable() -> None:
        try:
            data = control.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            return  # nothing is sent this way yet
        loop.remove_reader(control.fileno())
        if not stop.is_set():
            observer.process_event(
                "supervisor_gone", detail="the supervisor exited: draining, then exiting"
            )
            shutil.rmtree(runtime, ignore_errors=True)
            stop.set()

    loop.add_reader(control.fileno(), readable)


if __name__ == "__main__":
    sys.exit(main())

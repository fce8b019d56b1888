"""The booking authority: one process owns the routing decision for every pylon process of a node.

`run_authority` builds the routing parts exactly as a single pylon does (`build_routing`: the
fleet, its health checks, passive health, for `kv` the selection core and the KV-event watch)
and serves them on a Unix socket to the node's serving processes (`pylon.routing.remote`), one
connection each. The frames are `pylon.routing.booking_wire`'s.

Exactness: every frame is handled, to the end, inside the loop's read callback of its
connection, one at a time in the order the loop reads them: a `BOOK` is chosen and booked before
the next frame of any connection is looked at, so each choice sees every booking placed before
it by any process (and the release of every booking ended before it). Nothing here awaits.

A connection that closes (its process exited, crashed or was killed with SIGKILL: the kernel
closes the socket) has every booking it still holds released at once, with the outcome
`process_lost` (which passive health ignores). A connection that sends a frame that is not this
protocol's, or does not read what it is sent (its write buffer over `MAX_UNREAD`), is closed the
same way.

Reachable only on the host, only by the same user: the socket lives in a directory of mode 0700
owned by pylon's user (created if missing; refused when it is anyone else's or open to others),
the socket itself is 0600, and each connection's peer uid (`SO_PEERCRED`) must be pylon's own.

The catalogue is the authority's: it alone watches `--workers-file` (or discovers instances), a
SIGHUP reloads it (`BookingAuthority.reload`), and a change is booked from and pushed at once
(the mirrors follow it: `pylon.routing.remote`).

Reported to the `Observer` as process events: `booking_authority_listening` (`socket`,
`routing`, `workers`), `booking_client_connected` / `booking_client_lost` (`client`: the peer's
pid, `released`: bookings it still held), `booking_client_refused` (warning: `detail`), and
`booking_authority_stopped`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from pylon.core.record import RequestRecord
from pylon.routing import Booking, NoWorker
from pylon.routing import booking_wire as wire
from pylon.routing.build import Routing, RoutingOptions, build_routing
from pylon.routing.catalogue import CatalogueWatch
from pylon.routing.fleet import CatalogueChange, Fleet, Worker, WorkerBooking
from pylon.startup import StartupError

if TYPE_CHECKING:
    from pylon.observe import Observer
    from router_ffi._native import NativeFactory

# What a client may leave unread before it is taken for stuck and closed (its bookings go).
MAX_UNREAD: Final = 4 * 1024 * 1024
# The outcome a booking is released with when its process's connection closed.
PROCESS_LOST: Final = "process_lost"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# Journal of what the authority did, for tests and the benchmark's ground truth:
# (event, client number, booking id, worker label): "book", "pin" or "release".
Journal = Callable[[str, int, int, str], None]


class _NoPrompts:
    """The `kv` router's tokenizer in the authority: the serving processes tokenize."""

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        return None


class BookingAuthority:
    """The routing parts, served to the node's processes (see the module docstring)."""

    def __init__(self, routing: Routing, observer: Observer, journal: Journal | None = None):
        self._routing = routing
        self._observer = observer
        self._journal = journal
        fleet = routing.fleet
        self._fleet = fleet
        self._by_id: dict[int, Worker] = {w.spec.worker_id: w for w in fleet.workers}
        self._by_label: dict[str, Worker] = {w.label: w for w in fleet.workers}
        self._choose = _chooser(routing)
        self._pin_policy = "least-loaded" if routing.mode == "kv" else routing.mode
        self._clients: set[_Client] = set()
        self._numbers = 0
        self.uid = os.getuid()  # the only peer uid served: pylon's own
        self.refused = 0  # connections refused: another user, or not this protocol
        fleet.on_change(self._push)
        fleet.on_catalogue(self._catalogue_changed)

    @property
    def fleet(self) -> Fleet:
        return self._fleet

    @property
    def routing(self) -> Routing:
        return self._routing

    def _catalogue_changed(self, _change: CatalogueChange) -> None:
        """A reload (the workers file, discovery): the new catalogue is booked from at once,
        and pushed at once (a worker added is out of rotation: no rotation change says it)."""
        fleet = self._fleet
        self._by_id = {w.spec.worker_id: w for w in fleet.workers}
        self._by_label = {w.label: w for w in fleet.workers}
        self._push()

    def reload(self, sig: signal.Signals | None = None) -> None:
        """SIGHUP: the workers file read now (`--workers-file`), discovery asked again
        (`--discover-instances`); one `reloaded` or `reload_failed` line, as a pylon's."""
        catalogue = self._routing.catalogue
        fields: dict[str, Any] = {"signal": sig.name if sig is not None else None}
        failed: dict[str, str] = {}
        if isinstance(catalogue, CatalogueWatch):
            result = catalogue.reload()
            if result.failed is not None:
                failed["workers"] = result.failed
            else:
                fields["workers"] = "changed" if result.change is not None else "unchanged"
            fields["catalogue_digest"] = catalogue.digest
        elif catalogue is not None:
            catalogue.wake()
            fields["workers"] = "rediscovering"
        self._observer.process_event(
            "reload_failed" if failed else "reloaded",
            **fields,
            reloaded=[] if failed or catalogue is None else ["workers"],
            failed=failed or None,
            detail=None if catalogue is not None else "nothing to re-read: no --workers-file",
        )

    @property
    def clients(self) -> int:
        return len(self._clients)

    def protocol(self) -> _Client:
        self._numbers += 1
        return _Client(self, self._numbers)

    def snapshot(self) -> bytes:
        """The `SNAPSHOT` frame: the catalogue, who is in rotation, each last health answer."""
        workers = self._fleet.workers
        return wire.encode(
            [
                wire.SNAPSHOT,
                [w.spec.text() for w in workers],
                [w.label for w in self._fleet.in_rotation if not w.removed],
                [w.last_result for w in workers],
            ]
        )

    def _push(self) -> None:
        frame = self.snapshot()
        for client in tuple(self._clients):
            client.send(frame)

    def close_all(self) -> None:
        for client in tuple(self._clients):
            client.abort()

    # -- what a client's frames do (all at once, in the read callback) ---------------------

    def book(self, client: _Client, bid: int, tokens: bytes | None, salt: str | None) -> bytes:
        """Choose and book; the `BOOKED` or `REFUSED` frame."""
        try:
            booking = self._choose(wire.unpack_tokens(tokens) if tokens else None, salt)
        except NoWorker as exc:
            return wire.encode([wire.REFUSED, bid, str(exc)])
        client.hold(bid, booking)
        if self._journal is not None:
            self._journal("book", client.number, bid, booking.worker)
        reservation = getattr(booking, "reservation", None)  # a `kv` booking's
        worker = self._by_label[booking.worker]
        rank = None
        if reservation is not None and worker.spec.dp_size > 1:
            rank = reservation.selection.dp_rank
        return wire.encode([wire.BOOKED, bid, worker.spec.worker_id, rank])

    def pin(self, client: _Client, bid: int, worker_id: int) -> None:
        """Count a booking the client made on `worker_id` itself (a move, or one made while
        this authority was away); a worker this catalogue does not know is not counted."""
        worker = self._by_id.get(worker_id)
        if worker is None:
            return
        client.hold(bid, WorkerBooking(worker, self._pin_policy, self._fleet.passive))
        if self._journal is not None:
            self._journal("pin", client.number, bid, worker.label)

    def released(self, client: _Client, bid: int, booking: Booking) -> None:
        if self._journal is not None:
            self._journal("release", client.number, bid, booking.worker)

    def connected(self, client: _Client) -> None:
        self._clients.add(client)
        self._observer.process_event("booking_client_connected", client=client.pid)
        client.send(self.snapshot())

    def lost(self, client: _Client, released: int) -> None:
        if client in self._clients:
            self._clients.discard(client)
            self._observer.process_event(
                "booking_client_lost", client=client.pid, released=released
            )

    def refuse(self, detail: str) -> None:
        self.refused += 1
        self._observer.process_event("booking_client_refused", detail=detail)


def _chooser(routing: Routing) -> Callable[[list[int] | None, str | None], Booking]:
    """The mode's booking, made at once: `kv` by the prompt's tokens (by load without them)."""
    kv = routing.kv
    if kv is not None:

        def by_prompt(tokens: list[int] | None, salt: str | None) -> Booking:
            return kv.choose_by_load() if not tokens else kv.book_tokens(tokens, salt)

        return by_prompt
    router: Any = routing.router  # LeastLoadedRouter or RoundRobinRouter: both `choose()`
    choose: Callable[[], Booking] = router.choose
    return lambda tokens, salt: choose()


class _Client(asyncio.Protocol):
    """One serving process's connection and the bookings it holds."""

    def __init__(self, authority: BookingAuthority, number: int) -> None:
        self._authority = authority
        self.number = number
        self.pid = 0
        self._reader = wire.FrameReader()
        self._bookings: dict[int, tuple[Booking, RequestRecord]] = {}
        self._transport: asyncio.Transport | None = None
        self._batch: list[bytes] | None = None  # answers to the read being handled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's Unix transports are not `asyncio.Transport` subclasses: only typed so.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        pid, uid, _ = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        self.pid = pid
        if uid != self._authority.uid:
            self._authority.refuse(f"a connection from uid {uid} (pid {pid}), not pylon's own")
            transport.abort()
            self._transport = None
            return
        self._authority.connected(self)

    def data_received(self, data: bytes) -> None:
        # The answers to what one read brought go out in one write (one system call, not one
        # per booking, when a process sends a burst).
        self._batch = []
        try:
            for message in self._reader.feed(data):
                if self._transport is None:
                    break  # cut off meanwhile (answers left unread): hold nothing more
                self._handle(message)
        except (wire.FrameError, ValueError, TypeError, IndexError) as exc:
            self._authority.refuse(f"pid {self.pid}: {exc}")
            self.abort()
        finally:
            batch, self._batch = self._batch, None
            if batch:
                self.send(b"".join(batch))

    def _handle(self, message: list[Any]) -> None:
        kind = message[0]
        authority = self._authority
        if kind == wire.BOOK:
            _, bid, tokens, salt = message
            if bid in self._bookings:
                raise wire.FrameError(f"booking {bid} is already held")
            answer = authority.book(self, bid, tokens, salt)
            if self._batch is not None:
                self._batch.append(answer)
            else:
                self.send(answer)
            return
        if kind == wire.PIN:
            _, bid, worker_id = message
            if bid in self._bookings:
                raise wire.FrameError(f"booking {bid} is already held")
            authority.pin(self, bid, worker_id)
            return
        held = self._bookings.get(message[1])
        if held is None:
            return  # refused, or a worker this catalogue does not know
        booking, record = held
        if kind == wire.HEAD:
            record.status = message[2]
            booking.response_head(record)
        elif kind == wire.FIRST:
            booking.first_output(record)
        elif kind == wire.OUTPUT:
            booking.output(record, message[2])
        elif kind == wire.END:
            _, bid, outcome, answered, status = message
            del self._bookings[bid]
            record.outcome = outcome
            record.status = status
            record.first_byte_at = 0.0 if answered else None
            booking.complete(record)
            authority.released(self, bid, booking)
        else:
            raise wire.FrameError(f"a frame of kind {kind} from a client")

    def hold(self, bid: int, booking: Booking) -> None:
        self._bookings[bid] = (booking, RequestRecord("authority", bid, 0.0))

    def send(self, frame: bytes) -> None:
        transport = self._transport
        if transport is None:
            return
        transport.write(frame)
        if transport.get_write_buffer_size() > MAX_UNREAD:
            self._authority.refuse(f"pid {self.pid} left {MAX_UNREAD} bytes unread")
            self.abort()

    def abort(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.abort()
        self._release_all()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._release_all()

    def _release_all(self) -> None:
        bookings, self._bookings = self._bookings, {}
        for bid, (booking, record) in bookings.items():
            record.outcome = PROCESS_LOST
            booking.complete(record)
            self._authority.released(self, bid, booking)
        self._authority.lost(self, len(bookings))


def prepare_socket_dir(socket_path: Path) -> None:
    """The socket's directory, private to pylon's user: created 0700 when missing; refused
    (`StartupError`) when another user owns it or group or others may enter it."""
    directory = socket_path.parent
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700, parents=True)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(
            f"booking socket directory {directory}: must be owned by uid {os.getuid()} with "
            f"mode 0700 (it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o})"
        )
    if socket_path.is_socket():
        socket_path.unlink()  # a previous authority's, dead: nobody else may write here


async def run_authority(
    options: RoutingOptions,
    socket_path: Path,
    observer: Observer,
    stop: asyncio.Event,
    *,
    native: NativeFactory | None = None,
    journal: Journal | None = None,
    started: Callable[[BookingAuthority], None] | None = None,
) -> None:
    """Build the routing parts for `options`, serve them on `socket_path` until `stop` is
    set, then close every connection (their bookings go) and the routing parts.

    `native`: for `kv`, a factory of the native selection service instead of Dynamo's (tests);
    `journal`: hears every booking and release (tests, the benchmark); `started`: called once
    the socket listens. Raises `StartupError` when the socket or the parts cannot be built.
    """
    prepare_socket_dir(socket_path)
    kv = options.kv
    if kv is not None and kv.token_data:
        # The serving processes prove and carry the token ids themselves (they tokenize).
        options = dataclasses.replace(options, kv=dataclasses.replace(kv, token_data=False))
    routing = await build_routing(options, observer, tokenizer=_NoPrompts(), native=native)
    try:
        authority = BookingAuthority(routing, observer, journal)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(authority.protocol, str(socket_path))
        try:
            os.chmod(socket_path, 0o600)
            routing.start()
            observer.process_event(
                "booking_authority_listening",
                socket=str(socket_path),
                routing=routing.mode,
                workers=len(routing.fleet.workers),
            )
            if started is not None:
                started(authority)
            await stop.wait()
        finally:
            server.close()
            authority.close_all()
            await server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                socket_path.unlink()
    finally:
        await routing.aclose()
    observer.process_event("booking_authority_stopped", socket=str(socket_path))

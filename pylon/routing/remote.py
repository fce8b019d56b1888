"""The router of a serving process whose node has a booking authority (`pylon.routing.authority`).

`RemoteRouter` asks the authority for every booking over its Unix socket (`AuthorityLink`, the
frames of `pylon.routing.booking_wire`), so a choice in any process sees every booking made
before it by any process. The process keeps a mirror `Fleet` built from the same worker specs:
each worker's upstream and trusted headers are needed here, where the request is. The authority
pushes a snapshot (the catalogue, the labels in rotation, each last health answer) at connect
and on every change; the mirror's catalogue follows it (`Fleet.replace_texts`: the authority's
is the one truth, so a workers-file reload there reaches every process; `workers_reloaded`,
trigger `authority`), its rotation follows it exactly, and so does this process's readiness
(`Fleet.on_change`), as if its own health checks had spoken. The active health checks
and passive health run in the authority only: the bookings here forward the exchange's moments.

Per request:

- `kv`: the prompt's token ids are computed here (the tokenizing CPU is spread over the
  processes, on the loop for a small body and in a thread for a large one, as `KvRouter`
  does), and sent as u32 bytes; with `--kv-token-data` this process proves its models (at
  its start, like a single pylon: `Routing.token_data`) and writes the body itself
  (`TokenDataProver`). The other modes send no prompt.
- A `BOOK` waits at most `BOOK_DEADLINE_S` for its answer; `REFUSED` is `NoWorker` (503).
- `RemoteBooking` sends the moments (`HEAD`, `FIRST`, `OUTPUT` for `kv`, `END`) without waiting:
  they are ordered per connection, and a release is one frame.
- `elsewhere` (a connect-failure move) must answer at once: the other worker is chosen here,
  least-loaded over this process's own bookings, and counted at the authority with `PIN`.

When the authority is away (its connection lost, the socket not there yet), this process says so
once (`booking_authority_lost`, warning), counts it, and books on its mirror alone: least-loaded
over its own bookings (`round-robin` keeps its turn), `kv` falling back to least-loaded, until
the link is back (retried with backoff from `RECONNECT_MIN_S` to `RECONNECT_MAX_S`;
`booking_authority_connected`). A `BOOK` unanswered within `BOOK_DEADLINE_S` books locally too,
and so does every request after it until the authority sends anything again
(`booking_authority_stalled`, once a stall); those bookings are counted there with `PIN`, queued
on the same connection, and an answer that comes too late is released at once (`END`).

On every (re)connect this process re-announces (`PIN`) each booking still in flight, the local
ones included, so a restarted authority counts the node's whole load again: exact once more for
`least-loaded` and `round-robin`; for `kv` those bookings count as load in the authority's fleet
but not in its new selection core (no prompt is resent), until they end.
`AuthorityLink.counters` says what happened (connects, losses, timeouts, bookings made locally).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, cast

from pylon.core.body import with_token_data
from pylon.core.hooks import ExchangeHooks
from pylon.core.http import Header
from pylon.core.plan import ForwardPlan
from pylon.core.record import RequestRecord
from pylon.routing import Booking, NoWorker, PromptTokenizer, Router
from pylon.routing import booking_wire as wire
from pylon.routing.fleet import CatalogueChange, Fleet, Worker, count_decision, elsewhere
from pylon.routing.health import HealthChecker, HealthCheckOptions
from pylon.routing.kv import INLINE_TOKENIZE_BYTES, rank_headers
from pylon.routing.least_loaded import least_loaded
from pylon.routing.round_robin import no_worker
from pylon.routing.spec import WorkerSpecError

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.observe import Observer
    from pylon.routing.token_data import TokenDataProver

# A booking's round trip is a local socket and one selection (~0.1 ms; milliseconds on a loaded
# host), but the authority's `kv` selection may itself take up to the selection core's 0.5 s
# deadline before it gives up. An authority that has not answered in this long is taken for
# stalled: the request books locally, and so does every request after it until the authority
# sends anything again (its late answer is released at once), so a stuck authority costs one
# request this much, never every request.
BOOK_DEADLINE_S: Final = 0.75
CONNECT_TIMEOUT_S: Final = 1.0
RECONNECT_MIN_S: Final = 0.05
RECONNECT_MAX_S: Final = 2.0
# What this process may leave unsent to the authority before the link is taken for stuck.
MAX_UNSENT: Final = 4 * 1024 * 1024


class AuthorityAway(Exception):
    """The authority cannot answer now: book locally."""


class RemoteBooking(ExchangeHooks):
    """One exchange's booking, held at the authority (or, while it is away, here only): counted
    on this process's mirror worker from booking to release, its moments forwarded."""

    __slots__ = (
        "_link",
        "_released",
        "_worker",
        "bid",
        "body",
        "counts_output",
        "generation",
        "headers",
        "upstream",
        "worker",
    )
    quiet = False

    def __init__(
        self,
        link: AuthorityLink,
        bid: int,
        worker: Worker,
        headers: tuple[Header, ...],
        *,
        body: bytes | None = None,
        counts_output: bool = False,
        generation: int = 0,
    ) -> None:
        self._link = link
        self.bid = bid
        self._worker = worker
        self.upstream = worker.upstream
        self.headers = headers
        self.worker = worker.label
        self.body = body
        self.counts_output = counts_output
        self.generation = generation  # the link generation that knows it; 0: none
        self._released = False
        worker.active += 1
        link.live[bid] = self

    @property
    def worker_id(self) -> int:
        return self._worker.spec.worker_id

    def response_head(self, record: RequestRecord) -> None:
        self._link.moment(self, [wire.HEAD, self.bid, record.status])

    def first_output(self, record: RequestRecord) -> None:
        self._link.moment(self, [wire.FIRST, self.bid])

    def output(self, record: RequestRecord, count: int) -> None:
        self._link.moment(self, [wire.OUTPUT, self.bid, count])

    def complete(self, record: RequestRecord) -> None:
        self._release(record.outcome, record.first_byte_at is not None, record.status)

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self._release(error.code.value, False, 0)

    def _release(self, outcome: str, answered: bool, status: int) -> None:
        if self._released:
            return
        self._released = True
        self._worker.active -= 1
        link = self._link
        link.moment(self, [wire.END, self.bid, outcome, answered, status])
        link.live.pop(self.bid, None)


class AuthorityLink:
    """This process's connection to the authority: the `BOOK` round trips, the moments, the
    pushed snapshots, and the reconnects (see the module docstring)."""

    def __init__(self, socket_path: Path, fleet: Fleet, observer: Observer) -> None:
        self._path = socket_path
        self._fleet = fleet
        self._observer = observer
        self._by_id = {w.spec.worker_id: w for w in fleet.workers}
        self._ids = itertools.count(1)
        self.live: dict[int, RemoteBooking] = {}
        self._pending: dict[int, asyncio.Future[list[Any]]] = {}
        self._transport: asyncio.Transport | None = None
        self.generation = 0  # bumped at every connect
        self.snapshots = 0  # snapshots applied
        self.first_snapshot = asyncio.Event()
        self._catalogue_differs = False
        self._closing = False
        self._up = False  # the current connection's first snapshot came
        self._stalled = False  # a booking went unanswered; nothing came since
        self._unsent: list[bytes] = []  # frames for the end of this loop turn
        self._flush_due = False
        self.counters = {"connects": 0, "losses": 0, "timeouts": 0, "local_bookings": 0}

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def next_id(self) -> int:
        return next(self._ids)

    async def run(self) -> None:
        """Connect, serve, and reconnect with backoff when the link is lost, until cancelled."""
        loop = asyncio.get_running_loop()
        delay = RECONNECT_MIN_S
        while True:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    transport, protocol = await loop.create_unix_connection(
                        lambda: _LinkProtocol(self), str(self._path)
                    )
            except (OSError, TimeoutError):
                # A connection made just before the deadline: never served, dropped here.
                self._lost("the connection did not complete in time")
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            try:
                await self._serve(protocol)
            except asyncio.CancelledError:
                self._closing = True  # pylon is stopping: nothing lost
                raise
            finally:
                came_up = self._up
                self._lost("the connection closed")
                transport.abort()
            if came_up:
                delay = RECONNECT_MIN_S  # it served: try again at once
            else:  # accepted and closed, or silent: not an authority (yet); back off
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)

    def adopt(self, transport: asyncio.Transport) -> None:
        """A new connection, from its protocol's `connection_made`: before any frame of it is
        read (uvloop may read the authority's first snapshot before `run` resumes from the
        connect), so the snapshot always finds this connection's state, never the last one's."""
        self._transport = transport
        self._up = False
        self.generation += 1
        for booking in tuple(self.live.values()):
            self._queue([wire.PIN, booking.bid, booking.worker_id])
            booking.generation = self.generation

    async def _serve(self, protocol: _LinkProtocol) -> None:
        # An authority says who is in rotation at once; a socket that does not is dead (e.g. a
        # listener that died under the connect).
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await asyncio.wait([protocol.closed, protocol.spoke], return_when="FIRST_COMPLETED")
        except TimeoutError:
            return
        await protocol.closed

    @property
    def up(self) -> bool:
        """The current connection's first snapshot came."""
        return self._up

    def refused(self, detail: str) -> None:
        self._observer.process_event("booking_authority_refused", detail=detail)

    def received(self, message: list[Any]) -> None:
        self._stalled = False  # it speaks again
        kind = message[0]
        if kind == wire.SNAPSHOT:
            self._apply(message[1], message[2], message[3])
            return
        future = self._pending.pop(message[1], None)
        if future is None or future.done():
            if kind == wire.BOOKED:  # its request gave up meanwhile: release it at once
                self.end(message[1], "client_gone")
            return
        future.set_result(message)

    def _apply(self, specs: list[str], in_rotation: list[str], results: list[str]) -> None:
        """The authority's snapshot on the mirror: its catalogue and its rotation, exactly."""
        fleet = self._fleet
        if specs != list(fleet.spec_texts()):
            self._follow(specs)
        if specs == list(fleet.spec_texts()):
            for worker, result in zip(fleet.workers, results, strict=False):
                worker.last_result = result
        admitted = set(in_rotation)
        for worker in fleet.workers:
            if worker.checks_pass != (worker.label in admitted):
                fleet.set_in_rotation(worker, worker.label in admitted)
        self.snapshots += 1
        self.first_snapshot.set()
        if not self._up:  # the link is up: the authority accepted it and spoke
            self._up = True
            self.counters["connects"] += 1
            self._observer.process_event(
                "booking_authority_connected", socket=str(self._path), reannounced=len(self.live)
            )

    def _follow(self, specs: list[str]) -> None:
        """The authority's catalogue on the mirror (one truth: the authority's, which watches
        the workers file): `workers_reloaded`, trigger `authority`. A catalogue this process
        cannot take (a spec it cannot parse: another pylon version) keeps the one it has, and
        only the workers both know are followed (`booking_catalogue_differs`, once)."""
        try:
            change = self._fleet.replace_texts(specs) if specs else None
        except WorkerSpecError as exc:
            change = None
            detail = f"the authority's catalogue is not this process's: {exc}"
        else:
            detail = "the authority's catalogue is empty" if change is None else ""
        if change is None:
            if not self._catalogue_differs:
                self._catalogue_differs = True  # said once per difference, not per snapshot
                self._observer.process_event(
                    "booking_catalogue_differs",
                    detail=f"{detail}: only the workers both know are followed",
                )
            return
        self._catalogue_differs = False
        self._by_id = {w.spec.worker_id: w for w in self._fleet.workers}
        if change.changed:
            self._observer.process_event(
                "workers_reloaded", source=str(self._path), trigger="authority", **change.fields()
            )

    def _lost(self, detail: str) -> None:
        if self._transport is None:
            return
        transport, self._transport = self._transport, None
        transport.abort()
        self._stalled = False
        self._unsent = []  # for an authority that is gone
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(AuthorityAway(detail))
        came_up, self._up = self._up, False
        if self._closing or not came_up:
            return  # stopping, or a socket that never answered (a dying listener): no news
        self.counters["losses"] += 1
        self._observer.process_event(
            "booking_authority_lost",
            socket=str(self._path),
            detail=detail,
            in_flight=len(self.live),
        )

    def _write(self, message: list[Any]) -> None:
        """A frame now (after the moments queued before it: the order is kept)."""
        self._queue(message)
        self._flush()

    def _queue(self, message: list[Any]) -> None:
        """A frame at the end of this loop turn: the moments of many exchanges go out in one
        write (one system call), in the order they happened."""
        if self._transport is None:
            return
        self._unsent.append(wire.encode(message))
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        transport = self._transport
        unsent, self._unsent = self._unsent, []
        if transport is None or not unsent:
            return
        transport.write(b"".join(unsent))
        if transport.get_write_buffer_size() > MAX_UNSENT:
            self._lost(f"over {MAX_UNSENT} bytes the authority has not read")

    def moment(self, booking: RemoteBooking, message: list[Any]) -> None:
        """A booking's moment, to the authority that knows it (none other would)."""
        if booking.generation == self.generation and self._transport is not None:
            self._queue(message)

    async def book(self, bid: int, tokens: bytes | None, salt: str | None) -> list[Any]:
        """`BOOK`, and its answer (`BOOKED` or `REFUSED`); `AuthorityAway` when there is no
        link, when no answer came within `BOOK_DEADLINE_S`, and from then on until the
        authority sends anything again (it is stalled: no request waits for it meanwhile)."""
        if self._transport is None:
            raise AuthorityAway("not connected")
        if self._stalled:
            raise AuthorityAway("stalled")
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending[bid] = future
        self._write([wire.BOOK, bid, tokens, salt])
        try:
            async with asyncio.timeout(BOOK_DEADLINE_S):
                return await future
        except TimeoutError:
            self.counters["timeouts"] += 1
            if not self._stalled:
                self._stalled = True
                self._observer.process_event(
                    "booking_authority_stalled",
                    socket=str(self._path),
                    detail=f"no answer to a booking within {BOOK_DEADLINE_S:g} s: booking "
                    "locally until it answers",
                )
            raise AuthorityAway("no answer in time") from None

    def pin(self, booking: RemoteBooking) -> None:
        """Count at the authority a booking made here."""
        if self._transport is not None:
            booking.generation = self.generation
            self._queue([wire.PIN, booking.bid, booking.worker_id])

    def end(self, bid: int, outcome: str) -> None:
        """Release at the authority a booking nobody here holds."""
        self._queue([wire.END, bid, outcome, False, 0])

    def worker(self, worker_id: int) -> Worker | None:
        return self._by_id.get(worker_id)

    def close(self) -> None:
        self._closing = True
        self._lost("pylon is stopping")


class _LinkProtocol(asyncio.Protocol):
    """One connection to the authority: its frames straight to the link, in the loop's read
    callback (a booking's answer wakes its request with no task in between)."""

    def __init__(self, link: AuthorityLink) -> None:
        self._link = link
        self._frames = wire.FrameReader()
        self._transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.spoke: asyncio.Future[None] = loop.create_future()  # the first snapshot came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's Unix transports are not `asyncio.Transport` subclasses: only typed so.
        transport = cast(asyncio.Transport, transport)
        self._transport = transport
        self._link.adopt(transport)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self._frames.feed(data)
        except wire.FrameError as exc:
            self._link.refused(str(exc))
            if self._transport is not None:
                self._transport.abort()
            return
        link = self._link
        for message in messages:
            link.received(message)
        if not self.spoke.done() and link.up:
            self.spoke.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class RemoteChecks(HealthChecker):
    """The health checks of a process served by an authority: the authority runs the checks;
    here `run` is the link (its snapshots are the rounds), so bring-up and readiness read the
    mirror exactly as they read a fleet checked locally."""

    def __init__(
        self, fleet: Fleet, options: HealthCheckOptions, link: AuthorityLink, observer: Observer
    ) -> None:
        super().__init__(fleet, options, observer=observer)
        self._link = link
        # The authority's first snapshot comes at connect; a missing authority must not hold
        # bring-up for ever: after this long the gate goes on with the (empty) rotation.
        self._first_wait = options.timeout + CONNECT_TIMEOUT_S

    @property
    def link(self) -> AuthorityLink:
        return self._link

    async def run(self) -> None:
        await self._link.run()

    async def check_once(self) -> None:
        return None

    async def first_round(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._first_wait):
                await self._link.first_snapshot.wait()
        self.rounds = max(self.rounds, self._link.snapshots)


class RemoteRouter:
    """The `Router` of a serving process with a booking authority (see the module docstring)."""

    def __init__(
        self,
        mode: str,
        fleet: Fleet,
        link: AuthorityLink,
        *,
        tokenizer: PromptTokenizer | None = None,
        token_data: TokenDataProver | None = None,
    ) -> None:
        self._mode = mode
        self._fleet = fleet
        self._link = link
        self._kv = mode == "kv"
        self._tokenizer = tokenizer
        self.token_data = token_data
        self._local_policy = "round-robin" if mode == "round-robin" else "least-loaded"
        self._rank_headers = {w.spec.worker_id: rank_headers(w) for w in fleet.workers}
        fleet.on_catalogue(self._catalogue_changed)
        self._next = 0
        self._tokenize_thread: ThreadPoolExecutor | None = None
        if self._kv:
            self._tokenize_thread = ThreadPoolExecutor(1, thread_name_prefix="pylon-tokenize")

    @property
    def link(self) -> AuthorityLink:
        return self._link

    def _catalogue_changed(self, _change: CatalogueChange) -> None:
        fleet = self._fleet
        self._rank_headers = {w.spec.worker_id: rank_headers(w) for w in fleet.workers}

    async def book(self, plan: ForwardPlan) -> Booking:
        fleet = self._fleet
        if not fleet.in_rotation:
            raise no_worker(fleet)
        tokens = body = None
        carry = False
        if self._kv:
            token_data = self.token_data
            carry = token_data is not None and plan.model in token_data.proven
            tokens, body = await self._prompt(plan, carry)
            if token_data is not None and not carry and tokens is not None:
                token_data.want(plan.model)
        link = self._link
        if link.connected:
            bid = link.next_id()
            try:
                reply = await link.book(bid, tokens, None)
            except AuthorityAway:
                pass
            else:
                return self._booked(bid, reply, body, counts_output=tokens is not None)
        # A fresh id: an unanswered `BOOK`'s may still be answered (and is then released).
        return self._local(link.next_id(), body)

    def _booked(
        self, bid: int, reply: list[Any], body: bytes | None, *, counts_output: bool
    ) -> Booking:
        link = self._link
        if reply[0] == wire.REFUSED:
            raise NoWorker(reply[2])
        _, _, worker_id, rank = reply
        worker = link.worker(worker_id)
        if worker is None:  # the authority's catalogue is another: release it there
            link.end(bid, "unknown_worker")
            return self._local(link.next_id(), body)
        headers = worker.headers
        if rank is not None:
            headers = headers + self._rank_headers[worker_id][rank]
        count_decision(worker, self._mode)
        return RemoteBooking(
            link,
            bid,
            worker,
            headers,
            body=body,
            counts_output=counts_output,  # a `kv` reservation counts output blocks
            generation=link.generation,
        )

    def _local(self, bid: int, body: bytes | None) -> RemoteBooking:
        """A booking chosen here (the authority is away), announced when it is back."""
        in_rotation = self._fleet.in_rotation
        if not in_rotation:
            raise no_worker(self._fleet)
        if self._local_policy == "round-robin":
            index = self._next % len(in_rotation)
        else:
            index = least_loaded(in_rotation, self._next)
        self._next = index + 1
        worker = in_rotation[index]
        link = self._link
        link.counters["local_bookings"] += 1
        count_decision(worker, self._local_policy)
        booking = RemoteBooking(link, bid, worker, worker.headers, body=body)
        link.pin(booking)
        return booking

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        """Least-loaded over this process's own bookings on the other workers, chosen at once
        (a move cannot wait for a round trip), and counted at the authority (`PIN`)."""
        others = elsewhere(self._fleet, failed)
        if not others:
            return None
        worker = others[least_loaded(others, self._next)]
        link = self._link
        count_decision(worker, self._local_policy)
        booking = RemoteBooking(link, link.next_id(), worker, worker.headers)
        link.pin(booking)
        return booking

    async def _prompt(self, plan: ForwardPlan, carry: bool) -> tuple[bytes | None, bytes | None]:
        """The prompt's ids as u32 bytes (None: book by load) and, with `carry`, the body
        carrying them; a body over `INLINE_TOKENIZE_BYTES` in the tokenizer thread."""
        path = plan.target.partition("?")[0]
        if len(plan.body) <= INLINE_TOKENIZE_BYTES or self._tokenize_thread is None:
            return self._tokenize(path, plan.body, carry)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_thread, self._tokenize, path, plan.body, carry
        )

    def _tokenize(self, path: str, body: bytes, carry: bool) -> tuple[bytes | None, bytes | None]:
        assert self._tokenizer is not None, "kv needs its tokenizer"
        try:
            tokens = self._tokenizer.prompt_tokens(path, body)
            if not tokens:
                return None, None
            packed = wire.pack_tokens(tokens)
        except Exception:  # the tokenizer's bug (or an id past u32) must not fail the request
            return None, None
        return packed, with_token_data(body, tokens) if carry else None

    async def aclose(self) -> None:
        self._link.close()
        if self._tokenize_thread is not None:
            self._tokenize_thread.shutdown(wait=False, cancel_futures=True)
        if self.token_data is not None:
            await self.token_data.aclose()


def remote_routing_parts(
    mode: str,
    fleet: Fleet,
    options: HealthCheckOptions,
    socket_path: Path,
    observer: Observer,
    *,
    tokenizer: PromptTokenizer | None,
    token_data: TokenDataProver | None,
) -> tuple[RemoteRouter, RemoteChecks]:
    link = AuthorityLink(socket_path, fleet, observer)
    router = RemoteRouter(mode, fleet, link, tokenizer=tokenizer, token_data=token_data)
    return router, RemoteChecks(fleet, options, link, observer)


_: type[Router] = RemoteRouter
__: type[Booking] = RemoteBooking

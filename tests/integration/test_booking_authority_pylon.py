"""A real pylon whose router books at a booking authority (`build_routing(..., authority=PATH)`),
in front of real mock workers: requests are served and their bookings released at the authority
(none leaks after a mixed run with aborts), readiness follows the authority's rotation, the `kv`
moments reach the authority's selection core, and a stuck authority costs one request one
deadline, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from pylon.routing import booking_wire as wire
from pylon.routing.authority import BookingAuthority, run_authority
from pylon.routing.build import RoutingOptions, build_routing
from pylon.routing.remote import BOOK_DEADLINE_S, RemoteChecks, RemoteRouter
from tests.booking_processes import plan, released, routing_options
from tests.fleet import FleetFactory, mixed_load
from tests.integration.test_passive_health import statuses
from tests.observers import EventObserver
from tests.router_ffi.fake_native import FakeNative
from tests.stack import MODEL


class Authorities:
    """Booking authorities run in the test's loop, each for the options it is given."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack
        self.native: FakeNative | None = None
        self.authority: BookingAuthority | None = None
        self.observer = EventObserver()

    async def __call__(self, options: RoutingOptions) -> Path:
        socket_path = Path(tempfile.mkdtemp(prefix="pylon-book-")) / "run" / "bookings.sock"
        stop = asyncio.Event()
        started: asyncio.Future[BookingAuthority] = asyncio.get_running_loop().create_future()
        native = None
        if options.mode == "kv":
            fake = self.native = FakeNative()
            native = lambda: fake  # noqa: E731
        task = asyncio.create_task(
            run_authority(
                options, socket_path, self.observer, stop, native=native, started=started.set_result
            )
        )

        async def close() -> None:
            stop.set()
            await task

        self._stack.push_async_callback(close)
        self.authority = await asyncio.wait_for(asyncio.shield(started), 10)
        return socket_path

    def loads(self) -> dict[str, int]:
        assert self.authority is not None
        return self.authority.fleet.active_by_worker()


@pytest.fixture
async def authorities() -> AsyncIterator[Authorities]:
    async with contextlib.AsyncExitStack() as stack:
        yield Authorities(stack)


async def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_requests_book_at_the_authority_and_none_leaks_after_aborts(
    make_fleet: FleetFactory, authorities: Authorities
) -> None:
    fleet = await make_fleet(
        workers=3, routing="least-loaded", authority=authorities, first_output_timeout=0.5
    )
    assert isinstance(fleet.routing.router, RemoteRouter)
    sent = await mixed_load(fleet)
    await fleet.observer.wait_done(sent, timeout=30)
    await wait_until(lambda: sum(authorities.loads().values()) == 0)
    assert fleet.routing.active_bookings() == dict.fromkeys(authorities.loads(), 0)
    assert authorities.authority is not None
    made = sum(sum(w.decisions.values()) for w in authorities.authority.fleet.workers)
    assert made >= sent  # every request booked there (a move books a second time)
    assert isinstance(fleet.routing.checks, RemoteChecks)
    assert fleet.routing.checks.link.counters["local_bookings"] == 0


async def test_a_dead_worker_moves_requests_and_the_authoritys_passive_health_ejects_it(
    make_fleet: FleetFactory, authorities: Authorities
) -> None:
    fleet = await make_fleet(workers=2, routing="round-robin", authority=authorities)
    await fleet.mocks[1].stop()  # its port closes; the active checks (hourly) do not notice
    got = await statuses(fleet, "dead", 10)
    assert got == [200] * 10
    await fleet.observer.wait_done(10)
    records = [fleet.observer.finished[f"dead-{n}"] for n in range(10)]
    assert {record.worker for record in records} == {fleet.label(0)}
    assert 1 <= len([record for record in records if record.attempts == 2]) <= 5
    # The moves' verdicts reached the authority's passive health; its ejection, every mirror.
    ejected = await authorities.observer.wait_for("worker_outlier_ejected", worker=fleet.label(1))
    assert ejected["reason"] == "connect_failure"
    await wait_until(lambda: [w.label for w in fleet.routing.fleet.in_rotation] == [fleet.label(0)])
    await wait_until(lambda: sum(authorities.loads().values()) == 0)
    assert sum(fleet.routing.active_bookings().values()) == 0


async def test_readiness_follows_the_rotation_the_authority_pushes(
    make_fleet: FleetFactory, authorities: Authorities
) -> None:
    fleet = await make_fleet(workers=2, routing="round-robin", authority=authorities)
    assert authorities.authority is not None
    source = authorities.authority.fleet
    for worker in source.workers:
        source.set_ejected(worker, True)
    await wait_until(lambda: not fleet.routing.fleet.in_rotation)
    lifecycle = fleet.running.core.lifecycle
    assert lifecycle.readiness() == (False, "no_worker_in_rotation")
    reply = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert reply.status_code == 503
    for worker in source.workers:
        source.set_ejected(worker, False)
    await wait_until(lambda: len(fleet.routing.fleet.in_rotation) == 2)
    assert lifecycle.readiness() == (True, "ready")
    reply = await fleet.post("/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert reply.status_code == 200


async def test_kv_moments_reach_the_authoritys_selection_core(
    make_fleet: FleetFactory, authorities: Authorities
) -> None:
    fleet = await make_fleet(
        workers=2, routing="kv", authority=authorities, mock={"num_tokens": 40}
    )
    body = {"model": MODEL, "prompt": "a b c d e f g h", "stream": True, "max_tokens": 40}
    reply = await fleet.post("/v1/completions", body)
    assert reply.status_code == 200
    await fleet.observer.wait_done(1)
    native = authorities.native
    assert native is not None
    await wait_until(lambda: not native.reservations)  # freed at the authority
    (sid,) = {arg for op, arg in native.calls if op == "select_and_reserve"}
    ops = native.ops_for(str(sid))
    assert ops[0] == "select_and_reserve"
    assert "prefill_complete" in ops
    assert "add_output_block" in ops  # 40 output tokens, 16 a block
    assert ops[-1] == "free_reservation"


async def test_a_stuck_authority_costs_one_booking_one_deadline() -> None:
    """An authority that accepts and pushes its snapshot, then answers no booking until the
    test says so."""
    socket_path = Path(tempfile.mkdtemp(prefix="pylon-book-")) / "bookings.sock"
    options = routing_options("least-loaded", ["url=http://127.0.0.1:9", "url=http://127.0.0.1:10"])
    heard: list[list[Any]] = []
    writers: list[asyncio.StreamWriter] = []
    snapshot = wire.encode(
        [wire.SNAPSHOT, [w.text() for w in options.workers], ["http://127.0.0.1:9"], ["ok", "x"]]
    )

    async def stuck(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        writer.write(snapshot)
        frames = wire.FrameReader()
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                heard.extend(frames.feed(data))
        writer.close()

    server = await asyncio.start_unix_server(stuck, str(socket_path))
    routing = await build_routing(options, EventObserver(), authority=socket_path)
    routing.start()
    try:
        await routing.checks.first_round()
        assert [w.label for w in routing.fleet.in_rotation] == ["http://127.0.0.1:9"]
        link = routing.checks.link  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        began = loop.time()
        first = await routing.router.book(plan(b"x"))
        assert BOOK_DEADLINE_S <= loop.time() - began < BOOK_DEADLINE_S + 0.2
        began = loop.time()
        second = await routing.router.book(plan(b"y"))  # stalled: no wait at all
        assert loop.time() - began < 0.05
        assert first.worker == second.worker == "http://127.0.0.1:9"  # booked on the mirror
        assert link.counters["timeouts"] == 1
        assert link.counters["local_bookings"] == 2
        assert link.connected and link.counters["losses"] == 0
        counters = {"connects": 1, "losses": 0, "timeouts": 1, "local_bookings": 2}
        assert routing.snapshot().authority == (True, counters)  # what /metrics shows
        # Both counted at the authority, on the same connection, after the unanswered one.
        await wait_until(lambda: [m[0] for m in heard] == [wire.BOOK, wire.PIN, wire.PIN])
        (unanswered, pinned_first, pinned_second) = (m[1] for m in heard)
        # The late answer: released at once, and the link books there again.
        writers[0].write(wire.encode([wire.BOOKED, unanswered, options.workers[0].worker_id, None]))
        await wait_until(lambda: len(heard) == 4)
        assert heard[3][:3] == [wire.END, unanswered, "client_gone"]
        booking = asyncio.create_task(routing.router.book(plan(b"z")))
        await wait_until(lambda: len(heard) == 5)
        assert heard[4][0] == wire.BOOK
        writers[0].write(
            wire.encode([wire.BOOKED, heard[4][1], options.workers[0].worker_id, None])
        )
        assert (await booking).worker == "http://127.0.0.1:9"
        assert link.counters["local_bookings"] == 2
        released(first)
        await wait_until(lambda: heard[-1][:2] == [wire.END, pinned_first])
        assert len({unanswered, pinned_first, pinned_second}) == 3
    finally:
        await routing.aclose()
        server.close()
        await server.wait_closed()
        for writer in writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

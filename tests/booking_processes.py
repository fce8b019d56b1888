"""Real OS processes around a booking authority, for the tests and `scripts/bench_bookings.py`.

    python -m tests.booking_processes client --socket PATH --mode MODE --worker SPEC ...
    python -m tests.booking_processes client --alone --mode MODE --worker SPEC ...
    python -m tests.booking_processes authority --socket PATH --mode MODE --worker SPEC ...

`client`: a serving process's routing parts (`build_routing(..., authority=PATH)`, the mirror
fleet and `RemoteRouter`), driven by one JSON command a line on stdin, one JSON answer a line on
stdout (see `Client.handle`); with `--alone`, a process that books on its own (the routing
parts of a single pylon, every worker in rotation), for the benchmark's comparison.

`authority`: `run_authority` until SIGTERM, every worker put in rotation at start (the workers
are addresses nobody listens on: these tests are about bookings, not health), a line
`{"listening": PATH}` once it serves, and with `--journal FILE` every booking and release
appended to FILE as it happens.

`kv` uses the stand-in native core (tests/router_ffi/fake_native: least active reservations
first) unless `--dynamo`, and the body's bytes as the prompt's tokens, so the default suite
needs no Dynamo.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pylon.core.plan import ForwardPlan
from pylon.core.priority import NO_WRITE
from pylon.core.record import RequestRecord
from pylon.routing import Booking, NoWorker
from pylon.routing.authority import BookingAuthority, run_authority
from pylon.routing.build import KvOptions, Routing, RoutingOptions, build_routing
from pylon.routing.health import HealthCheckOptions
from pylon.routing.remote import RemoteChecks
from pylon.routing.spec import parse_worker_spec
from tests.observers import EventObserver

KV = KvOptions(overlap_weight=None, token_data=False, probe_timeout=5.0)
# Health checks that never run again after the first round (the workers are not listening).
QUIET_HEALTH = HealthCheckOptions("/health", 3600.0, 0.5, 3, 2)


def routing_options(mode: str, workers: list[str]) -> RoutingOptions:
    return RoutingOptions(
        mode,  # type: ignore[arg-type]
        workers=tuple(parse_worker_spec(text) for text in workers),
        frontend=None,
        health=QUIET_HEALTH,
        kv=KV if mode == "kv" else None,
    )


class BodyTokens:
    """The prompt's tokens: the body's bytes (the stand-in core ignores them but for load)."""

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        return list(body) if path == "/v1/completions" else None


def plan(body: bytes) -> ForwardPlan:
    return ForwardPlan("POST", "/v1/completions", (), body, "r", "m", False, (), NO_WRITE)


def released(booking: Booking) -> None:
    record = RequestRecord("http1", 1, 0.0)
    record.status = 200
    record.outcome = "ok"
    record.first_byte_at = 0.0
    booking.complete(record)


class Client:
    """One serving process's router, driven by commands."""

    def __init__(self, routing: Routing, observer: EventObserver) -> None:
        self.routing = routing
        self.observer = observer
        self.held: list[Booking] = []
        self.rng = random.Random(0)
        checks = routing.checks
        self.link = checks.link if isinstance(checks, RemoteChecks) else None

    def stats(self) -> dict[str, Any]:
        fleet = self.routing.fleet
        link = self.link
        return {
            "counters": dict(link.counters) if link is not None else {"local_bookings": 0},
            "connected": link is not None and link.connected,
            "in_rotation": [w.label for w in fleet.in_rotation],
            "active": fleet.active_by_worker(),
            "held": len(self.held),
        }

    async def book(self) -> tuple[int, str, bool] | None:
        """One booking: (booking id, worker, booked locally)."""
        counters = self.link.counters if self.link is not None else {"local_bookings": 0}
        before = counters["local_bookings"]
        try:
            # 29 bytes, distinct: two 16-token blocks each as `kv` tokens, no shared prefix block
            body = b"a prompt %020d" % self.rng.randrange(10**20)
            booking = await self.routing.router.book(plan(body))
        except NoWorker:
            return None
        self.held.append(booking)
        local = counters["local_bookings"] != before
        return getattr(booking, "bid", 0), booking.worker, local

    async def run(
        self, count: int, seed: int, hold: float, rate: float, start_at: float | None = None
    ) -> dict[str, Any]:
        """`count` bookings; after each, with probability 1 - `hold`, one held booking (a
        random one) is released. With `rate` 0 one after another, each once the last is
        answered; else an open loop: one every 1/`rate` s from `start_at` (`time.monotonic()`,
        one clock for every process of the host), whether or not the earlier ones were
        answered, as requests arrive. Each booking's round trip in `seconds`, and when it was
        answered in `at`, in the order they were asked."""
        self.rng = random.Random(seed)
        loop = asyncio.get_running_loop()
        if start_at is not None and start_at > time.monotonic():
            await asyncio.sleep(start_at - time.monotonic())
        start = loop.time()
        results: list[tuple[tuple[int, str, bool] | None, float, float]] = []
        tasks = []
        for index in range(count):
            if not rate:
                results.append(await self._timed(hold))
                continue
            due = start + index / rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            tasks.append(asyncio.create_task(self._timed(hold)))
        results += await asyncio.gather(*tasks)
        return {
            "booked": [booked for booked, _, _ in results],
            "seconds": [seconds for _, seconds, _ in results],
            "at": [at for _, _, at in results],
            **self.stats(),
        }

    async def _timed(self, hold: float) -> tuple[tuple[int, str, bool] | None, float, float]:
        began = time.perf_counter()
        booked = await self.book()
        seconds = time.perf_counter() - began
        at = time.monotonic()
        if self.held and self.rng.random() >= hold:
            released(self.held.pop(self.rng.randrange(len(self.held))))
        return booked, seconds, at

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        if op == "book":
            return {"booked": [await self.book() for _ in range(command["count"])]}
        if op == "run":
            return await self.run(
                command["count"],
                command["seed"],
                command["hold"],
                command.get("rate", 0),
                command.get("start_at"),
            )
        if op == "release_all":
            held, self.held = self.held, []
            for booking in held:
                released(booking)
            return {"released": len(held)}
        if op == "stats":
            return self.stats()
        if op == "wait":  # until the link's connects and the mirror's rotation are as asked
            async with asyncio.timeout(command.get("timeout", 10.0)):
                while not self._as_asked(command):
                    await asyncio.sleep(0.005)
            return self.stats()
        raise ValueError(f"unknown op {op!r}")

    def _as_asked(self, command: dict[str, Any]) -> bool:
        stats = self.stats()
        if "connects" in command and stats["counters"]["connects"] < command["connects"]:
            return False
        if "connected" in command and stats["connected"] != command["connected"]:
            return False
        return "in_rotation" not in command or stats["in_rotation"] == command["in_rotation"]


async def client_main(args: argparse.Namespace) -> None:
    answers = sys.stdout
    sys.stdout = sys.stderr  # the log lines; stdout carries only the answers
    observer = EventObserver()
    options = routing_options(args.mode, args.worker)
    routing = await build_routing(
        options,
        observer,
        tokenizer=BodyTokens() if args.mode == "kv" else None,
        authority=None if args.alone else Path(args.socket),
    )
    if args.alone:
        for worker in routing.fleet.workers:
            routing.fleet.set_in_rotation(worker, True)
    else:
        routing.start()
        await routing.checks.first_round()
    client = Client(routing, observer)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": client.stats()}), file=answers, flush=True)
    try:
        while line := await reader.readline():
            command = json.loads(line)
            if command["op"] == "quit":
                break
            print(json.dumps(await client.handle(command)), file=answers, flush=True)
    finally:
        await routing.aclose()


async def authority_main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    journal_file = open(args.journal, "a", buffering=1) if args.journal else None  # noqa: SIM115

    def journal(event: str, client: int, bid: int, worker: str) -> None:
        assert journal_file is not None
        journal_file.write(f"{event} {client} {bid} {worker}\n")

    answers = sys.stdout
    sys.stdout = sys.stderr

    def started(authority: BookingAuthority) -> None:
        admit_all(authority)
        print(json.dumps({"listening": args.socket}), file=answers, flush=True)

    native = None
    if args.mode == "kv" and not args.dynamo:
        from tests.router_ffi.fake_native import FakeNative

        fake = FakeNative()
        native = lambda: fake  # noqa: E731
    try:
        await run_authority(
            routing_options(args.mode, args.worker),
            Path(args.socket),
            EventObserver(),
            stop,
            native=native,
            journal=journal if journal_file is not None else None,
            started=started,
        )
    finally:
        if journal_file is not None:
            journal_file.close()


def admit_all(authority: BookingAuthority) -> None:
    """Every worker in rotation, as if its health checks had passed."""
    fleet = authority.fleet
    for worker in fleet.workers:
        worker.ever_in_rotation = True
        fleet.set_in_rotation(worker, True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.booking_processes")
    parser.add_argument("role", choices=("client", "authority"))
    parser.add_argument("--socket", default="")
    parser.add_argument("--alone", action="store_true", help="client: no authority")
    parser.add_argument("--dynamo", action="store_true", help="authority, kv: Dynamo's core")
    parser.add_argument("--mode", default="least-loaded")
    parser.add_argument("--worker", action="append", required=True)
    parser.add_argument("--journal", default=None)
    args = parser.parse_args()
    asyncio.run(client_main(args) if args.role == "client" else authority_main(args))


if __name__ == "__main__":
    main()

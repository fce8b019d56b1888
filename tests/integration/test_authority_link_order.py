"""`AuthorityLink` under uvloop (the loop pylon runs on), against an authority that speaks at once:
each connection is said once when it comes up (`booking_authority_connected`) and once when it
is lost (`booking_authority_lost`), whichever comes first of the authority's snapshot and the
link's own task resuming from the connect.

uvloop may read the snapshot a fresh connection brings before `AuthorityLink.run` resumes from
`create_unix_connection`: the per-connection state must then already be this connection's (a
link that reset it afterwards said nothing when that connection was lost, and nothing when the
next one came up while the last one's state was still set).

The authority here is a plain blocking socket in a thread (its own scheduling, not the link's
loop): it accepts, sends the snapshot at once, and closes `ROUNDS - 1` of the connections at
once, keeping the last one open; the link reconnects at once after a connection that served.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pylon.routing import booking_wire as wire
from pylon.routing.fleet import Fleet
from pylon.routing.remote import AuthorityLink
from pylon.routing.spec import parse_worker_spec
from tests.observers import EventObserver

uvloop = pytest.importorskip("uvloop")

ROUNDS = 100
SPECS = ["url=http://127.0.0.1:9", "url=http://127.0.0.1:10"]


class QuickAuthority:
    """Accepts on a Unix socket in a thread; each connection gets the snapshot at once."""

    def __init__(self, path: Path, snapshot: bytes) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self._listener.settimeout(5.0)
        self._snapshot = snapshot
        self.accepted = 0
        self.last: socket.socket | None = None
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self.accepted < ROUNDS:
                conn, _ = self._listener.accept()
                self.accepted += 1
                conn.sendall(self._snapshot)
                if self.accepted < ROUNDS:
                    conn.close()  # lost at once: the link reconnects at once
                else:
                    self.last = conn
        except BaseException as exc:  # the test says it, not a thread's traceback
            self.failed = exc

    def close(self) -> None:
        self._thread.join(timeout=6)
        if self.last is not None:
            self.last.close()
        self._listener.close()


async def _busy_loop() -> None:
    """Each loop turn held a moment (a busy serving process): the authority's snapshot is then
    there to read by the time the loop next polls, ahead of the link's task resuming."""
    while True:
        time.sleep(0.001)  # the point: the loop is busy
        await asyncio.sleep(0)


async def _scenario() -> None:
    path = Path(tempfile.mkdtemp(prefix="pylon-link-")) / "bookings.sock"
    specs = [parse_worker_spec(text) for text in SPECS]
    fleet = Fleet.from_specs(specs, None)
    snapshot = wire.encode(
        [wire.SNAPSHOT, [s.text() for s in specs], [w.label for w in fleet.workers], ["ok", "ok"]]
    )
    authority = QuickAuthority(path, snapshot)
    observer = EventObserver()
    link = AuthorityLink(path, fleet, observer)
    task = asyncio.create_task(link.run())
    hog = asyncio.create_task(_busy_loop())
    try:
        # Bounded: a link that fails to say a connection up waits for it in vain (and backs off
        # as from a silent socket); the sequence below then names what is missing.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                while (
                    len(observer.of("booking_authority_connected")) < ROUNDS
                    or len(observer.of("booking_authority_lost")) < ROUNDS - 1
                ):
                    await asyncio.sleep(0.01)
        assert authority.failed is None, authority.failed
        up = link.up and link.connected  # the last connection, kept open
    finally:
        task.cancel()
        hog.cancel()
        ended = await asyncio.gather(task, hog, return_exceptions=True)
        link.close()
        authority.close()
        shutil.rmtree(path.parent, ignore_errors=True)
    assert isinstance(ended[0], asyncio.CancelledError), ended
    # Each connection said once up and once lost, in turn; the last one still up.
    said = [k for k in observer.kinds() if k.startswith("booking_authority_")]
    assert said == ["booking_authority_connected", "booking_authority_lost"] * (ROUNDS - 1) + [
        "booking_authority_connected"
    ], said
    assert link.counters["connects"] == ROUNDS and link.counters["losses"] == ROUNDS - 1
    assert authority.accepted == ROUNDS and up


def test_every_connection_is_said_up_once_and_lost_once_under_uvloop() -> None:
    uvloop.run(_scenario())

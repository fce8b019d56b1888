"""The engine connections per upstream: kept alive, capped, reused newest first, reaped when idle.

Why not aiohttp or httpx: measured side by side (docs/benchmarks.md), their per-request CPU cost
dominated pylon's. Parsing stays in llhttp (httptools, `pylon.upstream.connection`); this module
only decides which connection an attempt runs on.

Per upstream (an engine or a worker URL) the pool keeps at most `max_connections` sockets open.
A request above the cap waits, first come first served, for a connection to come free, for at
most `queue_timeout` seconds; then it fails with `UpstreamBusy` (pylon answers 503, retryable:
the engine never saw the request). Waiting rather than refusing at once: engines queue anyway,
and a short burst above the cap should cost latency, not errors.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pylon.core.upstream import Upstream
from pylon.upstream.connection import (
    Attempt,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamConnection,
)

if TYPE_CHECKING:
    from pylon.core.plan import ForwardPlan


class _PerUpstream:
    """One upstream's connections: the idle ones, how many are open, who waits for one."""

    __slots__ = ("idle", "open", "upstream", "waiters")

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.idle: list[UpstreamConnection] = []  # oldest first; reuse takes the newest
        self.open = 0  # connections open or being opened (idle ones included)
        self.waiters: collections.deque[asyncio.Future[UpstreamConnection | None]] = (
            collections.deque()
        )


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """How many engine connections the pool opens and keeps, and how long it waits for them."""

    connect_timeout: float
    """Seconds to open one connection (`--upstream-connect-timeout`)."""
    idle_timeout: float
    """Seconds an idle kept-alive connection stays open (`--upstream-idle-timeout`)."""
    max_idle: int
    """Idle connections kept per upstream (`--upstream-max-idle`)."""
    max_connections: int = 1024
    """Open connections per upstream; requests above it wait (`--upstream-max-connections`)."""
    queue_timeout: float | None = None
    """Seconds a request waits for a free connection (`--upstream-queue-timeout`); None: the
    connect timeout."""
    head_timeout: float | None = None
    """Seconds from writing a request until the engine's response head
    (`--response-head-timeout`); None: no limit (tests only)."""


class UpstreamPool:
    def __init__(
        self, options: PoolOptions, *, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self._connect_timeout = options.connect_timeout
        self._idle_timeout = options.idle_timeout
        self._max_idle = options.max_idle
        self._max_connections = options.max_connections
        queue_timeout = options.queue_timeout
        self._queue_timeout = options.connect_timeout if queue_timeout is None else queue_timeout
        self._head_timeout = options.head_timeout
        # Keyed by the upstream's label (one per host, port and base path): a str hashes in C, an
        # Upstream in Python, and the pool looks upstreams up twice per request.
        self._upstreams: dict[str, _PerUpstream] = {}
        self._reaper: asyncio.TimerHandle | None = None

    def send_idle(self, plan: ForwardPlan) -> Attempt | None:
        """Write `plan` on an idle kept-alive connection to its upstream and return its attempt;
        None when there is no idle connection (then `send` opens or waits for one). Not a
        coroutine: under load almost every request finds an idle connection."""
        pool = self._per_upstream(plan)
        conn = self._take_idle(pool)
        return None if conn is None else conn.begin(plan)

    async def send(self, plan: ForwardPlan, *, fresh: bool = False) -> Attempt:
        """Write `plan` to its upstream; returns once written. Raises `UpstreamConnectError`.

        `fresh`: use a new connection, never an idle one (the retry of a stale-connection race).
        """
        pool = self._per_upstream(plan)
        conn = None if fresh else self._take_idle(pool)
        if conn is None:
            conn = await self._open(pool)
        return conn.begin(plan)

    def _per_upstream(self, plan: ForwardPlan) -> _PerUpstream:
        assert plan.upstream is not None, "a plan is routed before it is sent"
        upstream = plan.upstream
        pool = self._upstreams.get(upstream.label)
        if pool is None:
            pool = self._upstreams[upstream.label] = _PerUpstream(upstream)
        return pool

    def finish(self, attempt: Attempt) -> None:
        """Return the attempt's connection to its pool if it can run another, else close it."""
        conn = attempt.connection
        pool = self._upstreams[conn.upstream.label]
        if conn.end_attempt():
            self._hand_over(pool, conn)
            return
        conn.abort()
        self._closed(pool)

    def close(self) -> None:
        for pool in self._upstreams.values():
            for conn in pool.idle:
                conn.abort()
            pool.open -= len(pool.idle)
            pool.idle.clear()
            while pool.waiters:
                waiter = pool.waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    def open_connections(self, upstream: Upstream) -> int:
        pool = self._upstreams.get(upstream.label)
        return pool.open if pool is not None else 0

    def idle_connections(self, upstream: Upstream) -> int:
        pool = self._upstreams.get(upstream.label)
        return len(pool.idle) if pool is not None else 0

    # --- connections ---
    def _take_idle(self, pool: _PerUpstream) -> UpstreamConnection | None:
        # Engines behind uvicorn close idle connections after 5 s; never reuse one near that age,
        # so a request is rarely written into a connection the engine is closing (and the
        # stale-connection retry covers the rest).
        now = time.monotonic()
        idle = pool.idle
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._idle_timeout:
                return conn
            conn.abort()
            pool.open -= 1
        return None

    async def _open(self, pool: _PerUpstream) -> UpstreamConnection:
        if pool.open >= self._max_connections:
            handed = await self._wait_for_connection(pool)
            if handed is not None:
                return handed
        pool.open += 1
        upstream = pool.upstream
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: UpstreamConnection(self.loop, upstream, self._head_timeout),
                    upstream.host,
                    upstream.port,
                ),
                self._connect_timeout,
            )
        except (TimeoutError, OSError) as exc:
            self._closed(pool)
            raise UpstreamConnectError(
                f"cannot connect to engine at {upstream.label}: {exc.__class__.__name__}"
            ) from exc
        except BaseException:
            self._closed(pool)
            raise
        if conn.closed:
            # Reset between the handshake and the write: not a byte of the request left pylon.
            self._closed(pool)
            raise UpstreamConnectError(
                f"cannot connect to engine at {upstream.label}: reset before the request was "
                "written"
            )
        return conn

    async def _wait_for_connection(self, pool: _PerUpstream) -> UpstreamConnection | None:
        """Queue for a connection: a kept-alive one handed over, or None = room to open one."""
        waiter: asyncio.Future[UpstreamConnection | None] = self.loop.create_future()
        pool.waiters.append(waiter)
        try:
            async with asyncio.timeout(self._queue_timeout):
                handed = await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                # Served in the same instant the clock ran out: pass what we got on.
                late = waiter.result()
                if late is not None:
                    self._hand_over(pool, late)
                else:
                    self._closed(pool)
            raise UpstreamBusy(
                f"all {self._max_connections} connections to {pool.upstream.label} stayed busy "
                f"for {self._queue_timeout} s"
            ) from None
        finally:
            if waiter in pool.waiters:
                pool.waiters.remove(waiter)
        if handed is None:
            # A connection closed, so there is room: this waiter opens its own.
            pool.open -= 1  # `_closed` kept the slot for us; `_open` takes it again
        return handed

    def _hand_over(self, pool: _PerUpstream, conn: UpstreamConnection) -> None:
        """A kept-alive connection goes to the first waiter, else back to the idle set."""
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                conn.reused = True
                waiter.set_result(conn)
                return
        if len(pool.idle) < self._max_idle:
            conn.idle_since = time.monotonic()
            conn.reused = True
            pool.idle.append(conn)
            if self._reaper is None:
                self._arm_reaper()
            return
        conn.abort()
        self._closed(pool)

    def _closed(self, pool: _PerUpstream) -> None:
        """A connection is gone: its slot goes to the first waiter, if any, else is freed."""
        while pool.waiters:
            waiter = pool.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the waiter keeps the slot and opens a connection
                return
        pool.open -= 1

    # --- idle reaping ---
    def _arm_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = self.loop.call_later(self._idle_timeout, self._reap)

    def _reap(self) -> None:
        """Close connections idle for the idle timeout, so a burst's leftovers do not linger."""
        self._reaper = None
        cutoff = time.monotonic() - self._idle_timeout
        remaining = False
        for pool in self._upstreams.values():
            idle = pool.idle
            stale = 0
            while stale < len(idle) and (idle[stale].idle_since <= cutoff or idle[stale].closed):
                idle[stale].abort()
                stale += 1
            if stale:
                del idle[:stale]
                pool.open -= stale
            remaining = remaining or bool(idle)
        if remaining:
            self._arm_reaper()

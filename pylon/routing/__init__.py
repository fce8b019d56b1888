"""Which engine worker gets a request, and the booking that lives exactly as long as the exchange.

The proxy asks its `Router` for a `Booking` right before dispatch; the booking subscribes to
the exchange's moments (`pylon.core.hooks.ExchangeHooks`): it hears the first output (and,
where it counts output, how many output events followed) and is released by the exchange's
terminal moment: success, engine error, timeout, client cancel and shutdown all free it.

- `SingleUpstream` (`--routing off`, one `--upstream`, today's behaviour) is the default.
- `spec`: `--worker SPEC` parsed into a frozen `WorkerSpec`.
- `fleet`: the configured workers, which of them are in rotation (healthy), their bookings in
  flight, and `Fleet.replace`, the one way the catalogue changes while pylon serves;
  `catalogue`: where a changing catalogue comes from (`--workers-file`, watched and re-read on
  SIGHUP; `--discover-instances`, a Dynamo frontend's instances); `health`: the active health
  checks that eject and return to rotation workers; `outlier`: passive health, the same
  rotation fed by the workers' real answers.
- `round_robin`, `least_loaded`, `kv`: one router per mode, each behind the `Router` Protocol;
  `kv_watch`: the `kv` router's watch over each worker's KV-event sequence (gaps, restarts);
  `replica_sync`: with `--replica-peer`, the watch over each peer replica's booking events
  (counted per peer: applied, or dropped for a worker this pylon does not know).
- `build`: `build_routing(options, ...)`, the routing parts for `pylon.run.start`; the `kv`
  router's prompt tokens come through the `PromptTokenizer` port (`pylon.tokenize` implements it).
- `authority`: the booking authority, one process that owns the routing decision for all of a
  node's pylon processes (`run_authority`, on a private Unix socket); `remote`: the router of a
  process booked there (`RemoteRouter`, a mirror fleet whose rotation the authority pushes;
  `build_routing(..., authority=PATH)`); `booking_wire`: the frames between them.

docs/routing.md explains the modes, the worker spec and the booking lifetime.
"""

from __future__ import annotations

from typing import Protocol

from pylon.core.hooks import ExchangeHooks
from pylon.core.http import Header
from pylon.core.plan import ForwardPlan
from pylon.core.upstream import Upstream


class PromptTokenizer(Protocol):
    """The `kv` router's port to tokenization: a request's prompt as token ids."""

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None when the request has
        no prompt to route by (another route, or a body it cannot read)."""
        ...


class NoWorker(Exception):
    """No worker can take the request now; pylon answers 503 (retryable) without an engine."""


class Booking(ExchangeHooks, Protocol):
    """One exchange's claim on a worker: where it goes, and the accounting of its load.

    A booking subscribes to its exchange's moments (`ExchangeHooks`): `first_output` is the end
    of prefill, `output` the decode progress (only when `counts_output`), and `complete` or
    `rejected` its release, exactly once whatever ended the exchange.
    """

    @property
    def upstream(self) -> Upstream:
        """Where the pool sends the request."""
        ...

    @property
    def headers(self) -> tuple[Header, ...]:
        """Trusted headers pylon writes for this worker (e.g. a Dynamo worker pin)."""
        ...

    @property
    def worker(self) -> str:
        """How logs name the worker (its URL, or `instance-id=<id>`)."""
        ...

    @property
    def body(self) -> bytes | None:
        """The body for this worker when the router writes into it (`nvext.token_data`);
        None: the plan's own."""
        ...

    @property
    def counts_output(self) -> bool:
        """Whether the booking hears `output` (False spares the relay the counting on every
        output block)."""
        ...

    @property
    def quiet(self) -> bool:
        """True when every hook is a no-op (nothing to account): the exchange does not
        subscribe it at all."""
        ...


class Router(Protocol):
    async def book(self, plan: ForwardPlan) -> Booking:
        """Choose a worker for `plan` and reserve it; raises `NoWorker`.

        A coroutine so that work which can take milliseconds (the `kv` router tokenizing a
        large prompt) leaves the event loop; choosing itself is a computation over what the
        router already knows (loads, cache views), never a wait for a worker: a request that
        no worker can take now is answered at once (503 retryable), and waiting for a
        connection to the chosen worker is the pool's job."""
        ...

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        """A booking on another worker than `failed`'s, for a request that provably never
        reached it (the connection was refused or reset before any byte was written); None
        when no other worker in rotation can take it. At once, never a wait."""
        ...


class StaticBooking(ExchangeHooks):
    """A booking with nothing to account: one fixed upstream, shared by every request."""

    __slots__ = ("headers", "upstream", "worker")
    counts_output = False
    quiet = True
    body = None

    def __init__(self, upstream: Upstream, headers: tuple[Header, ...] = ()) -> None:
        self.upstream = upstream
        self.headers = headers
        self.worker = upstream.label


class SingleUpstream:
    """Every request goes to the one configured engine (`--routing off`)."""

    __slots__ = ("_booking",)

    def __init__(self, upstream: Upstream) -> None:
        self._booking = StaticBooking(upstream)

    async def book(self, plan: ForwardPlan) -> Booking:
        return self._booking

    def elsewhere(self, plan: ForwardPlan, failed: Booking) -> Booking | None:
        return None  # the one engine


_: type[Router] = SingleUpstream
__: type[Booking] = StaticBooking

"""Which engine worker gets a request, and the booking that lives exactly as long as the exchange.

The proxy asks its `Router` for a `Booking` right before dispatch, tells the booking when the
first output arrives (and, where the booking counts output, how many output events followed),
and releases it in the forwarding `finally`: success, engine error, timeout, client cancel and
shutdown all free it.

- `SingleUpstream` (`--routing off`, one `--upstream`, today's behaviour) is the default.
- `spec`: `--worker SPEC` parsed into a frozen `WorkerSpec`.
- `fleet`: the configured workers, which of them are admitted (healthy), their bookings in
  flight; `health`: the active health checks that eject and re-admit workers.
- `round_robin`, `least_loaded`, `kv`: one router per mode, each behind the `Router` Protocol;
  `kv_watch`: the `kv` router's watch over each worker's KV-event sequence (gaps, restarts).
- `build`: `build_routing(options, ...)`, the routing parts for `pylon.run.start`; the `kv`
  router's prompt tokens come through the `Tokenizer` port (`pylon.tokenize` implements it).

docs/routing.md explains the modes, the worker spec and the booking lifetime.
"""

from __future__ import annotations

from typing import Protocol

from pylon.core.http import Header
from pylon.core.plan import ForwardPlan
from pylon.core.target import UpstreamTarget


class Tokenizer(Protocol):
    """The `kv` router's port to tokenization: a request's prompt as token ids."""

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as the engine will see them, or None when the request has
        no prompt to route by (another route, or a body it cannot read)."""
        ...


class NoWorker(Exception):
    """No worker can take the request now; pylon answers 503 (retryable) without an engine."""


class Booking(Protocol):
    """One request's claim on a worker."""

    @property
    def target(self) -> UpstreamTarget:
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
        """Whether the relay should report output (`output_tokens`); False spares the relay
        the counting on every output block."""
        ...

    def first_output(self) -> None:
        """Prefill is done: the engine produced its first output (or its response head)."""
        ...

    def output_tokens(self, count: int) -> None:
        """`count` more output tokens were relayed (for decode-load accounting)."""
        ...

    def release(self, outcome: str) -> None:
        """The exchange is over. Called exactly once per booking; a second call is a no-op."""
        ...


class Router(Protocol):
    def book(self, plan: ForwardPlan) -> Booking:
        """Choose a worker for `plan` and reserve it; raises `NoWorker`.

        Synchronous: choosing is a computation over what the router already knows (loads, cache
        views), never a wait; a request that no worker can take now is answered at once (503
        retryable), and waiting for a connection to the chosen worker is the pool's job."""
        ...


class StaticBooking:
    """A booking with nothing to account: one fixed target, shared by every request."""

    __slots__ = ("headers", "target", "worker")
    counts_output = False
    body = None

    def __init__(self, target: UpstreamTarget, headers: tuple[Header, ...] = ()) -> None:
        self.target = target
        self.headers = headers
        self.worker = target.label

    def first_output(self) -> None:
        return None

    def output_tokens(self, count: int) -> None:
        return None

    def release(self, outcome: str) -> None:
        return None


class SingleUpstream:
    """Every request goes to the one configured engine (`--routing off`)."""

    __slots__ = ("_booking",)

    def __init__(self, target: UpstreamTarget) -> None:
        self._booking = StaticBooking(target)

    def book(self, plan: ForwardPlan) -> Booking:
        return self._booking


_: type[Router] = SingleUpstream
__: type[Booking] = StaticBooking

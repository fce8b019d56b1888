"""Passive health: a worker whose real answers keep failing leaves rotation for a while.

The active checks (`pylon.routing.health`) ask `/health`; a worker can pass them and still
fail every request (a broken model, a wedged scheduler). Such a worker answers fastest, so it
looks idle to `least-loaded` and draws most of the traffic. Outlier detection, as Envoy does it
(`consecutive_5xx`, `consecutive_local_origin_failure`; nginx's `max_fails`/`fail_timeout`),
judges each worker by what its bookings saw:

- a failure: a 5xx response head other than 503 (503 is an engine's own admission refusal:
  busy, not broken, and its load is the routers' business), or no response head at all because
  the worker could not be reached, broke the exchange or timed out;
- a failure too: a response that began well (any other head) and then broke: its body cut, its
  event stream ended before any output or inside an event, or its output stopped (a worker
  that answers `200` and then always fails must leave rotation like one that answers `500`);
- a success: any other response, once it is over (a 4xx is the client's fault, not the
  worker's); a response the client left is neither.

`consecutive` failures in a row eject the worker for `base_ejection` seconds, doubled on each
ejection that follows the last one without a success in between, at most `max_ejection`. Then
it returns to rotation on probation: its first answer decides, a success forgives it (the next
ejection starts from `base_ejection` again), a failure ejects it again at once, for longer.

At most `max_ejected_share` of the fleet (and at least one worker, never the last one in
rotation) is ejected by this at once: a fault that hits every worker (a bad request mix, an
overloaded node) must not empty the fleet. A worker held in rotation by the cap is reported
once, until it is ejected or succeeds.

`OutlierDetector` is the sans-I/O rule (time passed in; unit tests drive it with a clock of
their own); `pylon.routing.passive.PassiveHealth` applies it to a fleet.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a worker failed one exchange (the ejection's `reason`, a metric label).
STATUS_5XX = "status_5xx"
CONNECT_FAILURE = "connect_failure"
BROKEN = "broken"
TIMEOUT = "timeout"
REASONS = (STATUS_5XX, CONNECT_FAILURE, BROKEN, TIMEOUT)
# The exchange outcome of a failure with no response head (`pylon.core.errors.ErrorCode`
# values), and the reason it counts as; any other outcome says nothing about the worker.
UNANSWERED = {
    "upstream_unavailable": CONNECT_FAILURE,
    "upstream_protocol_error": BROKEN,
    "upstream_timeout": TIMEOUT,
}
# The exchange outcome of a response that began with a head that was no failure and then broke
# (`pylon.proxy.forwarding`: a cut body, an event stream ended short, output that stopped).
BROKEN_AFTER_HEAD = {
    "upstream_broken_mid_body": BROKEN,
    "upstream_protocol_error": BROKEN,
    "upstream_timeout": TIMEOUT,
}


def failure_of_status(status: int) -> str | None:
    """The failure a response head with `status` is, or None (a success)."""
    return STATUS_5XX if status >= 500 and status != 503 else None


def failure_after_head(outcome: str) -> str | None:
    """The failure a response whose head was no failure and that ended with `outcome` is, or
    None (`ok`: a success; the client left: nothing the worker did)."""
    return BROKEN_AFTER_HEAD.get(outcome)


def failure_of_outcome(outcome: str) -> str | None:
    """The failure an exchange that ended with `outcome` and no response head is, or None
    (the client left, pylon was busy or stopped: nothing the worker did)."""
    return UNANSWERED.get(outcome)


@dataclass(frozen=True, slots=True)
class OutlierOptions:
    """When a worker's failing answers eject it, for how long, and how much of the fleet may be
    ejected at once."""

    consecutive: int
    """Failures in a row that eject a worker (`--worker-outlier-failures`); 0: never."""
    base_ejection: float
    """Seconds of the first ejection (`--worker-outlier-ejection`)."""
    max_ejection: float
    """The longest ejection, however often it repeats (`--worker-outlier-max-ejection`)."""
    max_ejected_share: float
    """The share of the fleet ejected at once, 0..1 (`--worker-outlier-max-percent`);
    at least one worker, never the last one in rotation."""


class OutlierState:
    """One worker's passive-health state (`Worker.outlier`)."""

    __slots__ = ("ejected", "ejections", "failures", "held", "probation", "seconds", "until")

    def __init__(self) -> None:
        self.failures = 0  # failures in a row
        self.ejections = 0  # ejections since the last success
        self.ejected = False
        self.until = 0.0  # when the current ejection ends
        self.seconds = 0.0  # how long the current (or last) ejection is
        self.probation = False  # returned, and no answer since
        self.held = False  # the cap kept it in rotation (reported once)


@dataclass(frozen=True, slots=True)
class Ejection:
    """Eject the worker now, until `until` (`seconds` from now); its `ejections`-th in a row."""

    reason: str
    failures: int
    seconds: float
    until: float
    ejections: int


@dataclass(frozen=True, slots=True)
class Held:
    """The worker is due for ejection, but the cap keeps it in rotation (`ejected` of `cap`)."""

    reason: str
    failures: int
    ejected: int
    cap: int


class OutlierDetector:
    """The rule over one fleet of `size` workers (see the module docstring). Pure: the caller
    passes the time and how many workers are in rotation."""

    __slots__ = ("_base", "_consecutive", "_max", "_share", "cap", "ejected")

    def __init__(self, options: OutlierOptions, size: int) -> None:
        self._consecutive = options.consecutive
        self._base = options.base_ejection
        self._max = options.max_ejection
        self._share = options.max_ejected_share
        self.cap = 0
        self.resize(size)
        self.ejected = 0  # workers ejected now

    def resize(self, size: int) -> None:
        """The fleet has `size` workers now (a catalogue change): the cap follows."""
        # Envoy's max_ejection_percent: at least one, whatever the share; never the whole fleet.
        self.cap = min(size - 1, max(1, int(size * self._share)))

    def forget(self, state: OutlierState) -> None:
        """The worker left the fleet: an ejection of it no longer counts against the cap."""
        if state.ejected:
            self.ejected -= 1

    @property
    def enabled(self) -> bool:
        return self._consecutive > 0 and self.cap > 0

    def success(self, state: OutlierState) -> None:
        """The worker answered: its failures are forgiven (a returned worker is back for good)."""
        state.failures = 0
        state.ejections = 0
        state.probation = False
        state.held = False

    def failure(
        self, state: OutlierState, reason: str, now: float, in_rotation: int
    ) -> Ejection | Held | None:
        """One more failure: an `Ejection` when it is due and allowed, `Held` (once) when the
        cap forbids it, else None. `in_rotation`: workers in rotation now."""
        if state.ejected or not self.enabled:
            return None  # an answer from before the ejection: it is out already
        state.failures += 1
        if state.failures < self._consecutive and not state.probation:
            return None
        if self.ejected >= self.cap or in_rotation <= 1:
            if state.held:
                return None
            state.held = True
            return Held(reason, state.failures, self.ejected, self.cap)
        seconds = min(self._max, self._base * 2.0 ** min(state.ejections, 64))
        state.ejections += 1
        state.ejected = True
        state.probation = state.held = False
        state.seconds = seconds
        state.until = now + seconds
        self.ejected += 1
        return Ejection(reason, state.failures, seconds, state.until, state.ejections)

    def due(self, state: OutlierState, now: float) -> bool:
        """The worker's ejection is over at `now`."""
        return state.ejected and now >= state.until

    def returned(self, state: OutlierState) -> None:
        """The worker is back in rotation, on probation: its next failure ejects it again."""
        if state.ejected:
            state.ejected = False
            state.failures = 0
            state.probation = True
            self.ejected -= 1

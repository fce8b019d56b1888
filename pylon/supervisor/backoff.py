"""The restart policy: whether the supervisor restarts a process that exited (`halt_status`),
and after how long (`Backoff`: `RESTART_FIRST` doubling to `RESTART_CAP`, back to the first
delay once a process stayed up `RESTART_RESET_AFTER`). Pure: time comes in as the uptime."""

from __future__ import annotations

from dataclasses import dataclass, field

RESTART_FIRST = 0.5  # seconds before the first restart
RESTART_CAP = 30.0  # seconds: the longest wait between two restarts
RESTART_RESET_AFTER = 60.0  # seconds up after which a process counts as healthy again


@dataclass
class Backoff:
    """The restart delays of one process slot."""

    first: float = RESTART_FIRST
    cap: float = RESTART_CAP
    reset_after: float = RESTART_RESET_AFTER
    _next: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError("backoff needs 0 < first <= cap")
        self._next = self.first

    def after_exit(self, uptime: float) -> float:
        """The delay before restarting a process that ran `uptime` seconds: a process that had
        stayed up `reset_after` starts the sequence afresh (one crash a day is no crash loop)."""
        if uptime >= self.reset_after:
            self._next = self.first
        delay = self._next
        self._next = min(self.cap, delay * 2)
        return delay


EXIT_ENGINE_NOT_READY = 1  # as `pylon serve`: the engine never passed its health gate
EXIT_START_REFUSED = 2  # as `pylon serve`: the start is refused (`StartupError`)


def halt_status(status: int, *, ever_ready: bool) -> int | None:
    """The exit status that ends the node instead of a restart (None: restart). A start
    refused (2): the same refusal would come again (gunicorn halts on a worker's boot error
    too). An engine that never passed its health gate (1) while the slot was never ready: the
    node's first start ends as one `pylon serve` would; once the slot was ready, the engine
    may come back, and the restart waits for it. Anything else (a crash, a signal) restarts."""
    if status == EXIT_START_REFUSED:
        return EXIT_START_REFUSED
    if status == EXIT_ENGINE_NOT_READY and not ever_ready:
        return EXIT_ENGINE_NOT_READY
    return None

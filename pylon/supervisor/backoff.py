"""How long the supervisor waits before it restarts a process that exited: exponential backoff
(`RESTART_FIRST` doubling to `RESTART_CAP`), back to the first delay once a process stayed up
`RESTART_RESET_AFTER`. Pure: time comes in as the process's uptime."""

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

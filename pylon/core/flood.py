"""Per-connection flood guards (rapid reset, PING/SETTINGS floods): pure, the clock passed in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RateGuard:
    """Trips once more than `limit` events land in one `window` (seconds). `limit` 0 = off.

    Fixed windows, not a sliding log: O(1) per event, and a burst straddling a boundary can get
    at most twice the limit through, which is still bounded.
    """

    limit: int
    window: float
    _started: float = float("-inf")
    _count: int = 0

    def hit(self, now: float) -> bool:
        if not self.limit:
            return False
        if now - self._started >= self.window:
            self._started = now
            self._count = 0
        self._count += 1
        return self._count > self.limit

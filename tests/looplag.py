"""A loop-lag probe: how long the event loop went without running a ready task.

`LoopLag.watch()` ticks once per loop turn (`sleep(0)`, no clock in the way) and keeps the
longest gap between two ticks; a reader that never yields shows up as one long gap. It also
checks a condition on every tick, so a test waits for the flood to be fully read without a
fixed sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class LoopLag:
    def __init__(self) -> None:
        self.max_gap = 0.0
        self.ticks = 0

    async def until(self, condition: Callable[[], bool], timeout: float) -> float:
        """Tick until `condition()` holds (at most `timeout` s); returns the time it took."""
        start = last = time.perf_counter()
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0)
                now = time.perf_counter()
                self.max_gap = max(self.max_gap, now - last)
                self.ticks += 1
                last = now
        return time.perf_counter() - start

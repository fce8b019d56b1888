"""How often one fault may write a log line: pure, the clock passed in.

A fault that repeats with its input (a malformed KV-event message, a sequence gap, an engine
that fails every request, a client's protocol error) would otherwise write a line per
occurrence: hundreds of thousands of lines for a few seconds of a hostile or broken peer. Its
counters (metrics) stay exact; only the lines are held back.
"""

from __future__ import annotations

from collections.abc import Hashable

# Keys past this many share one slot (`OVERFLOW`): the sources are workers, endpoints and
# transports, so a process has a few dozen; this only bounds the memory if that ever changes.
MAX_KEYS = 1024
OVERFLOW = ("_overflow",)


class LogRate:
    """Per key (an event and its source): the first line goes out at once, then at most one per
    `interval` seconds. `admit(key, now)` is None for a line to hold back, or else the number of
    lines of that key held back since the last one written (0 for the first), which the caller
    writes on the line as `suppressed`. With `burst` > 1, that many lines per interval go out
    before any is held back (lines of one call site that name different things, such as the
    workers a fleet adds at its start).

    O(1) per line. Lines held back at the end of a burst are reported by the next line of the
    same key, whenever that comes; the counters have them all meanwhile.
    """

    __slots__ = ("_next_prune", "_slots", "burst", "interval", "max_keys")

    def __init__(self, interval: float, max_keys: int = MAX_KEYS, burst: int = 1) -> None:
        self.interval = interval
        self.max_keys = max_keys
        self.burst = burst
        # key -> [next window from, held back, lines the window still allows]
        self._slots: dict[Hashable, list[float]] = {}
        self._next_prune = float("-inf")  # a full table is swept at most once per interval

    def admit(self, key: Hashable, now: float) -> int | None:
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self.max_keys and key != OVERFLOW:
                if now >= self._next_prune:
                    self._next_prune = now + self.interval
                    self._prune(now)
                if len(self._slots) >= self.max_keys:
                    return self.admit(OVERFLOW, now)  # one more slot at most: the overflow's
            self._slots[key] = [now + self.interval, 0, self.burst - 1]
            return 0
        if now < slot[0]:
            if slot[2] > 0:  # the window's burst (nothing was held back yet in it)
                slot[2] -= 1
                return 0
            slot[1] += 1
            return None
        held = int(slot[1])
        slot[0] = now + self.interval
        slot[1] = 0
        slot[2] = self.burst - 1
        return held

    def _prune(self, now: float) -> None:
        """Forget the keys whose next line would go out at once with nothing held back: they
        behave exactly as unseen keys do, so forgetting them loses nothing."""
        for key in [k for k, (due, held, _) in self._slots.items() if due <= now and not held]:
            del self._slots[key]

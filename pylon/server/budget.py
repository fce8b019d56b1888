"""How many request-body bytes pylon holds at once: per connection and for the whole process.

Request bodies are buffered whole (pylon must inspect them before the engine sees a byte), so
without these bounds many concurrent streams could each hold the largest allowed body. The stream
table takes bytes from both budgets as they arrive and gives them back when the request is
answered, cancelled or done; a request that would overdraw either is answered 503
`body_budget_exceeded` (retryable: another node may have room).
"""

from __future__ import annotations


class BodyBudget:
    """A byte budget shared by everything that holds request bodies in this process."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> bool:
        """Reserve `size` bytes; False (and nothing reserved) if that would overdraw."""
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size

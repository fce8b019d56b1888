"""Observers for tests that need to know what pylon did: with each request, or in the process."""

from __future__ import annotations

import asyncio
from typing import Any

from pylon.core.errors import PylonError
from pylon.core.record import RequestRecord
from pylon.observe import LogObserver


class SeenObserver(LogObserver):
    """Notes every request the intake admitted, or answered itself, by request id."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str | None]] = []
        self.admitted_event = asyncio.Event()

    def admitted(self, record: RequestRecord) -> None:
        self.seen.append(("admitted", record.request_id))
        self.admitted_event.set()

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        self.seen.append(("rejected", record.request_id))

    def ids(self) -> set[str | None]:
        return {request_id for _, request_id in self.seen}


class EventObserver(LogObserver):
    """Keeps every process event (`kind`, fields), so a test can wait for one instead of the
    clock: a discovery poll, a model published, the health gate passing."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    def process_event(self, kind: str, /, **fields: Any) -> None:
        super().process_event(kind, **fields)
        self.events.append((kind, fields))
        self._changed.set()

    def mark(self) -> int:
        """Where the events are now: `wait_for(..., after=mark)` only sees later ones."""
        return len(self.events)

    def kinds(self, after: int = 0) -> list[str]:
        return [kind for kind, _ in self.events[after:]]

    def of(self, kind: str, after: int = 0) -> list[dict[str, Any]]:
        return [fields for seen, fields in self.events[after:] if seen == kind]

    async def wait_for(
        self, kind: str, after: int = 0, timeout: float = 5.0, **match: Any
    ) -> dict[str, Any]:
        """The first `kind` event at or after index `after` whose fields include `match`."""
        async with asyncio.timeout(timeout):
            while True:
                for seen, fields in self.events[after:]:
                    if seen == kind and all(fields.get(k) == v for k, v in match.items()):
                        return fields
                self._changed.clear()
                await self._changed.wait()

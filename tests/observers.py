"""An observer for tests that need to know what pylon's intake did with each request."""

from __future__ import annotations

import asyncio

from pylon.core.errors import PylonError
from pylon.observe import LogObserver, RequestRecord


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

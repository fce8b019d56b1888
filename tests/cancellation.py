"""Shared by the transport tests: how long after the client left did the engine see it go?"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def cancellation_lag(
    control: Callable[[], Awaitable[dict[str, Any]]], since: float, polls: int = 100
) -> float:
    """Poll mock_dynamo's /test-control until its latest request records `cancelled_at`.

    Returns seconds between `since` (a `time.time()` taken when the client left) and that
    moment; fails the test if the engine never saw the cancellation within `polls` x 20 ms.
    """
    record: dict[str, Any] = {}
    for _ in range(polls):
        record = (await control())["requests"][-1]
        if record["cancelled_at"] is not None:
            break
        await asyncio.sleep(0.02)
    assert record["cancelled_at"] is not None, "the engine never saw the cancellation"
    return float(record["cancelled_at"]) - since

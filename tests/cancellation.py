"""Shared by the transport tests: what reached mock_dynamo, and when did the engine see the
client go?"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

# Extra client-side allowance on top of the long poll's own timeout, so the mock's 408
# (with its explanation) arrives before httpx gives up on the read.
_CLIENT_SLACK_S = 5.0


async def wait_for_record(
    client: httpx.AsyncClient,
    mock_base_url: str,
    request_id: str,
    event: str,
    timeout: float = 5.0,
) -> dict[str, Any]:
    """The record of the latest request with `x-request-id: request_id` once `event`
    (received, completed, cancelled or finished) has happened to it.

    Long-polls mock_dynamo's `/test-control/wait` (timeout at most 30 s) and fails the test
    with what the engine did see if the event does not come in time.
    """
    reply = await client.get(
        f"{mock_base_url.rstrip('/')}/test-control/wait",
        params={"request_id": request_id, "event": event, "timeout": repr(float(timeout))},
        timeout=timeout + _CLIENT_SLACK_S,
    )
    if reply.status_code == 408:
        record = reply.json().get("record")
        if record is None:
            pytest.fail(
                f"mock_dynamo never received a request with x-request-id {request_id!r} "
                f"within {timeout:g} s (waiting for {event!r})"
            )
        pytest.fail(
            f"mock_dynamo received x-request-id {request_id!r} but did not see it {event} "
            f"within {timeout:g} s; its record: status={record['status']} "
            f"completed_at={record['completed_at']} cancelled_at={record['cancelled_at']} "
            f"{record['method']} {record['raw_path']}"
        )
    assert reply.status_code == 200, (
        f"/test-control/wait answered {reply.status_code}: {reply.text}"
    )
    result: dict[str, Any] = reply.json()
    return result


async def cancellation_lag_for(
    client: httpx.AsyncClient,
    mock_base_url: str,
    request_id: str,
    since: float,
    timeout: float = 5.0,
) -> float:
    """Seconds between `since` (a `time.time()` taken when the client left) and the moment
    mock_dynamo saw the request with `x-request-id: request_id` cancelled.

    Fails the test if the request finished normally instead, or never finished in time.
    """
    record = await wait_for_record(client, mock_base_url, request_id, "finished", timeout)
    if record["cancelled_at"] is None:
        pytest.fail(
            f"the engine never saw x-request-id {request_id!r} cancelled: it completed at "
            f"{record['completed_at']} with status {record['status']}"
        )
    return float(record["cancelled_at"]) - since


async def cancellation_lag(
    control: Callable[[], Awaitable[dict[str, Any]]], since: float, polls: int = 100
) -> float:
    """Poll mock_dynamo's /test-control until its latest request records `cancelled_at`.

    Returns seconds between `since` (a `time.time()` taken when the client left) and that
    moment; fails the test if the engine never saw the cancellation within `polls` x 20 ms.
    Prefer `cancellation_lag_for` when the request carries an `x-request-id`.
    """
    record: dict[str, Any] = {}
    for _ in range(polls):
        record = (await control())["requests"][-1]
        if record["cancelled_at"] is not None:
            break
        await asyncio.sleep(0.02)
    assert record["cancelled_at"] is not None, "the engine never saw the cancellation"
    return float(record["cancelled_at"]) - since

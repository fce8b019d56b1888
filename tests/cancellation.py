"""Shared by the transport tests: what reached mock_dynamo, and when did the engine see the
client go?"""

from __future__ import annotations

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


# What the engine may lag behind the client, on top of its own pacing: the event loop (test
# client, pylon and mock_dynamo share it) and a busy 2-core CI runner. Far below any stream the
# cancellation tests start, so a cancel that only came at the stream's end can never pass.
CANCEL_SLACK_S = 0.4


def prompt_cancel_bound(token_delay_ms: float, stream_s: float) -> float:
    """The longest the engine may take to see a client leave, relative to the workload.

    Two token delays (pylon may notice the loss only at its next relay of a token; the engine
    only between two tokens) plus `CANCEL_SLACK_S`. Fails the test if the bound is not far
    below `stream_s`, the time the stream would take to complete: then it would prove nothing.
    """
    bound = 2 * token_delay_ms / 1000 + CANCEL_SLACK_S
    assert bound * 10 <= stream_s, (
        f"a {stream_s:g} s stream is too short to tell a cancel within {bound:g} s from "
        "a stream that ran to its end; give the engine more tokens"
    )
    return bound


async def assert_cancelled_promptly(
    client: httpx.AsyncClient,
    mock_base_url: str,
    request_id: str,
    left_at: float,
    timeout: float = 5.0,
) -> float:
    """The engine saw `request_id` cancelled, not completed, within `prompt_cancel_bound` of
    `left_at` (a `time.time()` taken when the client left). Returns the lag in seconds.

    The bound comes from mock_dynamo's own knobs and the request's `max_tokens`, so it follows
    the workload the test configured.
    """
    record = await wait_for_record(client, mock_base_url, request_id, "finished", timeout)
    if record["cancelled_at"] is None:
        pytest.fail(
            f"the engine never saw x-request-id {request_id!r} cancelled: it completed at "
            f"{record['completed_at']} with status {record['status']}"
        )
    reply = await client.get(f"{mock_base_url.rstrip('/')}/test-control")
    reply.raise_for_status()
    knobs: dict[str, Any] = reply.json()["knobs"]
    tokens = int(knobs["num_tokens"])
    body = record["body"]
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int):
        tokens = min(tokens, body["max_tokens"])
    delay_ms = float(knobs["token_delay_ms"])
    stream_s = (float(knobs["ttft_ms"]) + tokens * delay_ms) / 1000
    bound = prompt_cancel_bound(delay_ms, stream_s)
    lag = float(record["cancelled_at"]) - left_at
    assert lag < bound, (
        f"the engine saw x-request-id {request_id!r} cancelled {lag * 1000:.0f} ms after the "
        f"client left; allowed: {bound * 1000:.0f} ms (2 x {delay_ms:g} ms token delay + "
        f"{CANCEL_SLACK_S * 1000:.0f} ms) of a {stream_s:g} s stream"
    )
    return lag

"""/test-control: recording, reset and knobs."""

from __future__ import annotations

import httpx

from mock_dynamo.server import MockServer
from tests.mock_dynamo.conftest import MakeMock, raw_exchange, snapshot

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}


async def test_headers_recorded_exactly_as_on_the_wire(
    mock: MockServer, client: httpx.AsyncClient
) -> None:
    body = b'{"model":"mock-model","prompt":"x","max_tokens":1}'
    request = (
        b"POST /v1/completions HTTP/1.1\r\n"
        b"Host: 127.0.0.1\r\n"
        b"X-Dup: one\r\n"
        b"x-MIXED-case: Value With Spaces\r\n"
        b"x-dup: two\r\n"
        b"X-Dup: one\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n"
        b"Connection: close\r\n\r\n" + body
    )
    reply = await raw_exchange(mock.port, request)
    assert reply.startswith(b"HTTP/1.1 200")
    record = (await snapshot(client))["requests"][-1]
    assert record["headers"] == [
        ["Host", "127.0.0.1"],
        ["X-Dup", "one"],
        ["x-MIXED-case", "Value With Spaces"],
        ["x-dup", "two"],
        ["X-Dup", "one"],
        ["Content-Type", "application/json"],
        ["Content-Length", str(len(body))],
        ["Connection", "close"],
    ]
    assert record["body"] == {"model": "mock-model", "prompt": "x", "max_tokens": 1}
    assert record["method"] == "POST" and record["path"] == "/v1/completions"
    assert record["model"] == "mock-model" and record["status"] == 200


async def test_httpx_header_list_order_and_duplicates(client: httpx.AsyncClient) -> None:
    headers = [("X-Trace", "a"), ("x-trace", "b"), ("X-Other", "c")]
    await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    record = (await snapshot(client))["requests"][-1]
    sent = [h for h in record["headers"] if h[0].lower() in ("x-trace", "x-other")]
    assert sent == [["X-Trace", "a"], ["x-trace", "b"], ["X-Other", "c"]]


async def test_records_all_requests_but_not_control(client: httpx.AsyncClient) -> None:
    await client.get("/health")
    await client.get("/v1/models")
    await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    await client.post("/v1/chat/completions", content=b"garbage")
    await client.get("/no/such/route")
    await client.put("/test-control/knobs", json={})
    snap = await snapshot(client)
    records = snap["requests"]
    assert [(r["method"], r["path"], r["status"]) for r in records] == [
        ("GET", "/health", 200),
        ("GET", "/v1/models", 200),
        ("POST", "/v1/chat/completions", 404),
        ("POST", "/v1/chat/completions", 400),
        ("GET", "/no/such/route", 404),
    ]
    assert records[3]["body"] is None
    assert all(r["received_at"] <= r["completed_at"] and r["cancelled_at"] is None for r in records)
    counters = snap["counters"]
    assert counters["total"] == 5 and counters["cancelled"] == 0
    assert counters["by_endpoint"] == {
        "/health": 1,
        "/v1/models": 1,
        "/v1/chat/completions": 2,
        "<unmatched>": 1,
    }
    last = snap["last_by_endpoint_model"]
    assert last["/v1/chat/completions|nope"]["status"] == 404
    assert last["/v1/chat/completions|"]["status"] == 400
    assert last["/health|"]["path"] == "/health"


async def test_reset_clears_records_and_faults_not_knobs(client: httpx.AsyncClient) -> None:
    await client.put("/test-control/knobs", json={"num_tokens": 2})
    await client.put("/test-control/faults", json=[{"status": 503}])
    await client.get("/health")
    assert (await client.post("/test-control/reset")).status_code == 200
    snap = await snapshot(client)
    assert snap["requests"] == [] and snap["faults"] == []
    assert snap["counters"] == {"total": 0, "by_endpoint": {}, "cancelled": 0}
    assert snap["last_by_endpoint_model"] == {}
    assert snap["knobs"]["num_tokens"] == 2
    assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_knobs_partial_update_applies_at_run_time(client: httpx.AsyncClient) -> None:
    resp = await client.put("/test-control/knobs", json={"num_tokens": 3})
    assert resp.json() == {
        "ttft_ms": 0.0,
        "token_delay_ms": 0.0,
        "num_tokens": 3,
        "prefill_tokens_per_s": 0.0,
    }
    body = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert body["usage"]["completion_tokens"] == 3
    await client.put("/test-control/knobs", json={"ttft_ms": 5, "token_delay_ms": 1.5})
    assert (await snapshot(client))["knobs"] == {
        "ttft_ms": 5,
        "token_delay_ms": 1.5,
        "num_tokens": 3,
        "prefill_tokens_per_s": 0.0,
    }


async def test_invalid_knobs_rejected_atomically(client: httpx.AsyncClient) -> None:
    for bad in (
        {"num_tokens": -1},
        {"num_tokens": True},
        {"ttft_ms": "x"},
        {"speed": 1},
        [1],
        {"num_tokens": 4, "ttft_ms": -1},
    ):
        assert (await client.put("/test-control/knobs", json=bad)).status_code == 400
    assert (await client.put("/test-control/knobs", content=b"{")).status_code == 400
    assert (await snapshot(client))["knobs"]["num_tokens"] == 16


async def test_capacity_bounds_the_record_deque(make_mock: MakeMock) -> None:
    server = await make_mock(capacity=3)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        for i in range(5):
            await c.get("/health", headers={"x-i": str(i)})
        snap = await snapshot(c)
    assert [dict(r["headers"])["x-i"] for r in snap["requests"]] == ["2", "3", "4"]
    assert snap["counters"]["total"] == 5

"""PUT /test-control/models and /test-control/health, and what a reset restores."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.mock_dynamo.conftest import MakeMock, snapshot

HEALTHY = {"status": 200, "delay_ms": 0, "ready_status": 404}


def _chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def _model_ids(client: httpx.AsyncClient) -> list[str]:
    reply = await client.get("/v1/models")
    assert reply.status_code == 200
    return [m["id"] for m in reply.json()["data"]]


async def test_models_change_models_list_404s_and_health(client: httpx.AsyncClient) -> None:
    reply = await client.put("/test-control/models", json={"models": ["a", "b"]})
    assert reply.status_code == 200 and reply.json() == {"models": ["a", "b"]}
    assert await _model_ids(client) == ["a", "b"]
    assert (await client.post("/v1/chat/completions", json=_chat("b"))).status_code == 200
    gone = await client.post("/v1/chat/completions", json=_chat("mock-model"))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == 404
    health = (await client.get("/health")).json()
    assert health == {"status": "healthy", "flavor": "dynamo", "models": ["a", "b"]}
    assert (await snapshot(client))["models"] == ["a", "b"]


async def test_empty_model_list_serves_nothing(client: httpx.AsyncClient) -> None:
    assert (await client.put("/test-control/models", json={"models": []})).status_code == 200
    assert await _model_ids(client) == []
    reply = await client.post("/v1/completions", json={"model": "mock-model", "prompt": "x"})
    assert reply.status_code == 404


@pytest.mark.parametrize(
    "bad",
    [
        ["a"],
        {},
        {"models": "a"},
        {"models": [1]},
        {"models": [""]},
        {"models": ["a", "a"]},
        {"models": ["a"], "extra": 1},
    ],
)
async def test_bad_models_rejected_and_list_kept(client: httpx.AsyncClient, bad: Any) -> None:
    reply = await client.put("/test-control/models", json=bad)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == 400
    assert await _model_ids(client) == ["mock-model"]


async def test_unhealthy_health_answers_error_body(client: httpx.AsyncClient) -> None:
    reply = await client.put("/test-control/health", json={"status": 503, "delay_ms": 0})
    assert reply.status_code == 200
    assert reply.json() == {"status": 503, "delay_ms": 0, "ready_status": 404}
    health = await client.get("/health")
    assert health.status_code == 503
    assert health.json()["error"]["type"] == "ServiceUnavailableError"
    assert health.json()["error"]["code"] == 503
    # Only /health is affected.
    assert (await client.post("/v1/chat/completions", json=_chat("mock-model"))).status_code == 200
    assert (await snapshot(client))["requests"][0]["status"] == 503
    await client.put("/test-control/health", json={"status": 200})
    assert (await client.get("/health")).json()["status"] == "healthy"


async def test_health_delay_and_partial_update(client: httpx.AsyncClient) -> None:
    await client.put("/test-control/health", json={"status": 500})
    reply = await client.put("/test-control/health", json={"delay_ms": 200})
    assert reply.json() == {"status": 500, "delay_ms": 200, "ready_status": 404}
    start = time.monotonic()
    health = await client.get("/health")
    assert health.status_code == 500 and time.monotonic() - start >= 0.19


async def test_readiness_path_is_404_until_set(client: httpx.AsyncClient) -> None:
    """`/v1/health/ready`, which Dynamo does not serve, answers what `ready_status` says,
    independently of `/health`."""
    assert (await client.get("/v1/health/ready")).status_code == 404
    await client.put("/test-control/health", json={"status": 503, "ready_status": 200})
    ready = await client.get("/v1/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    assert (await client.get("/health")).status_code == 503
    await client.put("/test-control/health", json={"ready_status": 503})
    assert (await client.get("/v1/health/ready")).json()["error"]["code"] == 503
    paths = [(r["path"], r["status"]) for r in (await snapshot(client))["requests"]]
    assert paths == [
        ("/v1/health/ready", 404),
        ("/v1/health/ready", 200),
        ("/health", 503),
        ("/v1/health/ready", 503),
    ]


async def test_unhealthy_health_does_not_use_up_a_fault(client: httpx.AsyncClient) -> None:
    fault = [{"path": "/health", "status": 502, "times": 1}]
    assert (await client.put("/test-control/faults", json=fault)).status_code == 200
    await client.put("/test-control/health", json={"status": 503})
    assert (await client.get("/health")).status_code == 503
    await client.put("/test-control/health", json={"status": 200})
    assert (await client.get("/health")).status_code == 502
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"status": 201},
        {"status": 302},
        {"status": True},
        {"status": "503"},
        {"delay_ms": -1},
        {"delay_ms": 3_600_001},
        {"delay_ms": None},
        {"healthy": False},
        {"status": 503, "delay_ms": -1},
        {"ready_status": 302},
        {"ready_status": "200"},
        {"status": 503, "ready_status": 100},
    ],
)
async def test_bad_health_rejected_atomically(client: httpx.AsyncClient, bad: Any) -> None:
    reply = await client.put("/test-control/health", json=bad)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == 400
    assert (await snapshot(client))["health"] == HEALTHY
    assert (await client.get("/health")).status_code == 200


async def test_invalid_json_rejected(client: httpx.AsyncClient) -> None:
    for path in ("/test-control/models", "/test-control/health"):
        assert (await client.put(path, content=b"{")).status_code == 400


async def test_reset_restores_configured_models_and_health(make_mock: MakeMock) -> None:
    server = await make_mock(models=("m1", "m2"), flavor="vllm")
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        await c.put("/test-control/models", json={"models": ["other"]})
        await c.put(
            "/test-control/health", json={"status": 503, "delay_ms": 5, "ready_status": 200}
        )
        await c.put("/test-control/knobs", json={"num_tokens": 2})
        assert (await c.post("/test-control/reset")).status_code == 200
        snap = await snapshot(c)
        assert snap["models"] == ["m1", "m2"]
        assert snap["health"] == HEALTHY
        assert snap["knobs"]["num_tokens"] == 2
        assert await _model_ids(c) == ["m1", "m2"]
        health = (await c.get("/health")).json()
        assert health == {"status": "healthy", "flavor": "vllm", "models": ["m1", "m2"]}

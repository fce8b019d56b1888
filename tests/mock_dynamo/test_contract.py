"""Per-flavor request contract enforcement."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.mock_dynamo.conftest import MakeMock

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def _post(make_mock: MakeMock, flavor: str, extra: dict[str, Any]) -> httpx.Response:
    server = await make_mock(flavor=flavor)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        return await c.post("/v1/chat/completions", json={**CHAT, **extra})


async def test_dynamo_rejects_unknown_nvext_key(make_mock: MakeMock) -> None:
    resp = await _post(make_mock, "dynamo", {"nvext": {"top_k": 5, "bogus": 1}})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "invalid nvext: unknown field `bogus`"


@pytest.mark.parametrize("nvext", [[], "x", 3, True])
async def test_dynamo_rejects_non_object_nvext(make_mock: MakeMock, nvext: object) -> None:
    resp = await _post(make_mock, "dynamo", {"nvext": nvext})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("invalid nvext")


async def test_dynamo_accepts_known_nvext_keys(make_mock: MakeMock) -> None:
    nvext = {
        "backend_instance_id": 7,
        "annotations": ["a"],
        "agent_hints": {"x": 1},
        "ignore_eos": True,
        "guided_json": {"type": "object"},
        "cache_salt": "s",
    }
    assert (await _post(make_mock, "dynamo", {"nvext": nvext})).status_code == 200
    assert (await _post(make_mock, "dynamo", {})).status_code == 200


async def test_dynamo_does_not_check_priority(make_mock: MakeMock) -> None:
    assert (await _post(make_mock, "dynamo", {"priority": "high"})).status_code == 200


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
@pytest.mark.parametrize("priority", ["1", 1.5, True, None, [1]])
async def test_engines_reject_non_integer_priority(
    make_mock: MakeMock, flavor: str, priority: object
) -> None:
    resp = await _post(make_mock, flavor, {"priority": priority})
    assert resp.status_code == 400
    assert "priority" in resp.json()["error"]["message"]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_engines_accept_integer_priority_and_nvext(make_mock: MakeMock, flavor: str) -> None:
    assert (await _post(make_mock, flavor, {"priority": -3})).status_code == 200
    assert (await _post(make_mock, flavor, {})).status_code == 200
    # Only Dynamo deserializes nvext strictly.
    assert (await _post(make_mock, flavor, {"nvext": {"bogus": 1}})).status_code == 200

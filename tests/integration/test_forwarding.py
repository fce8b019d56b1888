"""Pylon in front of mock_dynamo over real HTTP/1.1: what reaches the engine, per backend."""

from __future__ import annotations

import json

import pytest

from pylon.core.sanitize import DENIED_BODY_FIELDS, DENIED_NVEXT_FIELDS, DENIED_REQUEST_HEADERS
from tests.integration.conftest import MODEL, StackFactory, header_values
from tests.stack import NO_BRINGUP

CHAT = "/v1/chat/completions"
BACKENDS = ["dynamo", "vllm", "sglang", "passthrough"]


def chat(stream: bool = False, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 4,
        **extra,
    }


def spoofed_headers() -> list[tuple[str, str]]:
    headers = [("x-request-id", "spoof-1"), ("x-model", MODEL), ("x-priority", "7")]
    for name in DENIED_REQUEST_HEADERS:
        headers.append((name.decode().upper(), "1"))
        headers.append((name.decode().title(), "2"))
    headers += [
        ("X-Dynamo-Worker-Instance-Id", "42"),
        ("x-dynamo-request-priority", "999999"),
        ("X-DYNAMO-REQUEST-STRICT-PRIORITY", "9"),
        ("x-stargate-retryable", "true"),
        ("x-smg-routing-key", "k"),
        ("x-override-priority", "1"),
        ("x-gateway-destination-endpoint", "10.0.0.1:80"),
        ("x-dynamo-meta-policy-class", "x"),
    ]
    return headers


def spoofed_body(backend: str) -> dict[str, object]:
    nvext: dict[str, object] = {key: 1 for key in DENIED_NVEXT_FIELDS}
    nvext["agent_hints"] = {"priority": 1_000_000, "strict_priority": 9}
    if backend in ("dynamo", "passthrough"):
        nvext["greed_sampling"] = True  # a benign key that must survive
    body = chat(nvext=nvext, seed=2**70)
    body.update({key: 1 for key in DENIED_BODY_FIELDS})
    body["vllm_xargs"] = {"session_id": "s", "keep": 1}
    return body


@pytest.mark.parametrize("backend", BACKENDS)
async def test_strip_and_derive_reach_the_engine(make_stack: StackFactory, backend: str) -> None:
    stack = await make_stack(backend)
    reply = await stack.post(CHAT, spoofed_body(backend), headers=spoofed_headers())
    assert reply.status_code == 200, reply.text
    record = await stack.last_request()
    names = [name.lower() for name, _ in record["headers"]]
    for denied in DENIED_REQUEST_HEADERS:
        assert denied.decode() not in names
    assert not [n for n in names if n.startswith(("x-stargate-", "x-smg-", "x-override-"))]
    assert not [n for n in names if n.startswith("x-gateway-destination-endpoint")]
    dynamo_headers = sorted(n for n in names if n.startswith("x-dynamo-"))
    body = record["body"]
    for key in DENIED_BODY_FIELDS:
        if key != "priority":
            assert key not in body
    assert body["seed"] == 2**70, "a benign value must reach the engine unchanged"
    assert "vllm_xargs" not in body  # a free-form bag of engine arguments: never the client's
    if backend == "dynamo":
        assert dynamo_headers == ["x-dynamo-request-priority", "x-dynamo-request-strict-priority"]
        assert header_values(record, "x-dynamo-request-priority") == [str(3600 - 7)]
        assert header_values(record, "x-dynamo-request-strict-priority") == ["0"]
    else:
        assert dynamo_headers == []
    if backend in ("dynamo", "passthrough"):
        assert body["nvext"] == {"greed_sampling": True}
        assert "priority" not in body
    else:
        assert "nvext" not in body
        assert body["priority"] == (7 if backend == "vllm" else 3600 - 7)
    assert header_values(record, "x-request-id") == ["spoof-1"]


@pytest.mark.parametrize(
    ("backend", "extra", "expected"),
    [
        ("vllm", {}, 3600),
        ("sglang", {}, 0),
        ("sglang", {"sglang_low_priority_first": True}, 3600),
        ("vllm", {"priority_ceiling": 10}, 10),
    ],
)
async def test_absent_priority_is_least_urgent(
    make_stack: StackFactory, backend: str, extra: dict[str, object], expected: int
) -> None:
    stack = await make_stack(backend, **extra)
    reply = await stack.post(CHAT, chat())
    assert reply.status_code == 200
    assert (await stack.last_request())["body"]["priority"] == expected


async def test_kill_switch_stops_derivation_but_not_the_strip(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", derive_priority=False)
    reply = await stack.post(
        CHAT, chat(priority=5), headers={"x-priority": "1", "x-dynamo-request-priority": "9"}
    )
    assert reply.status_code == 200
    record = await stack.last_request()
    assert not [n for n, _ in record["headers"] if n.lower().startswith("x-dynamo-")]
    assert "priority" not in record["body"]


async def test_body_is_forwarded_byte_for_byte_when_nothing_is_stripped(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo")
    raw = b'{"model": "mock-model",  "messages": [{"role":"user","content":"h\\u00e9"}], "n": 1}'
    reply = await stack.client.post(
        f"{stack.pylon_url}{CHAT}",
        content=raw,
        headers={"x-request-id": "r", "x-model": MODEL, "content-type": "application/json"},
    )
    assert reply.status_code == 200
    assert (await stack.last_request())["body"] == json.loads(raw)


async def test_streaming_relays_every_event(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 8})
    async with stack.client.stream(
        "POST",
        f"{stack.pylon_url}{CHAT}",
        json=chat(stream=True, max_tokens=8),
        headers={"x-request-id": "s-1", "x-model": MODEL},
    ) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in reply.aiter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    contents = [json.loads(e[5:])["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert len([c for c in contents if c]) == 8


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses"])
async def test_other_openai_routes(make_stack: StackFactory, path: str) -> None:
    stack = await make_stack("vllm")
    body: dict[str, object] = {"model": MODEL, "input": "hi", "prompt": "hi", "max_tokens": 3}
    if path == "/v1/responses":
        body["stream"] = True
    reply = await stack.post(path, body, headers={"x-priority": "3"})
    assert reply.status_code == 200, reply.text
    record = await stack.last_request()
    assert record["path"] == path
    assert record["body"]["priority"] == 3


async def test_get_models_and_health(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    models = await stack.client.get(
        f"{stack.pylon_url}/v1/models", headers={"x-request-id": "m", "x-model": MODEL}
    )
    assert models.status_code == 200
    assert models.json()["data"][0]["id"] == MODEL
    health = await stack.client.get(f"{stack.pylon_url}/health?probe=1")
    assert health.status_code == 200
    record = await stack.last_request()
    assert record["path"] == "/health"
    assert not [n for n, _ in record["headers"] if n.lower().startswith("x-dynamo-")]


async def test_query_string_is_forwarded(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    reply = await stack.post(f"{CHAT}?api-version=2", chat())
    assert reply.status_code == 200
    control = await stack.control()
    assert control["requests"][-1]["path"] == CHAT


async def test_upstream_base_path_is_joined_with_path_and_query(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo")
    prefixed = await make_stack("dynamo", upstream=f"{stack.mock.base_url}/engine/", **NO_BRINGUP)
    reply = await prefixed.post(f"{CHAT}?trace=1", chat())
    assert reply.status_code == 404  # the mock serves no /engine/... routes: it shows the URL
    record = (await stack.control())["requests"][-1]
    assert record["path"] == f"/engine{CHAT}"

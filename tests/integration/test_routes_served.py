"""Routes served, per backend, end to end (docs/api-contract.md, "Routes served"): the engine
gets pylon's priority and the `x-model` model on every route it schedules; a route pylon does
not steer, a body naming no model and an ambiguous `stream` are refused before the engine sees
them, on every transport (one intake)."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import MODEL, StackFactory
from tests.stack import PROTOCOLS, Reply, Stack

HEADERS = [("x-request-id", "route-1"), ("x-model", MODEL), ("x-priority", "7")]

# Written out here, not read from pylon's tables: the routes beyond chat and completions that
# each engine schedules, and what pylon's priority is there (x-priority 7, ceiling 3600).
SCHEDULED_BEYOND_CHAT = {
    "vllm": (
        [
            "/pooling",
            "/classify",
            "/score",
            "/v1/score",
            "/rerank",
            "/v1/rerank",
            "/v2/rerank",
            "/v2/embed",
            "/invocations",
            "/inference/v1/generate",
        ],
        7,
    ),
    "sglang": (["/v1/classify", "/invocations", "/generate"], 3600 - 7),
}


def problem(reply: Reply) -> dict[str, object]:
    assert reply.headers["content-type"].startswith("application/problem+json"), reply.body
    body: dict[str, object] = reply.json()
    return body


async def assert_engine_saw_nothing(stack: Stack) -> None:
    assert await stack.records() == [], "a refused request reached the engine"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_vllm_pooling_route_gets_pylons_priority(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack("vllm")
    body = json.dumps({"model": MODEL, "input": "hi", "priority": -100}).encode()
    reply = await stack.send(protocol, "/pooling", HEADERS, body)
    assert reply.status == 200, reply.body
    record = await stack.last_request()
    assert record["path"] == "/pooling"
    assert record["body"]["priority"] == 7  # pylon's, never the client's -100 (or none: 0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(("backend", "path"), [("vllm", "/v1/messages"), ("dynamo", "/pooling")])
async def test_a_route_pylon_does_not_steer_is_refused(
    make_stack: StackFactory, protocol: str, backend: str, path: str
) -> None:
    stack = await make_stack(backend)
    body = json.dumps({"model": MODEL, "input": "hi"}).encode()
    reply = await stack.send(protocol, path, HEADERS, body)
    assert reply.status == 404
    assert problem(reply)["code"] == "route_not_served"
    assert reply.values("x-request-id") == ["route-1"]
    await assert_engine_saw_nothing(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("backend", ["vllm", "sglang", "dynamo"])
async def test_a_body_naming_no_model_is_refused(
    make_stack: StackFactory, protocol: str, backend: str
) -> None:
    stack = await make_stack(backend)
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    reply = await stack.send(protocol, "/v1/chat/completions", HEADERS, body)
    assert reply.status == 400
    assert problem(reply)["code"] == "body_model_missing"
    await assert_engine_saw_nothing(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("stream", [1, "true", "on", 0])
async def test_a_stream_the_engine_could_read_otherwise_is_refused(
    make_stack: StackFactory, protocol: str, stream: object
) -> None:
    stack = await make_stack("vllm")
    body = json.dumps({"model": MODEL, "prompt": "hi", "stream": stream}).encode()
    reply = await stack.send(protocol, "/v1/completions", HEADERS, body)
    assert reply.status == 400
    answer = problem(reply)
    assert answer["code"] == "body_field_invalid" and answer["field"] == "stream"
    await assert_engine_saw_nothing(stack)


@pytest.mark.parametrize("backend", sorted(SCHEDULED_BEYOND_CHAT))
async def test_every_scheduled_route_reaches_the_engine_with_pylons_priority(
    make_stack: StackFactory, backend: str
) -> None:
    stack = await make_stack(backend)
    paths, expected = SCHEDULED_BEYOND_CHAT[backend]
    for path in paths:
        fields: dict[str, object] = {"input": "hi", "priority": -1}
        if path != "/generate":  # SGLang's native generate has no model field
            fields["model"] = MODEL
        reply = await stack.post(path, fields, headers=dict(HEADERS))
        assert reply.status_code == 200, (path, reply.text)
        record = await stack.last_request()
        assert record["path"] == path and record["body"]["priority"] == expected, path


async def test_get_models_and_health_still_pass_through(make_stack: StackFactory) -> None:
    for backend in ("vllm", "sglang"):
        stack = await make_stack(backend)
        models = await stack.client.get(
            f"{stack.pylon_url}/v1/models", headers={"x-request-id": "m", "x-model": MODEL}
        )
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
        assert (await stack.client.get(f"{stack.pylon_url}/health")).status_code == 200


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
async def test_a_lora_path_naming_another_model_is_refused(
    make_stack: StackFactory, protocol: str, path: str
) -> None:
    # SGLang serves the adapter `lora_path` names: the gateway authorised x-model, not it.
    stack = await make_stack("sglang")
    fields: dict[str, object] = {"text": "hi", "lora_path": "other-adapter"}
    if path != "/generate":
        fields.update(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    reply = await stack.send(protocol, path, HEADERS, json.dumps(fields).encode())
    assert reply.status == 400
    assert problem(reply)["code"] == "model_mismatch"
    await assert_engine_saw_nothing(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("backend", "path"),
    [
        ("vllm", "/pooling"),
        ("vllm", "/v1/embeddings"),
        ("vllm", "/invocations"),  # run as embeddings: the body has no messages or prompt
        ("sglang", "/v1/embeddings"),
        ("dynamo", "/v1/embeddings"),
    ],
)
async def test_stream_on_a_route_that_never_streams_is_one_answer(
    make_stack: StackFactory, protocol: str, backend: str, path: str
) -> None:
    """`"stream": true` where the engine's request type has no `stream`: the engine answers one
    whole response, and pylon reads the request as the engine does. Its head is due within the
    response-head timeout, not the first-output timeout of a stream (read as a stream, an
    engine that takes 0.8 s to answer got pylon's 504 at 0.3 s)."""
    stack = await make_stack(backend, first_output_timeout=0.3)
    await stack.faults([{"delay_ms": 800, "times": 1}])
    body = json.dumps({"model": MODEL, "input": "hi", "stream": True}).encode()
    reply = await stack.send(protocol, path, HEADERS, body)
    assert reply.status == 200, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    record = await stack.last_request()
    assert record["path"] == path and record["body"]["stream"] is True

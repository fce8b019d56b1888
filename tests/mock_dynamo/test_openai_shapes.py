"""Reply shapes of the OpenAI-compatible routes."""

from __future__ import annotations

import time

import httpx

from mock_dynamo.server import MockServer
from tests.mock_dynamo.conftest import MakeMock, sse_data, sse_events

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "say hi please"}]}


async def test_streaming_chat_shape_and_event_count(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    # role chunk + 16 tokens + finish chunk + [DONE]
    assert len(events) == 1 + 16 + 1 + 1
    chunks = [data for _, data in events[:-1]]
    assert events[-1] == (None, "[DONE]")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }


async def test_streaming_chat_usage_chunk_and_max_tokens(client: httpx.AsyncClient) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    events = sse_events((await client.post("/v1/chat/completions", json=body)).text)
    assert len(events) == 1 + 3 + 1 + 1 + 1
    finish, usage = events[-3][1], events[-2][1]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_non_streaming_chat_has_usage(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 5})
    body = resp.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_max_tokens_above_num_tokens_stops_naturally(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 999})).json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_completions_stream_and_body(client: httpx.AsyncClient) -> None:
    body = {"model": "mock-model", "prompt": "once upon", "max_tokens": 4}
    plain = (await client.post("/v1/completions", json=body)).json()
    assert plain["object"] == "text_completion"
    assert plain["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    events = sse_events((await client.post("/v1/completions", json={**body, "stream": True})).text)
    assert len(events) == 4 + 1 + 1
    texts = "".join(d["choices"][0]["text"] for _, d in events[:-1])
    assert texts == plain["choices"][0]["text"]
    assert events[-2][1]["choices"][0]["finish_reason"] == "length"


async def test_responses_api_streaming_events(client: httpx.AsyncClient) -> None:
    body = {"model": "mock-model", "input": "hello", "stream": True}
    resp = await client.post("/v1/responses", json=body)
    events = sse_events(resp.text)
    names = [name for name, _ in events]
    assert names[0] == "response.created"
    assert names.count("response.output_text.delta") == 16
    assert names[-1] == "response.completed"
    assert all(data["type"] == name for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["usage"] == {"input_tokens": 1, "output_tokens": 16, "total_tokens": 17}
    deltas = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == deltas
    assert "[DONE]" not in sse_data(resp.text)


async def test_responses_api_non_streaming(client: httpx.AsyncClient) -> None:
    body = {"model": "mock-model", "input": "hi", "max_output_tokens": 2}
    obj = (await client.post("/v1/responses", json=body)).json()
    assert obj["object"] == "response"
    assert obj["status"] == "incomplete"
    assert obj["usage"]["output_tokens"] == 2


async def test_embeddings_are_deterministic(client: httpx.AsyncClient) -> None:
    body = {"model": "mock-model", "input": ["alpha beta", "gamma"]}
    first = (await client.post("/v1/embeddings", json=body)).json()
    second = (await client.post("/v1/embeddings", json=body)).json()
    assert first["data"] == second["data"]
    vectors = [d["embedding"] for d in first["data"]]
    assert len(vectors) == 2 and all(len(v) == 8 for v in vectors)
    assert vectors[0] != vectors[1]
    assert all(-1.0 <= x <= 1.0 for v in vectors for x in v)
    assert first["usage"]["prompt_tokens"] == 3
    single = (
        await client.post("/v1/embeddings", json={"model": "mock-model", "input": "gamma"})
    ).json()
    assert single["data"][0]["embedding"] == vectors[1]


async def test_embeddings_reject_missing_input(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/embeddings", json={"model": "mock-model"})
    assert resp.status_code == 400


async def test_models_and_health(make_mock: MakeMock) -> None:
    server = await make_mock(flavor="vllm", models=("a", "b"))
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        models = (await c.get("/v1/models")).json()
        health = await c.get("/health")
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["a", "b"]
    assert health.status_code == 200
    assert health.json()["status"] == "healthy"


async def test_unknown_model_is_404_openai_error(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code"}
    assert "nope" in error["message"]


async def test_non_object_body_is_400(client: httpx.AsyncClient) -> None:
    for content in (b"[1, 2]", b"not json", b""):
        resp = await client.post("/v1/chat/completions", content=content)
        assert resp.status_code == 400
        assert "error" in resp.json()


async def test_invalid_max_tokens_is_400(client: httpx.AsyncClient) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": "many"})
    assert resp.status_code == 400


async def test_ttft_and_token_delay_pace_the_stream(make_mock: MakeMock) -> None:
    server: MockServer = await make_mock(ttft_ms=100, token_delay_ms=20, num_tokens=5)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5) as c:
        start = time.monotonic()
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            arrivals = []
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic() - start)
    assert arrivals[0] >= 0.09
    assert arrivals[-1] >= 0.09 + 4 * 0.02 * 0.9
    assert arrivals[-1] < 1.0

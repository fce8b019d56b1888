"""The OpenAI SDK as a client of pylon: the README's example works, and pylon's own errors and
retry marking reach SDK users as SDK errors with pylon's code and message."""

from __future__ import annotations

import openai
import pytest

from tests.stack import MODEL, StackFactory


def client_for(url: str, request_headers: dict[str, str] | None = None) -> openai.AsyncOpenAI:
    """An SDK client for pylon at `url`; use it as `async with`, so that its connections close
    in the test's own loop (an unclosed one closes itself in whatever loop runs at collection)."""
    return openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        default_headers={"x-model": MODEL, "x-priority": "5", **(request_headers or {})},
        max_retries=0,
    )


async def test_the_readme_example_streams(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 4})
    async with client_for(stack.pylon_url) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            extra_headers={"x-request-id": "sdk-1"},
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text
    record = await stack.last_request()
    assert ["x-request-id", "sdk-1"] in record["headers"]


async def test_pylon_errors_are_sdk_errors_with_pylon_code(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo")
    async with client_for(stack.pylon_url) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                model="another-model", messages=[], extra_headers={"x-request-id": "sdk-2"}
            )
    error = refused.value
    assert error.code == "model_mismatch"
    assert "x-model" in error.message
    assert error.response.headers["x-request-id"] == "sdk-2"
    assert error.response.headers["x-should-retry"] == "false"
    assert await stack.records() == []

"""A client's claim cannot move shared state beyond what the request costs (issue 17, rule 1),
end to end over HTTP/1.1, HTTP/2 and HTTP/3.

The issue's example: `x-input-tokens: 18446744073709551615` on one small streaming request sat in
the queue table ahead of everyone, so every other request of the model carrying
`x-stargate-expected-queue-ms` got 429 while it ran, and, once it ended, its throughput sample
zeroed the estimates. Now the claim is refused 400 `invalid_input_tokens` before the table sees
it, the largest claim a small body may make cannot push a gateway request out, and one outlier
sample (a claim that is believable, but far from the rest) moves the estimate no further than
the other samples reach.
"""

from __future__ import annotations

import json

import pytest

from pylon.core.contract import U64_MAX
from pylon.core.queue import MIN_SAMPLES
from tests.integration.test_queue_admission import (
    CHAT,
    assert_empty,
    chat,
    engine_ids,
    headers,
    queue_stack,
    slow_request,
)
from tests.stack import MODEL, PROTOCOLS, StackFactory

TEMPLATE_TOKENS = 1024  # as docs/api-contract.md states it: tokens allowed beyond one per byte


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_claim_beyond_the_body_is_refused_and_holds_no_one(
    make_stack: StackFactory, protocol: str
) -> None:
    stack, observer = await queue_stack(make_stack, initial_input_tps=1000)
    body = json.dumps(chat()).encode()
    huge = await stack.send(protocol, CHAT, headers("huge", U64_MAX), body)
    assert huge.status == 400
    assert huge.headers["content-type"] == "application/problem+json"
    assert huge.headers["x-request-id"] == "huge"
    problem = huge.json()
    assert problem["code"] == "invalid_input_tokens" and problem["status"] == 400
    assert "x-input-tokens" in problem["title"] and "x-input-tokens" in problem["detail"]
    assert "huge" not in await engine_ids(stack)
    assert observer.rejections == [("huge", "invalid_input_tokens")]
    assert stack.running.core.queue.table.snapshot() == []  # it never entered the table
    # The most a body this small may claim, held by the engine: about 1.1 s of work at 1000
    # tokens/s, so a gateway that expects 1.5 s here is served, not sent elsewhere.
    most = len(body) + TEMPLATE_TOKENS
    async with slow_request(stack, observer, "held", tokens=most, body=body):
        served = await stack.send(protocol, CHAT, headers("gateway", 10, expected=1500), body)
        assert served.status == 200 and b"data: [DONE]" in served.body
        await observer.wait_done("gateway")
    ((request_id, decision),) = observer.decisions
    assert (request_id, decision.result.value) == ("gateway", "accepted")
    assert decision.estimate_ms == most
    # One byte more than the body allows is refused the same way.
    over = await stack.send(protocol, CHAT, headers("over", most + 1), body)
    assert over.status == 400 and over.json()["code"] == "invalid_input_tokens"
    assert_empty(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_outlier_sample_cannot_zero_the_next_estimates(
    make_stack: StackFactory, protocol: str
) -> None:
    """Five honest prefills of 1000 tokens in >= 100 ms (<= 10,000 tokens/s), then one that says
    256,000 tokens in ~100 ms (a body that big may): the estimate stays where the honest samples
    put it, and a request behind 100,000 tokens is still refused as the gateway's figure is far
    too low. Believed as a ratio of sums, the outlier would have let it through."""
    stack, observer = await queue_stack(make_stack, mock={"ttft_ms": 100, "num_tokens": 2})
    body = json.dumps(chat()).encode()
    for i in range(MIN_SAMPLES):
        reply = await stack.send(protocol, CHAT, headers(f"warm-{i}", 1000), body)
        assert reply.status == 200
        await observer.wait_done(f"warm-{i}")
    honest = stack.running.core.queue.table.input_tps(MODEL)
    assert honest is not None and 1000 < honest <= 10_000
    outlier_tokens = 256_000
    big = json.dumps(chat(content="x" * outlier_tokens)).encode()
    reply = await stack.send(protocol, CHAT, headers("outlier", outlier_tokens), big)
    assert reply.status == 200
    await observer.wait_done("outlier")
    tps = stack.running.core.queue.table.input_tps(MODEL)
    assert tps is not None and 1000 < tps <= 10_000
    async with slow_request(stack, observer, tokens=100_000):
        refused = await stack.send(protocol, CHAT, headers("late", 1, expected=500), body)
        assert refused.status == 429
        assert refused.json()["actual_queue_ms"] >= 10_000
    assert observer.results() == [("late", "rejected")]
    assert_empty(stack)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_low_claims_over_held_prefills_cannot_zero_the_estimate(
    make_stack: StackFactory, protocol: str
) -> None:
    """A claim too low moves shared estimates too: five honest prefills of 1000 tokens, then
    three requests claiming 1 token each whose prefills the engine holds for 2 s (samples of
    0.5 tokens/s). The estimate stays near the honest rate, and a gateway request behind 5,000
    tokens that expects 2 s is served. Believed as a ratio of sums (two of them kept after
    trimming), the estimate fell under 1,000 tokens/s and the request got a 429."""
    stack, observer = await queue_stack(make_stack, mock={"ttft_ms": 100, "num_tokens": 2})
    body = json.dumps(chat()).encode()
    for i in range(MIN_SAMPLES):
        reply = await stack.send(protocol, CHAT, headers(f"warm-{i}", 1000), body)
        assert reply.status == 200
        await observer.wait_done(f"warm-{i}")
    honest = stack.running.core.queue.table.input_tps(MODEL)
    assert honest is not None and 1000 < honest <= 10_000
    for i in range(3):
        await stack.faults([{"delay_ms": 2000, "times": 1}])
        reply = await stack.send(protocol, CHAT, headers(f"low-{i}", 1), body)
        assert reply.status == 200
        await observer.wait_done(f"low-{i}")
    tps = stack.running.core.queue.table.input_tps(MODEL)
    assert tps is not None and honest / 2 <= tps <= 10_000
    async with slow_request(stack, observer, tokens=5000):
        served = await stack.send(protocol, CHAT, headers("gateway", 1, expected=2000), body)
        assert served.status == 200 and b"data: [DONE]" in served.body
        await observer.wait_done("gateway")
    assert observer.results() == [("gateway", "accepted")]
    assert_empty(stack)

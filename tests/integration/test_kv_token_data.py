"""`--kv-token-data` over real mock_dynamo workers (flavor dynamo) and a stand-in native core.

The mocks play the frontend's part: they answer `nvext.annotations: ["token_ids"]` with their
own tokenization (words) and take a request's `nvext.token_data` as its prompt. pylon proves
its rendering against theirs at start, then writes the ids it routed by into each request of
a proven model; a rendering that differs refuses the start.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest

from pylon.startup import StartupError
from tests.fleet import FleetFactory, WordPrompts
from tests.router_ffi.fake_native import FakeNative
from tests.stack import MODEL

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def fake() -> Iterator[FakeNative]:
    native = FakeNative()
    yield native
    native.join_helpers()


class OffByOne(WordPrompts):
    """A rendering that differs from the engine's by one trailing token."""

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        ids = super().prompt_tokens(path, body)
        return None if ids is None else [*ids, 7]


def sent_body(record: dict[str, Any]) -> Any:
    """The body as the engine received it: its raw bytes, parsed."""
    return json.loads(base64.b64decode(record["body_b64"]))


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


async def test_proven_models_carry_the_ids_pylon_routed_by(
    make_fleet: FleetFactory, fake: FakeNative
) -> None:
    tokenizer = WordPrompts()
    fleet = await make_fleet(
        workers=2,
        routing="kv",
        native=lambda: fake,
        kv_block_size=4,
        kv_token_data=True,
        tokenizer=tokenizer,
        engine_controls={},  # keep the mocks' records: the proof's probes are checked below
    )
    assert fleet.routing.kv is not None and fleet.routing.kv.token_data is not None
    assert fleet.routing.kv.token_data.proven == {MODEL}
    assert fleet.observer.of("kv_token_data_proven") == [{"model": MODEL}]
    # The proof asked the first worker in rotation, with pylon's own probes.
    probes = [r for r in await fleet.inference_records(0) if r.get("body")]
    assert probes and all(sent_body(r)["nvext"] == {"annotations": ["token_ids"]} for r in probes)
    for n, (path, body) in enumerate(
        [
            (CHAT, chat("one two three four five six", stream=True)),
            (CHAT, chat("seven eight nine", nvext={"ignore_eos": True})),
            (COMPLETIONS, {"model": MODEL, "prompt": "ten eleven twelve thirteen"}),
        ]
    ):
        rid = f"td-{n}"
        reply = await fleet.post(path, body, {"x-request-id": rid})
        assert reply.status_code == 200, reply.text
        index = await fleet.served_by(rid)
        (record,) = [
            r
            for r in await fleet.inference_records(index)
            if ("x-request-id", rid) in [tuple(h) for h in r["headers"]]
        ]
        sent = sent_body(record)
        ours = tokenizer.prompt_tokens(path, json.dumps(body).encode())
        assert ours and sent["nvext"]["token_data"] == ours
        assert {k: v for k, v in sent["nvext"].items() if k != "token_data"} == body.get(
            "nvext", {}
        )
        assert {k: v for k, v in sent.items() if k != "nvext"} == {
            k: v for k, v in body.items() if k != "nvext"
        }
        if not body.get("stream"):
            assert reply.json()["usage"]["prompt_tokens"] == len(ours)
    await fleet.observer.wait_done(3)


async def test_a_client_token_data_never_reaches_the_engine_and_unproven_models_get_none(
    make_fleet: FleetFactory, fake: FakeNative
) -> None:
    fleet = await make_fleet(
        workers=1, routing="kv", native=lambda: fake, kv_block_size=4, kv_token_data=True
    )
    prover = fleet.routing.kv.token_data if fleet.routing.kv is not None else None
    assert prover is not None
    body = chat("a b c d e", nvext={"token_data": [1, 2, 3]})
    reply = await fleet.post(CHAT, body, {"x-request-id": "client-ids"})
    assert reply.status_code == 200
    (record,) = [r for r in await fleet.inference_records(0) if r.get("body")][-1:]
    assert sent_body(record)["nvext"]["token_data"] != [1, 2, 3]  # pylon's, not theirs
    prover.proven.clear()  # as for a model published after the start, not proven yet
    reply = await fleet.post(CHAT, chat("f g h"), {"x-request-id": "unproven"})
    assert reply.status_code == 200
    (record,) = [r for r in await fleet.inference_records(0) if r.get("body")][-1:]
    assert "nvext" not in sent_body(record)  # the engine tokenizes it itself
    await fleet.observer.wait_done(2)


async def test_a_rendering_that_differs_refuses_the_start(
    make_fleet: FleetFactory, fake: FakeNative
) -> None:
    with pytest.raises(StartupError) as refused:
        await make_fleet(
            workers=2,
            routing="kv",
            native=lambda: fake,
            kv_block_size=4,
            kv_token_data=True,
            tokenizer=OffByOne(),
        )
    message = str(refused.value)
    assert message.startswith("--kv-token-data: pylon's rendering differs from the Dynamo")
    assert f"model {MODEL!r}, probe 1 (/v1/chat/completions)" in message
    assert "pylon has" in message and "tokens, the frontend" in message

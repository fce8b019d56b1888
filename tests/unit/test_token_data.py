"""pylon.routing.token_data: reading the frontend's annotation, and the proof's verdicts (a
stand-in for the frontend; tests/integration/test_kv_token_data.py runs it over real mocks)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pylon.core.upstream import Upstream
from pylon.routing.fleet import Fleet
from pylon.routing.spec import parse_worker_spec
from pylon.routing.token_data import (
    TokenDataMismatch,
    TokenDataProver,
    annotated_ids,
    first_difference,
)
from pylon.upstream.probe import Fetched, FetchError
from tests.observers import EventObserver

FRONTEND = Upstream.from_url("http://127.0.0.1:8000")


def annotation(ids: list[int]) -> bytes:
    return b"event: token_ids\n: " + json.dumps(json.dumps(ids)).encode() + b"\n\n"


def test_annotated_ids() -> None:
    body = annotation([1, 2, 3]) + b'data: {"choices":[]}\n\ndata: [DONE]\n\n'
    assert annotated_ids(body) == [1, 2, 3]
    assert annotated_ids(b'data: {"x":1}\n\n') is None
    assert annotated_ids(b"event: token_ids\n") is None  # nothing after it
    assert annotated_ids(b"event: token_ids\ndata: [1]\n") is None  # not a comment
    assert annotated_ids(b'event: token_ids\n: "[1, true]"\n') is None
    assert annotated_ids(b'event: token_ids\n: "{}"\n') is None
    assert annotated_ids(b"event: token_ids\n: not json\n") is None


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 5, 3]) == "token 1: pylon 2, frontend 5"
    assert first_difference([1, 2], [1, 2, 3]) == "pylon has 2 tokens, the frontend 3"


class Words:
    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        data = json.loads(body)
        text = data["prompt"] if "prompt" in data else data["messages"][-1]["content"]
        return [len(word) for word in text.split()]


class Frontend:
    """Answers each probe with the ids of `Words`, or what a test sets."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, Any], tuple[tuple[bytes, bytes], ...]]] = []
        self.reply: Fetched | FetchError | None = None
        self.skew = 0

    async def __call__(
        self,
        target: Upstream,
        path: str,
        body: bytes,
        *,
        headers: tuple[tuple[bytes, bytes], ...],
        timeout: float,
        max_body: int,
    ) -> Fetched:
        self.asked.append((path, json.loads(body), headers))
        if isinstance(self.reply, FetchError):
            raise self.reply
        if self.reply is not None:
            return self.reply
        ids = Words().prompt_tokens(path, body)
        assert ids is not None
        return Fetched(200, annotation([i + self.skew for i in ids]))


def prover(frontend: Frontend, spec: str = "instance-id=42") -> tuple[TokenDataProver, Fleet]:
    fleet = Fleet.from_specs([parse_worker_spec(spec)], FRONTEND)
    fleet.set_in_rotation(fleet.workers[0], True)
    return TokenDataProver(Words(), fleet, EventObserver(), timeout=5, post=frontend), fleet


async def test_the_probes_go_pinned_with_annotations_and_must_all_match() -> None:
    frontend = Frontend()
    proof, _ = prover(frontend)
    await proof.prove_all(["m1", "m2"])
    assert proof.proven == {"m1", "m2"}
    assert len(frontend.asked) == 2 * 4
    for path, body, headers in frontend.asked:
        assert path in ("/v1/chat/completions", "/v1/completions")
        assert body["model"] in ("m1", "m2") and body["stream"] is True
        assert body["max_tokens"] == 1 and body["nvext"] == {"annotations": ["token_ids"]}
        assert headers == ((b"x-dynamo-worker-instance-id", b"42"),)


@pytest.mark.parametrize(
    ("reply", "skew", "needle"),
    [
        (None, 1, "token 0: pylon"),
        (Fetched(503, b"busy"), 0, "status 503"),
        (Fetched(200, b"data: [DONE]\n\n"), 0, "no token_ids annotation"),
        (FetchError("timeout", "no complete answer within 5 s"), 0, "no complete answer"),
    ],
)
async def test_every_failure_is_a_mismatch_naming_model_probe_and_worker(
    reply: Fetched | FetchError | None, skew: int, needle: str
) -> None:
    frontend = Frontend()
    frontend.reply, frontend.skew = reply, skew
    proof, _ = prover(frontend, "url=http://127.0.0.1:9001")
    with pytest.raises(TokenDataMismatch) as caught:
        await proof.prove_all(["m"])
    assert str(caught.value).startswith(
        "model 'm', probe 1 (/v1/chat/completions) on http://127.0.0.1:9001: "
    )
    assert needle in str(caught.value)
    assert proof.proven == set()


async def test_no_admitted_worker_is_a_mismatch() -> None:
    proof, fleet = prover(Frontend())
    fleet.set_in_rotation(fleet.workers[0], False)
    with pytest.raises(TokenDataMismatch, match="no worker in rotation"):
        await proof.prove("m")


async def test_a_later_model_is_proven_once_in_the_background() -> None:
    frontend = Frontend()
    proof, _ = prover(frontend)
    events: EventObserver = proof._observer  # type: ignore[assignment]
    proof.want("late")
    proof.want("late")  # once
    proof.want(None)
    await events.wait_for("kv_token_data_proven", model="late")
    assert proof.proven == {"late"} and len(frontend.asked) == 4
    frontend.skew = 3
    proof.want("bad")
    refused = await events.wait_for("kv_token_data_refused", model="bad")
    assert "token 0" in refused["detail"] and "bad" not in proof.proven
    proof.want("bad")  # never retried
    await asyncio.sleep(0)
    assert len(frontend.asked) == 5
    await proof.aclose()

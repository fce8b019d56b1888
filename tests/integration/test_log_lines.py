"""What the log lines about requests say: the request id on every one, and `stripped` listing
client controls only (hop-by-hop fields are connection management, not controls)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pylon.core.errors import PylonError
from pylon.core.record import RequestRecord
from pylon.observe import LogObserver
from tests.integration.conftest import MODEL, StackFactory
from tests.stack import PROTOCOLS
from tests.transport.h2client import H2Client, request_headers

CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
).encode()


class Lines(LogObserver):
    """Keeps what the log lines are built from (and logs them as usual)."""

    def __init__(self) -> None:
        super().__init__()
        self.done_records: list[RequestRecord] = []
        self.admitted_ids: list[str | None] = []
        self.transport: list[tuple[str, dict[str, Any]]] = []
        self._changed = asyncio.Event()

    def admitted(self, record: RequestRecord) -> None:
        super().admitted(record)
        self.admitted_ids.append(record.request_id)
        self._changed.set()

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.done_records.append(record)
        self._changed.set()

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        super().transport_event(kind, protocol, **fields)
        self.transport.append((kind, fields))
        self._changed.set()

    async def wait_for(self, kind: str, timeout: float = 5.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                for seen, fields in self.transport:
                    if seen == kind:
                        return fields
                self._changed.clear()
                await self._changed.wait()

    async def wait_admitted(self, request_id: str, timeout: float = 5.0) -> None:
        """Until pylon has read (and admitted) the head of `request_id`."""
        async with asyncio.timeout(timeout):
            while request_id not in self.admitted_ids:
                self._changed.clear()
                await self._changed.wait()


async def test_hop_by_hop_fields_are_not_reported_as_stripped(make_stack: StackFactory) -> None:
    lines = Lines()
    stack = await make_stack("dynamo", observer=lines)
    reply = await stack.post(
        CHAT,
        json.loads(BODY),
        headers={
            "x-request-id": "hop-1",
            "x-model": MODEL,
            "connection": "keep-alive, x-app-hop",
            "keep-alive": "timeout=5",
            "x-app-hop": "1",
            "proxy-authorization": "Basic abc",
            "x-dynamo-worker-instance-id": "7",
        },
    )
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == "hop-1"
    (record,) = lines.done_records
    assert record.request_id == "hop-1"
    assert record.stripped == ("x-dynamo-worker-instance-id",)  # the one client control
    names = [name.lower() for name, _ in (await stack.last_request())["headers"]]
    assert not {"keep-alive", "x-app-hop", "proxy-authorization"} & set(names)


async def test_http2_stream_lines_carry_the_request_id(make_stack: StackFactory) -> None:
    lines = Lines()
    stack = await make_stack("dynamo", observer=lines)
    client = await H2Client.connect(stack.pylon_address)
    try:
        # A body shorter than its content-length: the stream is malformed after its head.
        headers = [*request_headers(request_id="short-body"), (b"content-length", b"100")]
        reply = await client.response(client.send(headers, BODY))
        assert reply.status == 400
        assert reply.header(b"x-request-id") == b"short-body"
        malformed = await lines.wait_for("stream_malformed")
        assert malformed["request_id"] == "short-body"
        # A stream the client resets while its request is still arriving.
        sid = client.send(request_headers(request_id="reset-me"), BODY[:10], end=False)
        await lines.wait_admitted("reset-me")
        client.reset(sid)
        reset = await lines.wait_for("stream_reset_by_client")
        assert reset["request_id"] == "reset-me"
    finally:
        await client.close()


class Refusals(LogObserver):
    """Keeps the records of refused requests (what `request_rejected` is built from)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: dict[str | None, RequestRecord] = {}

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        super().rejected(record, error)
        self.refused[record.request_id] = record


def requests_by_model(text: str) -> dict[tuple[str, str], float]:
    """pylon_requests_total by (model, status_class), summed over transports."""
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "pylon_requests":
            continue
        for sample in family.samples:
            if sample.name == "pylon_requests_total":
                key = (sample.labels["model"], sample.labels["status_class"])
                counts[key] = counts.get(key, 0) + sample.value
    return counts


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_refusals_at_admission_carry_the_model_and_label_only_published_ones(
    make_stack: StackFactory, tmp_path: Path, protocol: str
) -> None:
    """401 and an unpublished model: the log line says the `x-model` (a valid name); the
    metrics label it only when pylon publishes it, else `_unpublished`, never the client's
    text; a request without a valid `x-model` stays `_none`."""
    token = "s3cret-token-Aa1"
    (tmp_path / "token").write_text(token)
    observer = Refusals()
    stack = await make_stack("dynamo", observer=observer, tunnel_token_file=str(tmp_path / "token"))
    auth = [("authorization", f"Bearer {token}")]
    cases = [
        ("unpublished", "not-served-here", auth, 503),
        ("no-token", MODEL, [], 401),
        ("no-token-junk", "junk-model-name", [], 401),
    ]
    for request_id, model, extra, status in cases:
        headers = [("x-request-id", request_id), ("x-model", model), *extra]
        reply = await stack.send(protocol, CHAT, headers, BODY)
        assert reply.status == status, (request_id, reply)
        assert observer.refused[request_id].model == model
    reply = await stack.send(protocol, CHAT, [("x-request-id", "bad-model"), ("x-model", "")], BODY)
    assert reply.status == 400 and observer.refused["bad-model"].model is None
    assert stack.running.admin_url is not None
    counts = requests_by_model((await stack.client.get(f"{stack.running.admin_url}/metrics")).text)
    assert counts == {
        ("_unpublished", "5xx"): 1,
        ("_unpublished", "4xx"): 1,
        (MODEL, "4xx"): 1,
        ("_none", "4xx"): 1,
    }


async def test_a_refusal_while_starting_carries_the_model(make_stack: StackFactory) -> None:
    """Not ready yet (the gate has not passed, nothing is published): the line says the model,
    the metrics count it as `_unpublished`."""
    observer = Refusals()
    stack = await make_stack(
        observer=observer,
        wait_ready=False,
        model=[MODEL],
        engine_controls={"health": {"status": 503}},
    )
    headers = [("x-request-id", "early"), ("x-model", MODEL)]
    reply = await stack.send("http1", CHAT, headers, BODY)
    assert reply.status == 503 and json.loads(reply.body)["code"] == "not_ready"
    assert observer.refused["early"].model == MODEL
    assert stack.running.admin_url is not None
    counts = requests_by_model((await stack.client.get(f"{stack.running.admin_url}/metrics")).text)
    assert counts == {("_unpublished", "5xx"): 1}


class Ends(Lines):
    """Keeps every ended request's record, whether it was relayed or refused."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: dict[str | None, RequestRecord] = {}

    def complete(self, record: RequestRecord) -> None:
        super().complete(record)
        self.ended[record.request_id] = record

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        super().rejected(record, error)
        self.ended[record.request_id] = record


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_access_line_counts_the_body_bytes_each_way(
    make_stack: StackFactory, protocol: str
) -> None:
    """`bytes_received`: the request body as the client sent it (0 for a request refused at
    its head, whose body was never taken in); `bytes_sent`: the response body the client got
    (a whole reply, an event stream, pylon's own problem)."""
    observer = Ends()
    stack = await make_stack("dynamo", observer=observer)
    streamed = json.dumps({**json.loads(BODY), "stream": True, "priority": 3}).encode()
    cases = [
        ("whole", [("x-model", MODEL)], BODY, 200),
        ("events", [("x-model", MODEL)], streamed, 200),
        ("problem", [], BODY, 400),  # no x-model: pylon's own answer, before any engine
    ]
    for request_id, extra, body, status in cases:
        reply = await stack.send(protocol, CHAT, [("x-request-id", request_id), *extra], body)
        assert reply.status == status, (request_id, reply)
        assert reply.body  # something to count
        if request_id == "events":
            assert reply.body.endswith(b"data: [DONE]\n\n")
        record = observer.ended[request_id]
        assert record.bytes_sent == len(reply.body), request_id
        assert record.bytes_received == (0 if status == 400 else len(body)), request_id

"""The mock's engine model over real sockets: KV events on a ZMQ SUB (decoded with pylon's
decoder), prefill-rate TTFT, usage.cached_tokens, the /test-control/kv view, flags."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("xxhash", reason="pip install -e '.[mock-kv]'")
pytest.importorskip("zmq", reason="pip install -e '.[mock-kv]'")
import zmq
import zmq.asyncio

from mock_dynamo.config import MockConfig
from mock_dynamo.server import MockServer, start_mock
from pylon.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    SequenceTracker,
    decode_message,
)
from tests.mock_dynamo.conftest import MakeMock, sse_data
from tests.mock_dynamo.kv_helpers import make_model_dir, reference_ids
from tests.mock_dynamo.test_cli import EXE, PORT_LINE, _run_to_exit

RECV_TIMEOUT_S = 5.0


class Subscriber:
    """A ZMQ SUB on the mock's KV-event socket, subscribed before any request is sent."""

    def __init__(self, endpoint: str) -> None:
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self.tracker = SequenceTracker()

    async def next(self) -> KvEventBatch:
        frames = await asyncio.wait_for(self._socket.recv_multipart(), RECV_TIMEOUT_S)
        assert len(frames) == 3 and frames[0] == b""
        batch = decode_message(frames)
        assert not self.tracker.observe(batch.seq).stale
        return batch

    def close(self) -> None:
        self._socket.close(0)
        self._context.term()


@contextlib.asynccontextmanager
async def subscribed(mock: MockServer, client: httpx.AsyncClient) -> AsyncIterator[Subscriber]:
    assert mock.kv_events_endpoint is not None
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", mock.kv_events_endpoint)
    sub = Subscriber(mock.kv_events_endpoint)
    try:
        # The mock's socket sees the subscription: nothing sent after this is lost.
        resp = await client.get("/test-control/kv", params={"wait_subscribers": 1, "timeout": 10})
        assert resp.status_code == 200, resp.text
        assert resp.json()["events"]["subscribers"] == 1
        yield sub
    finally:
        sub.close()


async def complete(client: httpx.AsyncClient, prompt: object, **extra: Any) -> dict[str, Any]:
    resp = await client.post(
        "/v1/completions", json={"model": "mock-model", "prompt": prompt, "max_tokens": 2, **extra}
    )
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_kv_events_end_to_end(make_mock: MakeMock, encoding: str) -> None:
    mock = await make_mock(
        kv_block_size=4, kv_cache_blocks=6, kv_events_port=0, kv_events_encoding=encoding
    )
    async with (
        httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client,
        subscribed(mock, client) as sub,
    ):
        a = list(range(1000, 1012))  # 3 blocks
        usage = (await complete(client, a))["usage"]
        assert usage["prompt_tokens"] == 12
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        ids_a = reference_ids(a, 4)
        first = await sub.next()
        assert first.seq == 0 and first.dp_rank == 0
        medium = "GPU" if encoding == "array" else None
        group = 0 if encoding == "map" else None
        assert first.events == (
            BlockStored(tuple(ids_a), None, tuple(a), 4, medium=medium, group_idx=group),
        )
        # b shares a's first two blocks: it hits them and stores three blocks under a[1].
        b = [*a[:8], *range(2000, 2012)]
        usage = (await complete(client, b))["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 8}
        ids_b = reference_ids(b, 4)
        assert ids_b[:2] == ids_a[:2]
        second = await sub.next()
        assert second.events == (
            BlockStored(
                tuple(ids_b[2:]), ids_a[1], tuple(b[8:]), 4, medium=medium, group_idx=group
            ),
        )
        # The cache is full (6 blocks); c evicts the two least recently used tails: a's last
        # block, then b's.
        c = list(range(3000, 3008))
        await complete(client, c)
        third = await sub.next()
        assert third.events == (
            BlockRemoved((ids_a[2],), medium=medium, group_idx=group),
            BlockRemoved((ids_b[4],), medium=medium, group_idx=group),
            BlockStored(
                tuple(reference_ids(c, 4)), None, tuple(c), 4, medium=medium, group_idx=group
            ),
        )
        view = (await client.get("/test-control/kv")).json()
        assert (view["blocks"], view["hits"], view["misses"], view["evicted"]) == (6, 2, 8, 2)
        assert view["hit_rate"] == pytest.approx(2 / 10)
        assert view["events"]["next_seq"] == 3
        # DELETE /test-control/kv empties the cache: AllBlocksCleared; the counters stay.
        cleared = (await client.delete("/test-control/kv")).json()
        assert (cleared["blocks"], cleared["hits"]) == (0, 2)
        assert (await sub.next()).events == (AllBlocksCleared(),)
        # A reset also clears (another AllBlocksCleared) and zeroes the counters.
        assert (await client.post("/test-control/reset")).status_code == 200
        assert (await sub.next()).events == (AllBlocksCleared(),)
        view = (await client.get("/test-control/kv")).json()
        assert (view["blocks"], view["requests"], view["hits"]) == (0, 0, 0)
        assert view["events"]["messages"] == 5 and view["events"]["dropped"] == 0


async def test_salted_requests_in_map_events_carry_the_salt(make_mock: MakeMock) -> None:
    mock = await make_mock(
        flavor="dynamo",
        kv_block_size=4,
        kv_cache_blocks=16,
        kv_events_port=0,
        kv_events_encoding="map",
    )
    async with (
        httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client,
        subscribed(mock, client) as sub,
    ):
        tokens = list(range(8))
        await complete(client, tokens, nvext={"cache_salt": "tenant-a"})
        stored = (await sub.next()).events[0]
        assert isinstance(stored, BlockStored)
        assert stored.cache_salt == "tenant-a"
        assert stored.block_hashes == tuple(reference_ids(tokens, 4, "tenant-a"))
        # Another tenant's identical prompt hits nothing.
        usage = (await complete(client, tokens, nvext={"cache_salt": "tenant-b"}))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def _ttft(client: httpx.AsyncClient, prompt: object) -> float:
    """Seconds from sending a streamed completion to its first SSE bytes."""
    body = {"model": "mock-model", "prompt": prompt, "max_tokens": 1, "stream": True}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for _ in resp.aiter_bytes():
            return time.perf_counter() - started
    raise AssertionError("empty stream")


async def _last_kv(client: httpx.AsyncClient) -> dict[str, Any]:
    record = (await client.get("/test-control")).json()["requests"][-1]
    kv: dict[str, Any] = record["kv"]
    return kv


async def test_ttft_follows_uncached_prompt_tokens_over_the_prefill_rate(
    make_mock: MakeMock,
) -> None:
    rate = 10_000.0
    mock = await make_mock(kv_block_size=16, kv_cache_blocks=1024, prefill_tokens_per_s=rate)
    long_prompt = " ".join(f"w{i}" for i in range(4000))
    short_prompt = " ".join(f"v{i}" for i in range(1000))
    async with httpx.AsyncClient(base_url=mock.base_url, timeout=10) as client:
        cold_long = await _ttft(client, long_prompt)
        kv_cold_long = await _last_kv(client)
        cold_short = await _ttft(client, short_prompt)
        kv_cold_short = await _last_kv(client)
        warm_long = await _ttft(client, long_prompt)
        kv_warm_long = await _last_kv(client)
    # What the engine model planned: uncached tokens / rate, no queue (one request at a time).
    assert kv_cold_long == {
        "prompt_tokens": 4000,
        "cached_tokens": 0,
        "hit_blocks": 0,
        "miss_blocks": 250,
        "queue_s": 0.0,
        "prefill_s": pytest.approx(4000 / rate),
    }
    assert kv_cold_short["prefill_s"] == pytest.approx(1000 / rate)
    # The repeated prompt recomputes only its last block.
    assert kv_warm_long["cached_tokens"] == 3984
    assert kv_warm_long["prefill_s"] == pytest.approx(16 / rate)
    # What the client saw: at least the planned prefill, and growing with the uncached tokens.
    assert cold_long >= kv_cold_long["prefill_s"]
    assert cold_short >= kv_cold_short["prefill_s"]
    assert cold_long > cold_short > warm_long


async def test_prefill_rate_is_a_knob_and_works_without_a_cache(client: httpx.AsyncClient) -> None:
    resp = await client.put("/test-control/knobs", json={"prefill_tokens_per_s": 100})
    assert resp.json()["prefill_tokens_per_s"] == 100
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "a b c d"}]}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    kv = await _last_kv(client)
    assert (kv["prompt_tokens"], kv["cached_tokens"]) == (4, None)
    assert kv["prefill_s"] == pytest.approx(0.04)
    for bad in ({"prefill_tokens_per_s": -1}, {"prefill_tokens_per_s": "fast"}):
        assert (await client.put("/test-control/knobs", json=bad)).status_code == 400


async def test_cached_tokens_in_every_usage_shape(make_mock: MakeMock) -> None:
    mock = await make_mock(kv_block_size=2, kv_cache_blocks=64)
    chat = {"model": "mock-model", "messages": [{"role": "user", "content": "a b c d e"}]}
    async with httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client:
        await client.post("/v1/chat/completions", json=chat)
        usage = (await client.post("/v1/chat/completions", json=chat)).json()["usage"]
        assert usage["prompt_tokens"] == 5
        assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
        streamed = await client.post(
            "/v1/chat/completions",
            json={**chat, "stream": True, "stream_options": {"include_usage": True}},
        )
        chunks = [c for c in sse_data(streamed.text) if c != "[DONE]"]
        assert '"prompt_tokens_details":{"cached_tokens":4}' in chunks[-1]
        resp = {"model": "mock-model", "input": "a b c d e"}
        await client.post("/v1/responses", json=resp)
        usage = (await client.post("/v1/responses", json=resp)).json()["usage"]
        assert usage["input_tokens_details"] == {"cached_tokens": 4}
        # A prompt the engine model refuses is a 400, not a crash.
        bad = await client.post("/v1/completions", json={"model": "mock-model", "prompt": [1, -2]})
        assert bad.status_code == 400


async def test_usage_without_the_engine_model_is_unchanged(client: httpx.AsyncClient) -> None:
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "a b c"}]}
    usage = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19}
    view = (await client.get("/test-control/kv")).json()
    assert view == {"enabled": False, "tokenizer": None, "events": None}
    assert (await client.get("/test-control")).json()["requests"][-1]["kv"] is None


async def test_hf_tokenizer_counts_the_rendered_chat(make_mock: MakeMock, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = make_model_dir(tmp_path / "model")
    mock = await make_mock(tokenizer=str(model), kv_block_size=4, kv_cache_blocks=64)
    rendered = "<|im_start|>user\nHéllo 你好 🙂<|im_end|>\n<|im_start|>assistant\n"
    expected = Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        rendered, add_special_tokens=False
    )
    body = {"model": "mock-model", "messages": [{"role": "user", "content": "Héllo 你好 🙂"}]}
    async with httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client:
        usage = (await client.post("/v1/chat/completions", json=body)).json()["usage"]
        view = (await client.get("/test-control/kv")).json()
    assert usage["prompt_tokens"] == len(expected.ids)
    assert view["tokenizer"] == f"hf:{model}"
    assert view["blocks"] == len(expected.ids) // 4


async def test_kv_control_view_and_its_errors(make_mock: MakeMock) -> None:
    mock = await make_mock(kv_block_size=8, kv_cache_blocks=10)
    async with httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client:
        view = (await client.get("/test-control/kv")).json()
        assert view["enabled"] is True and view["tokenizer"] == "words"
        assert (view["block_size"], view["capacity"], view["events"]) == (8, 10, None)
        assert (await client.get("/test-control")).json()["kv"] == view
        for params in (
            {"wait_subscribers": 1},  # no KV-event socket to wait on
            {"wait_subscribers": "x"},
            {"wait_subscribers": -1},
            {"timeout": 99},
            {"other": 1},
        ):
            assert (await client.get("/test-control/kv", params=params)).status_code == 400


async def test_the_event_sequence_can_jump_ahead_or_go_back(make_mock: MakeMock) -> None:
    mock = await make_mock(kv_block_size=4, kv_cache_blocks=64, kv_events_port=0)
    async with (
        httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client,
        subscribed(mock, client) as sub,
    ):
        await complete(client, list(range(100, 108)))
        assert (await sub.next()).seq == 0
        reply = await client.put("/test-control/kv/sequence", json={"next_seq": 7})
        assert reply.status_code == 200 and reply.json()["events"]["next_seq"] == 7
        await complete(client, list(range(200, 208)))
        sub.tracker.reset()  # the subscriber checks order itself: this jump is wanted
        assert (await sub.next()).seq == 7
        assert (await client.put("/test-control/kv/sequence", json={"next_seq": 0})).is_success
        await complete(client, list(range(300, 308)))
        sub.tracker.reset()
        assert (await sub.next()).seq == 0  # as after an engine restart
        for bad in ({"next_seq": -1}, {"next_seq": 1 << 64}, {"next_seq": "1"}, {}, [], 3):
            reply = await client.put("/test-control/kv/sequence", json=bad)
            assert reply.status_code == 400, bad
        assert (await client.put("/test-control/kv/sequence", content=b"{")).status_code == 400
    plain = await make_mock(kv_block_size=4, kv_cache_blocks=8)  # no KV-event socket
    async with httpx.AsyncClient(base_url=plain.base_url, timeout=5) as client:
        reply = await client.put("/test-control/kv/sequence", json={"next_seq": 1})
        assert reply.status_code == 400


async def test_waiting_for_a_subscriber_times_out(make_mock: MakeMock) -> None:
    mock = await make_mock(kv_cache_blocks=4, kv_events_port=0)
    async with httpx.AsyncClient(base_url=mock.base_url, timeout=5) as client:
        resp = await client.get("/test-control/kv", params={"wait_subscribers": 1, "timeout": 0})
    assert resp.status_code == 408


def test_config_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    for bad in (
        {"kv_events_port": 0},  # events without a cache
        {"kv_block_size": 0},
        {"kv_block_size": 2048},
        {"kv_cache_blocks": -1},
        {"prefill_tokens_per_s": -1.0},
        {"prefill_tokens_per_s": float("inf")},
        {"kv_cache_blocks": 1, "kv_events_port": 70000},
        {"kv_events_encoding": "json"},
    ):
        with pytest.raises(ValueError):
            MockConfig(**bad)


async def test_a_taken_kv_events_port_fails_the_start() -> None:
    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    try:
        port = holder.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(OSError, match="KV events"):
            await start_mock(MockConfig(kv_cache_blocks=4, kv_events_port=port))
    finally:
        holder.close(0)
        context.term()


async def test_cli_flags_and_the_events_line() -> None:
    proc = await asyncio.create_subprocess_exec(
        str(EXE),
        "--port",
        "0",
        "--kv-block-size",
        "4",
        "--kv-cache-blocks",
        "32",
        "--prefill-tokens-per-s",
        "1000",
        "--kv-events-port",
        "0",
        "--kv-events-encoding",
        "map",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        match = PORT_LINE.fullmatch(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert match
        events_line = await asyncio.wait_for(proc.stdout.readline(), 20)
        events = re.fullmatch(rb"mock-dynamo kv events on (tcp://127\.0\.0\.1:\d+)\n", events_line)
        assert events, events_line
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{int(match.group(1))}") as c:
            view = (await c.get("/test-control/kv")).json()
            knobs = (await c.get("/test-control")).json()["knobs"]
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 10)
    assert (view["block_size"], view["capacity"]) == (4, 32)
    assert view["events"]["endpoint"] == events.group(1).decode()
    assert view["events"]["encoding"] == "map"
    assert knobs["prefill_tokens_per_s"] == 1000
    assert rc == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--kv-events-port", "0"), "kv_cache_blocks"),
        (("--kv-block-size", "0"), "kv-block-size"),
        (("--tokenizer", "/nonexistent-dir"), "tokenizer.json"),
        (("--kv-events-encoding", "json"), "kv-events-encoding"),
    ],
)
async def test_cli_refuses_bad_engine_flags_in_one_line(
    args: tuple[str, ...], message: str
) -> None:
    rc, out, err = await _run_to_exit("--port", "0", *args)
    assert rc == 2
    assert out == b""
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mock-dynamo: error:")
    assert message in lines[0]


NO_EXTRA = """
import asyncio, sys
for name in ("xxhash", "zmq", "jinja2", "tokenizers"):
    sys.modules[name] = None  # as if the mock-kv extra were not installed
from mock_dynamo.server import MockConfig, start_mock

async def main():
    server = await start_mock(MockConfig(prefill_tokens_per_s=1000))
    await server.stop()
    for config in (MockConfig(kv_cache_blocks=4), MockConfig(tokenizer=".")):
        try:
            await start_mock(config)
        except ValueError as exc:
            print(exc)

asyncio.run(main())
"""


async def test_the_mock_starts_without_the_extra_and_says_what_a_flag_needs() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        NO_EXTRA,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    assert lines == [
        "--kv-cache-blocks needs the 'xxhash' package: pip install -e '.[mock-kv]'",
        "--tokenizer needs the 'tokenizers' package: pip install -e '.[mock-kv]'",
    ]

"""mock_dynamo's engine model against Dynamo 1.6.1's own code (``pytest -m dynamo``).

* The block content hashes the mock uses (``pylon.core.blocks``) equal
  ``dynamo._core.compute_block_hash_for_seq`` (salted too), and the mock cache's chained block
  ids equal the ``sequence_hashes`` a ``SelectionService`` selection reports.
* A ``SelectionService`` subscribed to the mock's KV-event socket (both encodings) sees exactly the
  blocks the mock holds: stored, evicted (tails first) and cleared.

No stack is started: the selection core runs in-process, the mock on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytest.importorskip("xxhash", reason="pip install -e '.[mock-kv]'")
pytest.importorskip("zmq", reason="pip install -e '.[mock-kv]'")
core = pytest.importorskip(
    "dynamo._core", reason="ai-dynamo-runtime==1.6.1 is not installed (pip install -e '.[dynamo]')"
)

from mock_dynamo.config import MockConfig  # noqa: E402
from mock_dynamo.kvcache import PrefixCache  # noqa: E402
from mock_dynamo.server import start_mock  # noqa: E402
from pylon.core.blocks import block_hashes  # noqa: E402
from pylon.core.kv_events import BlockStored  # noqa: E402

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(120)]

CORPUS = [
    list(range(100, 148)),
    [0] * 64,
    [(1 << 32) - 1, 7, 0, 12345] * 9,
    list(range(5)),  # shorter than a block: no hash
]
WORKER = 7
INDEX_WAIT_S = 10.0


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _i64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
@pytest.mark.parametrize("salt", [None, "tenant-a", "租户"])
def test_content_hashes_equal_dynamos(block_size: int, salt: str | None) -> None:
    for tokens in CORPUS:
        expected = core.compute_block_hash_for_seq(tokens, block_size, cache_namespace=salt)
        assert block_hashes(tokens, block_size, cache_salt=salt) == list(expected)


async def test_chained_ids_equal_dynamos_sequence_hashes() -> None:
    service = core.SelectionService()
    try:
        await _maybe(
            service.upsert_worker(
                {
                    "worker_id": WORKER,
                    "endpoint": "http://127.0.0.1:9",
                    "block_size": 16,
                    "kv_events_endpoint": "tcp://127.0.0.1:9",
                }
            )
        )
        for n, tokens in enumerate(CORPUS[:3]):
            selection = await _maybe(
                service.select_and_reserve({"token_ids": tokens, "selection_id": f"s{n}"})
            )
            cache = PrefixCache(16, 100)
            _, events = cache.admit(tokens)
            ours = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
            assert [_i64(h) for h in ours] == selection["sequence_hashes"]
    finally:
        service.shutdown()


async def _device_blocks(service: Any, tokens: list[int], salt: str | None = None) -> int:
    prompt: dict[str, Any] = {"token_ids": tokens}
    if salt:
        prompt["cache_salt"] = salt
    scores = await _maybe(service.overlap_scores(prompt))
    workers = [w for w in scores["workers"] if w["worker_id"] == WORKER]
    return int(workers[0]["device_blocks"]) if workers else 0


async def _until(check: Callable[[], Any], want: int) -> int:
    """Dynamo indexes events on its own threads: wait (bounded) for the count to settle."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + INDEX_WAIT_S
    got = await check()
    while got != want and loop.time() < deadline:
        await asyncio.sleep(0.02)
        got = await check()
    return int(got)


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_selection_service_follows_the_mocks_events(encoding: str) -> None:
    mock = await start_mock(
        MockConfig(
            kv_block_size=16, kv_cache_blocks=4, kv_events_port=0, kv_events_encoding=encoding
        )
    )
    service = core.SelectionService()
    try:
        await _maybe(
            service.upsert_worker(
                {
                    "worker_id": WORKER,
                    "endpoint": mock.base_url,
                    "block_size": 16,
                    "kv_events_endpoint": mock.kv_events_endpoint,
                }
            )
        )
        async with httpx.AsyncClient(base_url=mock.base_url, timeout=10) as client:
            waited = await client.get(
                "/test-control/kv", params={"wait_subscribers": 1, "timeout": 20}
            )
            assert waited.status_code == 200, waited.text

            async def send(tokens: list[int], **extra: Any) -> None:
                body = {"model": "mock-model", "prompt": tokens, "max_tokens": 1, **extra}
                assert (await client.post("/v1/completions", json=body)).status_code == 200

            a = list(range(1000, 1064))  # 4 blocks: the whole cache
            await send(a)
            assert await _until(lambda: _device_blocks(service, a), 4) == 4
            # b (2 blocks) evicts a's two tail blocks; Dynamo keeps a's head.
            b = list(range(2000, 2032))
            await send(b)
            assert await _until(lambda: _device_blocks(service, b), 2) == 2
            assert await _until(lambda: _device_blocks(service, a), 2) == 2
            await client.delete("/test-control/kv")
            assert await _until(lambda: _device_blocks(service, b), 0) == 0
            if encoding == "map":
                # Only the map form carries the salt; Dynamo rehashes with it.
                await send(a, nvext={"cache_salt": "tenant-a"})
                assert await _until(lambda: _device_blocks(service, a, "tenant-a"), 4) == 4
                assert await _device_blocks(service, a) == 0
    finally:
        service.shutdown()
        await mock.stop()

"""No non-client input source holds the event loop: discovery (`/v1/models` polled) and the
engine probes (health gate, discovery, worker checks share `pylon.upstream.probe.fetch`). A
`LoopLag` probe (tests/looplag.py) measures the longest loop turn while each is flooded; the
client transports have theirs in tests/transport/test_loop_fairness.py, the KV-event watch in
tests/integration/test_kv_routing.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Iterator

import pytest

from pylon.bringup import MAX_HEALTH_BODY
from pylon.core.upstream import Upstream
from pylon.models import MAX_MODELS
from pylon.upstream.probe import FetchError, fetch
from tests.integration.conftest import MODEL, Stack, StackFactory
from tests.looplag import LoopLag
from tests.observers import EventObserver

MAX_GAP_S = 0.5  # generous for a shared 2-core box, as in tests/transport/test_loop_fairness.py


@pytest.fixture(autouse=True)
def frozen_heap() -> Iterator[None]:
    """The objects the test run holds before a test (thousands of tests' worth, late in the
    suite) are moved out of the collector's sight: a full collection of that heap is a pause of
    the test runner's, not of the source under test, and late in the suite it alone came to
    the bound (0.50 s). What the test allocates is still collected as it goes."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.asynccontextmanager
async def flooding_engine(head: bytes, piece: bytes) -> AsyncIterator[tuple[str, list[int]]]:
    """Answers each request head with `head`, then `piece` over and over as fast as the socket
    takes it, until the peer goes; yields the URL and the bytes written per connection."""
    written: list[int] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        written.append(0)
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head)
            while written[-1] < 512 * 1024 * 1024:
                writer.write(piece)
                written[-1] += len(piece)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", written
    finally:
        server.close()


def published(stack: Stack) -> set[str]:
    return set(stack.running.core.lifecycle.models.published)


@pytest.mark.parametrize("framing", ["content-length", "chunked-1-byte"])
async def test_a_probe_answered_with_an_endless_body_stops_at_its_cap(framing: str) -> None:
    """An engine that answers a probe with an endless body (one huge sized body, or 1-byte
    chunks): the probe stops at its cap (`too_large`) having read a bounded amount, and the
    loop keeps turning meanwhile."""
    if framing == "content-length":
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000\r\n\r\n"
        piece = b"x" * 65536
    else:
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        piece = b"1\r\nx\r\n" * 10_000
    async with flooding_engine(head, piece) as (url, written):
        lag = LoopLag()
        probe = asyncio.create_task(
            fetch(Upstream.from_url(url), "/health", timeout=10, max_body=MAX_HEALTH_BODY)
        )
        took = await lag.until(probe.done, timeout=20)
        with pytest.raises(FetchError) as caught:
            await probe
    assert caught.value.reason == "too_large"
    # The probe stopped reading at its cap: the engine could write little more than what the
    # kernel's socket buffers hold (a few MiB), not the 512 MiB it tried.
    assert written[0] < 64 * 1024 * 1024, written
    assert lag.max_gap < MAX_GAP_S, (lag.max_gap, took)


async def test_discovery_of_a_huge_changing_model_list_keeps_the_loop_turning(
    make_stack: StackFactory,
) -> None:
    """An engine whose `/v1/models` lists the most models allowed, a different set each
    time: each poll publishes and retires thousands of models, and the loop keeps turning."""
    observer = EventObserver()
    stack = await make_stack(observer=observer, model_discovery_interval=0.02)
    lag = LoopLag()
    took = 0.0
    for round_ in range(2):
        names = [f"{'ab'[round_]}-model-{i}" for i in range(MAX_MODELS - 1)] + [MODEL]
        reply = await stack.client.put(
            f"{stack.mock.base_url}/test-control/models", json={"models": names}
        )
        reply.raise_for_status()
        took += await lag.until(lambda new=names[0]: new in published(stack), timeout=60)
    assert published(stack) == set(names)
    assert len(observer.of("model_published")) >= 2 * (MAX_MODELS - 1)
    assert len(observer.of("model_retired")) >= MAX_MODELS - 1
    assert lag.max_gap < MAX_GAP_S, (lag.max_gap, took)

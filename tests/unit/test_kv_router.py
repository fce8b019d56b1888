"""The `kv` router over router_ffi's `SelectionCore` and a stand-in native service (no Dynamo,
no sockets): what a booking tells the core, the DP-rank pins, the admitted-worker filter, every
way a request is routed without KV or refused, and which prompts are tokenized off the loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from pylon.core.plan import ForwardPlan
from pylon.core.priority import NO_WRITE
from pylon.core.record import RequestRecord
from pylon.core.upstream import Upstream
from pylon.routing import NoWorker, kv
from pylon.routing.build import KvOptions, build_kv_router
from pylon.routing.fleet import INSTANCE_PIN_HEADER, Fleet
from pylon.routing.kv import (
    INLINE_TOKENIZE_BYTES,
    INSTANCE_RANK_HEADER,
    URL_RANK_HEADER,
    KvBooking,
    KvRouter,
)
from pylon.routing.spec import parse_worker_spec
from pylon.routing.token_data import TokenDataProver
from tests.observers import EventObserver
from tests.router_ffi.fake_native import FakeNative, FakeSelectionError

FRONTEND = "http://127.0.0.1:8000"
RECORD = RequestRecord("http1", 1, 0.0)  # what the exchange hands its booking with a moment
EV = "kv-events=tcp://127.0.0.1:9"
KV = KvOptions(overlap_weight=None, token_data=False, probe_timeout=5.0)


class Prompts:
    """A tokenizer stand-in: the body's bytes as tokens, None for other routes."""

    def __init__(self) -> None:
        self.fail = False

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        if self.fail:
            raise RuntimeError("tokenizer bug")
        return list(body) if path == "/v1/completions" else None


def plan(body: bytes = b"a prompt of some length", path: str = "/v1/completions") -> ForwardPlan:
    return ForwardPlan("POST", path + "?x=1", (), body, "r", "m", True, (), NO_WRITE)


class Refusing(FakeNative):
    def __init__(self) -> None:
        super().__init__()
        self.refuse: tuple[str, int] | None = None

    def select_and_reserve(self, request: dict[str, Any]) -> Any:
        self.last_request = request
        if self.refuse is not None:
            kind, status = self.refuse
            raise FakeSelectionError("refused", kind, status)
        return super().select_and_reserve(request)


async def kv_router(
    fake: FakeNative, *specs: str, tokenizer: Prompts | None = None
) -> tuple[KvRouter, Fleet, EventObserver]:
    workers = [parse_worker_spec(spec) for spec in specs]
    fleet = Fleet.from_specs(workers, Upstream.from_url(FRONTEND))
    for worker in fleet.workers:
        fleet.set_in_rotation(worker, True)
    observer = EventObserver()
    router = await build_kv_router(KV, fleet, observer, tokenizer or Prompts(), native=lambda: fake)
    return router, fleet, observer


@pytest.fixture
async def fake() -> AsyncIterator[Refusing]:
    native = Refusing()
    yield native
    native.join_helpers()


async def test_a_booking_tells_the_core_what_the_exchange_does(fake: Refusing) -> None:
    router, fleet, events = await kv_router(fake, f"url=http://a:1,{EV},block-size=4")
    assert [e["workers"] for e in events.of("kv_router_started")] == [["http://a:1"]]
    booking = await router.book(plan(b"abcdefgh"))
    assert isinstance(booking, KvBooking) and booking.counts_output
    assert booking.upstream == Upstream("a", 1, "") and booking.headers == ()
    sid = booking.reservation.selection_id
    assert sid.startswith("pylon-")  # minted by pylon
    assert fake.last_request["token_ids"] == list(b"abcdefgh")
    assert "cache_salt" not in fake.last_request or fake.last_request["cache_salt"] is None
    assert fleet.workers[0].active == 1 and fleet.workers[0].decisions == {"kv": 1}
    assert sum(router.select_seconds[:-1]) == 1 and router.select_seconds[-1] > 0
    booking.first_output(RECORD)
    booking.first_output(RECORD)
    booking.output(RECORD, 3)
    booking.output(RECORD, 6)  # 9 tokens: two blocks of 4
    booking.complete(RECORD)
    booking.complete(RECORD)
    assert fleet.workers[0].active == 0
    router.core.quiesce()
    assert fake.ops_for(sid) == [
        "select_and_reserve",
        "prefill_complete",
        "add_output_block",
        "add_output_block",
        "free_reservation",
    ]
    assert fake.reservations == {}
    await router.aclose()
    assert events.of("kv_router_stopped") == [{"drained": True, "abandoned": 0}]
    with pytest.raises(NoWorker, match="shut down"):
        await router.book(plan())  # after the core's shutdown: 503, never a crash
    assert fake.touched_after_shutdown == []


async def test_dp_rank_pins_and_the_instance_pin(fake: Refusing) -> None:
    router, _, _ = await kv_router(
        fake,
        f"url=http://a:1,{EV},kv-events=tcp://127.0.0.1:10,dp-size=2",
        f"instance-id=18446744073709551615,{EV},kv-events=tcp://127.0.0.1:11,dp-size=2",
    )
    first, second = await router.book(plan()), await router.book(plan())
    assert first.headers == ((URL_RANK_HEADER, b"0"),)
    assert second.upstream == Upstream.from_url(FRONTEND)
    assert second.headers == (
        (INSTANCE_PIN_HEADER, b"18446744073709551615"),
        (INSTANCE_RANK_HEADER, b"0"),
    )
    for booking in (first, second):
        booking.complete(RECORD)
    await router.aclose()


async def test_only_admitted_workers_are_offered(fake: Refusing) -> None:
    router, fleet, _ = await kv_router(fake, f"url=http://a:1,{EV}", f"url=http://b:1,{EV}")
    (await router.book(plan())).complete(RECORD)
    assert fake.last_request.get("allowed_worker_ids") is None  # everyone: no filter
    fleet.set_in_rotation(fleet.workers[0], False)
    for _ in range(3):
        booking = await router.book(plan())
        assert booking.worker == "http://b:1"
        booking.complete(RECORD)
    assert list(fake.last_request["allowed_worker_ids"]) == [fleet.workers[1].spec.worker_id]
    fleet.set_in_rotation(fleet.workers[1], False)
    with pytest.raises(NoWorker, match="health checks"):
        await router.book(plan())
    await router.aclose()


async def test_requests_without_a_prompt_or_with_a_failing_tokenizer_go_least_loaded(
    fake: Refusing,
) -> None:
    tokenizer = Prompts()
    router, fleet, events = await kv_router(
        fake, f"url=http://a:1,{EV}", f"url=http://b:1,{EV}", tokenizer=tokenizer
    )
    held = await router.book(plan(path="/v1/embeddings"))
    assert router.fallbacks == 1 and not held.counts_output
    assert (await router.book(plan(body=b""))).worker != held.worker  # no tokens: least-loaded
    tokenizer.fail = True
    await router.book(plan())
    assert router.errors == 1
    assert events.of("kv_routing_failed") == [{"op": "tokenize", "detail": "RuntimeError"}]
    assert fleet.active == 3
    assert not [op for op, _ in fake.calls if op == "select_and_reserve"]
    await router.aclose()


@pytest.mark.parametrize(
    ("refusal", "outcome"),
    [(("not_ready", 503), "no_worker"), (("internal", 500), "fallback")],
)
async def test_what_the_core_refuses(
    fake: Refusing, refusal: tuple[str, int], outcome: str
) -> None:
    router, fleet, events = await kv_router(fake, f"url=http://a:1,{EV}")
    fake.refuse = refusal
    if outcome == "no_worker":
        with pytest.raises(NoWorker, match="no engine worker can take the request now"):
            await router.book(plan())
        assert fleet.active == 0
    else:
        booking = await router.book(plan())  # the core failed: least-loaded, and reported
        assert booking.worker == "http://a:1" and router.errors == 1
        assert events.of("kv_routing_failed")[0]["op"] == "select_and_reserve"
    await router.aclose()


# --- large prompts: off the loop -------------------------------------------------------------

SMALL = b"s" * INLINE_TOKENIZE_BYTES  # the largest body tokenized on the loop
LARGE = b"L" * (INLINE_TOKENIZE_BYTES + 1)


class HeldPrompts(Prompts):
    """`Prompts` that records the thread each prompt was tokenized on and, once `hold()` was
    called, waits in the tokenizer until the test releases it (from the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []
        self.started = threading.Event()
        self.release: threading.Event | None = None
        self.released_in_time: list[bool] = []

    def hold(self) -> threading.Event:
        self.started.clear()
        self.release = threading.Event()
        return self.release

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        self.threads.append(threading.get_ident())
        self.started.set()
        if self.release is not None:
            # On the loop, the test could never release it: the wait would run out.
            self.released_in_time.append(self.release.wait(5))
        return super().prompt_tokens(path, body)


async def test_only_a_body_over_the_threshold_is_tokenized_off_the_loop(fake: Refusing) -> None:
    tokenizer = HeldPrompts()
    router, fleet, _ = await kv_router(fake, f"url=http://a:1,{EV}", tokenizer=tokenizer)
    loop_thread = threading.get_ident()
    for body in (SMALL, LARGE):
        (await router.book(plan(body))).complete(RECORD)
        assert fake.last_request["token_ids"] == list(body)
    assert tokenizer.threads[0] == loop_thread
    assert tokenizer.threads[1] != loop_thread
    # And the loop runs while the large one is tokenized: only the loop can release it.
    release = tokenizer.hold()
    booking = asyncio.create_task(router.book(plan(LARGE)))
    assert await asyncio.to_thread(tokenizer.started.wait, 5)
    release.set()
    (await booking).complete(RECORD)
    assert tokenizer.released_in_time == [True]
    assert fleet.active == 0 and router.errors == 0
    await router.aclose()


async def test_a_request_cancelled_while_its_prompt_is_tokenized_books_nothing(
    fake: Refusing,
) -> None:
    tokenizer = HeldPrompts()
    router, fleet, _ = await kv_router(fake, f"url=http://a:1,{EV}", tokenizer=tokenizer)
    release = tokenizer.hold()
    cancelled = asyncio.create_task(router.book(plan(LARGE)))
    assert await asyncio.to_thread(tokenizer.started.wait, 5)
    cancelled.cancel()  # the client left; the tokenizer thread is still at it
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    release.set()
    # The next large prompt waits for the abandoned one on the one tokenizer thread.
    booking = await router.book(plan(LARGE))
    assert len(tokenizer.threads) == 2 and tokenizer.released_in_time == [True, True]
    booking.complete(RECORD)
    booking.complete(RECORD)
    router.core.quiesce()
    ops = [op for op, _ in fake.calls if op in ("select_and_reserve", "free_reservation")]
    assert ops == ["select_and_reserve", "free_reservation"]  # the second request's alone
    assert fake.reservations == {} and fleet.active == 0
    assert fleet.workers[0].decisions == {"kv": 1}
    await router.aclose()


async def test_a_large_body_gets_its_token_data_off_the_loop(
    fake: Refusing, monkeypatch: pytest.MonkeyPatch
) -> None:
    router, fleet, events = await kv_router(fake, f"url=http://a:1,{EV}")
    prover = TokenDataProver(Prompts(), fleet, events, timeout=1.0)
    prover.proven.add("m")  # --kv-token-data, the plan's model proven
    router.token_data = prover
    threads: list[int] = []
    original = kv.with_token_data

    def recorded(body: bytes, token_ids: Sequence[int]) -> bytes | None:
        threads.append(threading.get_ident())
        return original(body, token_ids)

    monkeypatch.setattr(kv, "with_token_data", recorded)
    for size in (INLINE_TOKENIZE_BYTES, INLINE_TOKENIZE_BYTES + 1):
        body = b'{"prompt":"' + b"x" * (size - 13) + b'"}'
        booking = await router.book(plan(body))
        assert isinstance(booking, KvBooking) and booking.body is not None
        assert json.loads(booking.body)["nvext"]["token_data"] == list(body)
        booking.complete(RECORD)
    assert threads[0] == threading.get_ident() and threads[1] != threads[0]
    await router.aclose()

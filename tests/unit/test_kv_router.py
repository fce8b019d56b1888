"""The `kv` router over router_ffi's `SelectionCore` and a stand-in native service (no Dynamo,
no sockets): what a booking tells the core, the DP-rank pins, the admitted-worker filter, and
every way a request is routed without KV or refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from pylon.core.plan import ForwardPlan
from pylon.core.priority import NO_WRITE
from pylon.core.record import RequestRecord
from pylon.core.target import UpstreamTarget
from pylon.routing import NoWorker
from pylon.routing.build import KvOptions, build_kv_router
from pylon.routing.fleet import INSTANCE_PIN_HEADER, Fleet
from pylon.routing.kv import INSTANCE_RANK_HEADER, URL_RANK_HEADER, KvBooking, KvRouter
from pylon.routing.spec import parse_worker_spec
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
    fleet = Fleet.from_specs(workers, UpstreamTarget.from_url(FRONTEND))
    for worker in fleet.workers:
        fleet.set_admitted(worker, True)
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
    assert booking.target == UpstreamTarget("a", 1, "") and booking.headers == ()
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
    assert second.target == UpstreamTarget.from_url(FRONTEND)
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
    fleet.set_admitted(fleet.workers[0], False)
    for _ in range(3):
        booking = await router.book(plan())
        assert booking.worker == "http://b:1"
        booking.complete(RECORD)
    assert list(fake.last_request["allowed_worker_ids"]) == [fleet.workers[1].spec.worker_id]
    fleet.set_admitted(fleet.workers[1], False)
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

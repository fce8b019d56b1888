"""SelectionCore and Reservation over a fake native object: typed results, the lifecycle guard
(threads), per-request state, ordering, cancellation. No Dynamo needed (default suite)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from router_ffi import (
    INSTALL_HINT,
    CoreWorker,
    GroupLoads,
    InvalidConfig,
    NativeCallFailed,
    NativeUnavailable,
    NotFound,
    NoWorkerAvailable,
    Reservation,
    RouterFfiError,
    Selection,
    SelectionCore,
    SelectionTimeout,
    SelectRequest,
    ServiceClosed,
    TokenPrompt,
    WorkerRecord,
)
from tests.router_ffi.fake_native import FakeNative, Hold

BIG = 2**63 + 12345  # worker ids are u64, often above 2^63


def spec(worker_id: int, block_size: int = 16) -> CoreWorker:
    return CoreWorker(
        worker_id=worker_id,
        endpoint=f"http://127.0.0.1:{9000 + worker_id % 1000}",
        block_size=block_size,
        kv_events=(f"tcp://127.0.0.1:{20000 + worker_id % 1000}",),
    )


def request(tokens: int = 40) -> SelectRequest:
    return SelectRequest(TokenPrompt(list(range(tokens))))


@pytest.fixture
def fake() -> Iterator[FakeNative]:
    native = FakeNative()
    yield native
    native.join_helpers()


@pytest.fixture
def core(fake: FakeNative) -> Iterator[SelectionCore]:
    errors: list[RouterFfiError] = []
    c = SelectionCore(native=lambda: fake, on_error=errors.append)
    c.errors = errors  # type: ignore[attr-defined]
    for wid in (BIG, BIG + 1):
        c.upsert_worker(spec(wid))
    yield c
    c.shutdown()
    assert fake.touched_after_shutdown == []


def test_results_are_typed_and_native_calls_stay_on_the_owner(
    core: SelectionCore, fake: FakeNative
) -> None:
    record = core.upsert_worker(spec(BIG + 2))
    assert isinstance(record, WorkerRecord)
    assert record.worker_id == BIG + 2 and record.schedulable
    res = core.select_and_reserve(request())
    assert isinstance(res, Reservation)
    assert isinstance(res.selection, Selection)
    assert res.selection.worker_id in (BIG, BIG + 1, BIG + 2)
    assert res.selection.endpoint.startswith("http://127.0.0.1:")
    assert res.selection_id.startswith("pylon-")
    loads = core.loads()
    assert all(isinstance(g, GroupLoads) for g in loads)
    assert loads[0].active_requests == 1
    assert {w.worker_id for w in core.workers()} == {BIG, BIG + 1, BIG + 2}
    res.free()
    assert core.quiesce()
    assert core.loads()[0].active_requests == 0
    assert fake.threads == {"router-ffi-owner"}


def test_reservation_calls_reach_the_native_core_in_order(
    core: SelectionCore, fake: FakeNative
) -> None:
    res = core.select_and_reserve(request())
    res.prefill_complete()
    res.prefill_complete()  # second: no-op
    res.output_tokens(15)  # block size 16: no block yet
    res.output_tokens(20)  # 35 tokens: 2 blocks
    res.output_block()
    res.free()
    res.free()  # second: no-op
    res.output_tokens(100)  # after free: no-op
    res.prefill_complete()
    assert core.quiesce()
    assert fake.ops_for(res.selection_id) == [
        "select_and_reserve",
        "prefill_complete",
        "add_output_block",
        "add_output_block",
        "add_output_block",
        "free_reservation",
    ]
    assert core.errors == []  # type: ignore[attr-defined]


def test_a_free_waits_for_the_pending_prefill_complete_of_its_reservation(
    core: SelectionCore, fake: FakeNative
) -> None:
    fake.hold_prefill = Hold()
    res = core.select_and_reserve(request())
    res.prefill_complete()
    assert fake.hold_prefill.started.wait(10)
    res.free()
    core.loads()  # a blocking call after the free: the owner has handled the free by now
    assert fake.ops_for(res.selection_id) == ["select_and_reserve", "prefill_complete"]
    fake.hold_prefill.release.set()
    assert core.quiesce()
    assert fake.ops_for(res.selection_id)[-1] == "free_reservation"
    assert core.loads()[0].active_requests == 0


def test_reservations_change_loads_and_free_returns_them_to_zero(core: SelectionCore) -> None:
    booked = [core.select_and_reserve(request()) for _ in range(6)]
    per_worker = {w.worker_id: w.active_requests for w in core.loads()[0].workers}
    assert per_worker == {BIG: 3, BIG + 1: 3}  # the fake balances by active requests
    for res in booked:
        res.free()
    assert core.quiesce()
    assert core.loads()[0].active_requests == 0


def test_reset_worker_forgets_its_reservations_and_theirs_only(
    core: SelectionCore, fake: FakeNative
) -> None:
    booked = [core.select_and_reserve(request()) for _ in range(4)]
    on_reset = [r for r in booked if r.worker_id == BIG]
    elsewhere = [r for r in booked if r.worker_id != BIG]
    assert len(on_reset) == 2 and len(elsewhere) == 2
    on_reset[0].prefill_complete()
    record = core.reset_worker(spec(BIG))
    assert record.worker_id == BIG and record.schedulable
    assert [op for op, arg in fake.calls if arg == BIG][-2:] == ["delete_worker", "upsert_worker"]
    # The native core forgot the reset worker's load; the other worker's is intact.
    loads = {w.worker_id: w.active_requests for w in core.loads()[0].workers}
    assert loads == {BIG: 0, BIG + 1: 2}
    after = core.select_and_reserve(request())  # made after the reset: a live reservation
    for res in on_reset:  # made before it: every later call is a no-op, never "not found"
        res.prefill_complete()
        res.output_tokens(64)
        res.free()
    for res in [*elsewhere, after]:
        res.prefill_complete()
        res.free()
    assert core.quiesce()
    for res in on_reset:
        ops = fake.ops_for(res.selection_id)
        assert ops in (["select_and_reserve"], ["select_and_reserve", "prefill_complete"])
    for res in [*elsewhere, after]:
        assert fake.ops_for(res.selection_id)[-1] == "free_reservation"
    assert fake.reservations == {} and core.loads()[0].active_requests == 0
    assert core.errors == []  # type: ignore[attr-defined]


def test_reset_worker_adds_a_worker_the_core_did_not_know(
    core: SelectionCore, fake: FakeNative
) -> None:
    record = core.reset_worker(spec(BIG + 7))  # the delete's "not found" is not a failure
    assert record.schedulable and BIG + 7 in fake.workers
    with pytest.raises(InvalidConfig):
        core.reset_worker(spec(BIG, block_size=3))  # validated like an upsert


def test_freeing_twice_from_two_threads_frees_once(core: SelectionCore, fake: FakeNative) -> None:
    for _ in range(20):
        res = core.select_and_reserve(request())
        barrier = threading.Barrier(2)

        def free(r: Reservation = res, b: threading.Barrier = barrier) -> None:
            b.wait()
            r.free()

        threads = [threading.Thread(target=free) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert core.quiesce()
        assert fake.ops_for(res.selection_id).count("free_reservation") == 1
    assert core.errors == []  # type: ignore[attr-defined]


def test_concurrent_reservations_do_not_share_state(core: SelectionCore, fake: FakeNative) -> None:
    results: dict[int, tuple[str, int]] = {}
    start = threading.Barrier(8)

    def one(i: int) -> None:
        start.wait()
        res = core.select_and_reserve(request(16 + i))
        res.prefill_complete()
        res.output_tokens(16 * i + 7)  # i full blocks, a remainder that never makes a block
        res.free()
        results[i] = (res.selection_id, i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert core.quiesce()
    assert len({sid for sid, _ in results.values()}) == 8
    for sid, blocks in results.values():
        assert fake.ops_for(sid) == (
            ["select_and_reserve", "prefill_complete"]
            + ["add_output_block"] * blocks
            + ["free_reservation"]
        )
    assert fake.reservations == {}


def test_shutdown_waits_for_an_in_flight_selection(fake: FakeNative) -> None:
    core = SelectionCore(native=lambda: fake)
    core.upsert_worker(spec(BIG))
    fake.hold_select = Hold()
    got: list[Reservation | BaseException] = []
    reports = []

    def select() -> None:
        try:
            got.append(core.select_and_reserve(request()))
        except BaseException as exc:
            got.append(exc)

    selector = threading.Thread(target=select)
    selector.start()
    assert fake.hold_select.started.wait(10)  # the selection is inside the native core
    stopper = threading.Thread(target=lambda: reports.append(core.shutdown(timeout_s=30)))
    stopper.start()
    while not core.closed:  # the gate closes first; the stopper then waits for the selection
        stopper.join(0.001)
    with pytest.raises(ServiceClosed):
        core.select_and_reserve(request())  # refused at the gate, never reaches the native
    assert not fake.shut_down and stopper.is_alive()
    fake.hold_select.release.set()
    selector.join(10)
    stopper.join(10)
    assert not stopper.is_alive()
    assert isinstance(got[0], Reservation)  # the in-flight call finished first
    assert fake.shut_down
    assert reports[0].drained and reports[0].abandoned == 0
    ops = [op for op, _ in fake.calls]
    assert ops.index("select_and_reserve") < ops.index("shutdown") == len(ops) - 1
    got[0].free()  # after shutdown: a no-op, not a crash
    got[0].prefill_complete()
    got[0].output_tokens(64)
    assert fake.touched_after_shutdown == []
    assert core.shutdown() is reports[0]  # idempotent


def test_shutdown_abandons_a_call_that_outlives_the_drain_timeout(fake: FakeNative) -> None:
    core = SelectionCore(native=lambda: fake)
    core.upsert_worker(spec(BIG))
    fake.hold_select = Hold()
    got: list[BaseException] = []

    def select() -> None:
        try:
            core.select_and_reserve(request())
        except BaseException as exc:
            got.append(exc)

    selector = threading.Thread(target=select)
    selector.start()
    assert fake.hold_select.started.wait(10)
    report = core.shutdown(timeout_s=0.05)
    selector.join(10)
    assert not report.drained and report.abandoned == 1
    assert isinstance(got[0], ServiceClosed)
    assert fake.shut_down
    fake.hold_select.release.set()
    assert fake.touched_after_shutdown == []


def test_a_selection_that_times_out_is_freed_when_it_lands(fake: FakeNative) -> None:
    core = SelectionCore(native=lambda: fake, select_timeout_s=0.05)
    core.upsert_worker(spec(BIG))
    fake.hold_select = Hold()
    with pytest.raises(SelectionTimeout) as info:
        core.select_and_reserve(request())
    assert isinstance(info.value, NoWorkerAvailable) and info.value.status_code == 503
    fake.hold_select.release.set()
    assert core.quiesce()
    (sid,) = [sid for op, sid in fake.calls if op == "select_and_reserve"]
    assert fake.ops_for(str(sid)) == ["select_and_reserve", "free_reservation"]
    assert fake.reservations == {}
    core.shutdown()


async def test_async_selection_cancelled_in_flight_frees_its_booking(fake: FakeNative) -> None:
    core = SelectionCore(native=lambda: fake)
    core.upsert_worker(spec(BIG))
    res = await core.select_and_reserve_async(request())
    assert isinstance(res, Reservation)
    res.free()
    fake.hold_select = Hold()
    task = asyncio.create_task(core.select_and_reserve_async(request()))
    assert await asyncio.to_thread(fake.hold_select.started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    fake.hold_select.release.set()
    assert await asyncio.to_thread(core.quiesce)
    assert fake.reservations == {}
    assert [op for op, _ in fake.calls].count("free_reservation") == 2
    await asyncio.to_thread(core.shutdown)


def test_native_errors_become_typed_errors(core: SelectionCore, fake: FakeNative) -> None:
    with pytest.raises(NotFound) as info:
        core.remove_worker(BIG + 99)
    assert info.value.kind == "not_found" and info.value.status_code == 404
    with pytest.raises(NoWorkerAvailable) as none:
        core.select_and_reserve(SelectRequest(TokenPrompt([1, 2]), allowed_worker_ids=(7,)))
    assert none.value.kind == "scheduler"
    with pytest.raises(InvalidConfig):
        core.upsert_worker(spec(BIG + 5, block_size=3))
    assert BIG + 5 not in fake.workers  # refused before the native call


def test_fire_and_forget_failures_reach_on_error(core: SelectionCore, fake: FakeNative) -> None:
    fake.fail_prefill = True
    res = core.select_and_reserve(request())
    res.prefill_complete()
    res.free()
    assert core.quiesce()
    errors = core.errors  # type: ignore[attr-defined]
    assert len(errors) == 1 and isinstance(errors[0], NativeCallFailed)
    assert errors[0].op == "prefill_complete" and errors[0].status_code == 500
    assert core.failed_ops == 1
    assert fake.reservations == {}  # the free still happened


def test_calls_on_a_reservation_the_core_expired_are_counted_not_reported(
    core: SelectionCore, fake: FakeNative
) -> None:
    """The native core forgets a booking older than its expiry (a long stream): the later
    prefill-complete, output blocks and free answer "not found", which is no failure."""
    res = core.select_and_reserve(request())
    fake.reservations.clear()  # what the core's expiry sweep does
    res.prefill_complete()
    res.output_block()
    res.free()
    assert core.quiesce()
    assert core.errors == []  # type: ignore[attr-defined]
    assert core.failed_ops == 0 and core.expired_ops == 3


def test_a_broken_error_sink_does_not_stop_the_owner(fake: FakeNative) -> None:
    def sink(_: RouterFfiError) -> None:
        raise RuntimeError("broken sink")

    core = SelectionCore(native=lambda: fake, on_error=sink)
    core.upsert_worker(spec(BIG))
    fake.fail_prefill = True
    res = core.select_and_reserve(request())
    res.prefill_complete()
    res.free()
    assert core.quiesce()
    assert core.loads()[0].active_requests == 0
    core.shutdown()


def test_a_factory_that_fails_stops_the_owner_thread() -> None:
    def broken() -> FakeNative:
        raise OSError("no native today")

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RouterFfiError, match="no native today"):
        SelectionCore(native=broken)
    assert {t.name for t in threading.enumerate()} - before == set()


def test_missing_dynamo_raises_native_unavailable_with_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "dynamo", None)
    monkeypatch.setitem(sys.modules, "dynamo._core", None)
    import router_ffi

    assert not router_ffi.native_available()
    with pytest.raises(NativeUnavailable) as info:
        SelectionCore()
    assert "pip install 'pylon[dynamo]'" in str(info.value)
    assert INSTALL_HINT in str(info.value)


def test_importing_router_ffi_never_imports_dynamo() -> None:
    code = (
        "import sys; sys.modules['dynamo'] = None; sys.modules['xxhash'] = None\n"
        "import router_ffi, router_ffi.hashing, pylon.core.blocks, pylon.core.kv_events\n"
        "loaded = [m for m, mod in sys.modules.items() if mod and m.split('.')[0] == 'dynamo']\n"
        "assert not loaded, loaded\n"
        "try:\n"
        "    router_ffi.hashing.hash_prompt([1, 2], 1)\n"
        "except router_ffi.DependencyMissing as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "xxhash" in out.stdout and "pip install 'pylon[dynamo]'" in out.stdout


def test_the_overlap_weight_reaches_the_native_core_before_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The native core reads its cost weights from the environment as it is built."""
    from router_ffi.service import OVERLAP_WEIGHT_ENV

    monkeypatch.setenv(OVERLAP_WEIGHT_ENV, "unset")  # recorded, so teardown restores it
    monkeypatch.delenv(OVERLAP_WEIGHT_ENV)
    seen: list[str | None] = []

    def build() -> FakeNative:
        seen.append(os.environ.get(OVERLAP_WEIGHT_ENV))
        return FakeNative()

    core = SelectionCore(native=build, overlap_score_weight=8)
    try:
        core.loads()  # the native object exists once the owner thread built it
    finally:
        core.shutdown()
    assert seen == ["8.0"]
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="overlap_score_weight"):
            SelectionCore(native=build, overlap_score_weight=bad)

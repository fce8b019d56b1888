"""Start-up checks: each failure is one InvalidConfig with one clear line (property tests)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router_ffi import (
    CoreWorker,
    InvalidConfig,
    check_block_size,
    check_dp_size,
    check_kv_events_endpoint,
    check_worker,
    check_worker_id,
    check_workers,
)

U64_MAX = 2**64 - 1


def worker(worker_id: int = 2**63 + 5, **changes: object) -> CoreWorker:
    base = CoreWorker(
        worker_id=worker_id,
        endpoint="http://127.0.0.1:9001",
        block_size=16,
        kv_events=("tcp://127.0.0.1:5557",),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def one_line(exc: pytest.ExceptionInfo[InvalidConfig]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


@given(st.integers(min_value=0, max_value=10))
def test_every_power_of_two_up_to_1024_is_a_block_size(exp: int) -> None:
    assert check_block_size(2**exp) == 2**exp


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_block_size_is_a_power_of_two_in_1_to_1024(value: int) -> None:
    valid = 1 <= value <= 1024 and value & (value - 1) == 0
    if valid:
        assert check_block_size(value) == value
    else:
        with pytest.raises(InvalidConfig) as info:
            check_block_size(value, worker_id=7)
        assert one_line(info) == (
            f"worker 7: block size must be a power of two in 1..1024, got {value}"
        )


@pytest.mark.parametrize("value", [True, 16.0, "16", None])
def test_block_size_must_be_an_int(value: object) -> None:
    with pytest.raises(InvalidConfig):
        check_block_size(value)


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_worker_id_is_a_u64(value: int) -> None:
    if 0 <= value <= U64_MAX:
        assert check_worker_id(value) == value
    else:
        with pytest.raises(InvalidConfig) as info:
            check_worker_id(value)
        assert "u64" in one_line(info)


@given(st.integers(min_value=-(2**40), max_value=2**40))
def test_dp_size_is_at_least_one(value: int) -> None:
    if 1 <= value <= 2**32 - 1:
        assert check_dp_size(value) == value
    else:
        with pytest.raises(InvalidConfig) as info:
            check_dp_size(value, worker_id=3)
        assert one_line(info) == f"worker 3: dp-size must be an integer >= 1, got {value}"


@given(st.lists(st.integers(min_value=0, max_value=U64_MAX), min_size=1, max_size=12))
def test_worker_ids_must_be_unique(ids: list[int]) -> None:
    specs = [worker(i) for i in ids]
    if len(set(ids)) == len(ids):
        assert check_workers(specs) == tuple(specs)
    else:
        with pytest.raises(InvalidConfig) as info:
            check_workers(specs)
        assert "configured twice" in one_line(info)


@given(
    host=st.sampled_from(["127.0.0.1", "localhost", "[::1]", "10.0.0.5"]),
    port=st.integers(min_value=-5, max_value=70000),
)
def test_kv_events_endpoint_tcp(host: str, port: int) -> None:
    endpoint = f"tcp://{host}:{port}"
    if 1 <= port <= 65535:
        assert check_kv_events_endpoint(endpoint) == endpoint
    else:
        with pytest.raises(InvalidConfig) as info:
            check_kv_events_endpoint(endpoint)
        assert "tcp://HOST:PORT" in one_line(info)


@given(st.text(max_size=40))
def test_kv_events_endpoint_never_crashes(text: str) -> None:
    try:
        assert check_kv_events_endpoint(text) == text
    except InvalidConfig as exc:
        assert "\n" not in str(exc)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dp_size": 2}, "needs one KV-event endpoint per data-parallel rank (dp-size 2), got 1"),
        (
            {"kv_events": ()},
            "needs one KV-event endpoint per data-parallel rank (dp-size 1), got 0",
        ),
        ({"kv_events": ("http://127.0.0.1:5557",)}, "KV-event endpoint must be tcp://"),
        ({"endpoint": ""}, "endpoint must be a non-empty string"),
        ({"dp_start_rank": -1}, "dp start rank must be an integer >= 0"),
        ({"total_kv_blocks": 0}, "total_kv_blocks must be a positive integer"),
        ({"model_name": ""}, "model name must be a non-empty string"),
        ({"replay_endpoint": "nope"}, "KV-event endpoint must be tcp://"),
    ],
)
def test_worker_spec_failures_name_the_worker(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        check_worker(worker(42, **changes))
    text = one_line(info)
    assert text.startswith("worker 42: ") and message in text


def test_a_data_parallel_worker_with_one_endpoint_per_rank_is_valid() -> None:
    spec = worker(
        dp_size=2, dp_start_rank=4, kv_events=("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    )
    assert check_worker(spec) is spec

"""Typed values <-> native dicts, on shapes recorded from the 1.6.1 SelectionService."""

from __future__ import annotations

import pytest

from router_ffi import CoreWorker, HashedPrompt, NativeCallFailed, SelectRequest, TokenPrompt, _wire
from router_ffi._native import translate
from router_ffi.errors import InvalidRequest, NotFound, NoWorkerAvailable

BIG = 18446744073709551611  # 2^64 - 5

SELECTION = {
    "selection_id": "s1", "sequence_hashes": [-3136036677815684470], "isl_tokens": 1000,
    "track_prefill_tokens": True, "model_name": "default", "routing_group": "default",
    "worker_id": BIG, "dp_rank": 0, "endpoint": "http://127.0.0.1:9001", "block_size": 16,
    "overlap": {"longest_matched": 64, "gpu": 64, "dp": {"0": 64}, "cpu": 64, "disk": 64},
    "effective_prefill_tokens": 936, "potential_decode_blocks": 63,
}  # fmt: skip
RECORD = {
    "worker_id": BIG, "model_name": "default", "routing_group": "default",
    "lifecycle": "incomplete", "endpoint": "http://127.0.0.1:9001", "kv_events_endpoint": None,
    "block_size": 16, "taints": [], "topology_domains": {},
    "not_schedulable_reasons": ["kv_events endpoint is required for dp_rank 0"],
}  # fmt: skip
LOADS = [
    {
        "model_name": "default", "routing_group": "default", "pending_count": 0,
        "pending_isl_tokens": 0,
        "loads": [
            {"worker_id": 9, "dp_rank": 0, "potential_prefill_tokens": 3,
             "potential_decode_blocks": 4, "active_requests": 1},
            {"worker_id": 8, "dp_rank": 0, "potential_prefill_tokens": 0,
             "potential_decode_blocks": 0, "active_requests": 0},
        ],
    }
]  # fmt: skip


def test_selection_record_and_loads_parse() -> None:
    s = _wire.parse_selection("select_and_reserve", SELECTION)
    assert (s.selection_id, s.worker_id, s.overlap_tokens, s.effective_prefill_tokens) == (
        "s1",
        BIG,
        64,
        936,
    )
    r = _wire.parse_record("upsert_worker", RECORD)
    assert not r.schedulable
    assert r.not_schedulable_reasons == ("kv_events endpoint is required for dp_rank 0",)
    (group,) = _wire.parse_loads("loads", LOADS)
    assert [w.worker_id for w in group.workers] == [8, 9] and group.active_requests == 1


@pytest.mark.parametrize(
    "raw",
    [None, [], {"worker_id": "1"}, {**SELECTION, "worker_id": None}, {**SELECTION, "overlap": 3}],
)
def test_an_unexpected_native_shape_fails_loudly(raw: object) -> None:
    with pytest.raises(NativeCallFailed) as info:
        _wire.parse_selection("select_and_reserve", raw)
    assert info.value.kind == "bad_response"


def test_requests_carry_only_what_is_set() -> None:
    req = SelectRequest(TokenPrompt([1, 2, 3], cache_salt="t"), allowed_worker_ids=(BIG,))
    assert _wire.select_to_native(req, "id1") == {
        "selection_id": "id1",
        "allowed_worker_ids": (BIG,),
        "token_ids": [1, 2, 3],
        "cache_salt": "t",
    }
    hashed = SelectRequest(HashedPrompt([-1], [-1], 16), model_name="m")
    assert _wire.select_to_native(hashed, "id2") == {
        "selection_id": "id2",
        "model_name": "m",
        "block_hashes": [-1],
        "sequence_hashes": [-1],
        "isl_tokens": 16,
    }


def test_worker_specs_use_int_rank_keys_for_data_parallel() -> None:
    one = CoreWorker(BIG, "e", 16, ("tcp://127.0.0.1:1",))
    assert _wire.worker_to_native(one)["kv_events_endpoint"] == "tcp://127.0.0.1:1"
    dp = CoreWorker(BIG, "e", 16, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2"), 2, 4)
    native = _wire.worker_to_native(dp)
    assert native["kv_events_endpoints"] == {4: "tcp://127.0.0.1:1", 5: "tcp://127.0.0.1:2"}
    assert (native["data_parallel_start_rank"], native["data_parallel_size"]) == (4, 2)


class _NativeError(Exception):
    def __init__(self, kind: str, status_code: int) -> None:
        super().__init__(kind)
        self.kind = kind
        self.status_code = status_code


def test_native_errors_translate_by_status() -> None:
    assert isinstance(translate("s", _NativeError("not_ready", 503)), NoWorkerAvailable)
    assert isinstance(translate("s", _NativeError("not_found", 404)), NotFound)
    conflict = translate("s", _NativeError("conflict", 409))
    assert type(conflict) is NativeCallFailed and conflict.status_code == 409  # type: ignore[attr-defined]
    assert isinstance(translate("s", OverflowError("int too big")), InvalidRequest)
    assert translate("s", RuntimeError("x")).kind == "internal"  # type: ignore[attr-defined]

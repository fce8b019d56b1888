"""The registration snapshot and its parts, without a network: the wire numbers pinned against
a table written here (from the gateway's contract, not read from pylon's .proto), the stats
value's converter, the status gating and the token file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.gateway import stargate_pb2 as pb
from pylon.gateway.board import GatewayBoard, ModelHealth
from pylon.gateway.registration import (
    MAX_TOKEN_BYTES,
    RegistrationOptions,
    TokenUnreadable,
    build_snapshot,
    read_token,
)
from pylon.gateway.stats import ModelStatsValue

# The contract (docs/reference: stargate-contract.md B1, pylon-inventory.md 1.2), by hand.
GOLDEN: dict[str, dict[str, int]] = {
    "StargateInfo": {
        "stargate_id": 1,
        "advertise_addr": 2,
        "http_advertise_addr": 3,
        "grpc_pylon_dial_addr": 4,
    },
    "WatchStargatesResponse": {"stargates": 1, "watch_stargate_urls": 2},
    "InferenceServerRegistration": {
        "inference_server_id": 1,
        "inference_server_url": 2,
        "models": 3,
        "reverse_tunnel": 4,
        "cluster_id": 5,
    },
    "InferenceServerModelRegistration": {"stats": 1, "status": 2},
    "InferenceServerAck": {"reverse_tunnel_target": 1, "reverse_tunnel_pylon_dial_addr": 3},
    "ModelStats": {
        "last_mean_input_tps": 1,
        "output_tps": 2,
        "queue_size": 3,
        "queued_input_size": 4,
        "max_output_tps": 5,
        "kv_cache_capacity_tokens": 6,
        "kv_cache_used_tokens": 7,
        "kv_cache_free_tokens": 8,
        "num_running_queries": 9,
        "max_engine_concurrency": 10,
        "total_query_input_size": 11,
        "queue_time_estimate_ms_by_priority": 12,
        "input_processing_queries": 13,
        "output_generation_queries": 14,
        "stats_observed_at_unix_ms": 15,
        "stats_capabilities": 16,
        "stats_sources": 17,
    },
}
GOLDEN_STATUS = {
    "INFERENCE_SERVER_STATUS_UNKNOWN": 0,
    "INFERENCE_SERVER_STATUS_ACTIVE": 1,
    "INFERENCE_SERVER_STATUS_INACTIVE": 2,
}
# Proto3 wire types: 0 varint, 1 fixed64, 2 length-delimited.
GOLDEN_STATS_WIRE = {1: 1, 2: 1, 5: 1, 12: 2, 16: 2, 17: 2} | {
    n: 0 for n in (3, 4, 6, 7, 8, 9, 10, 11, 13, 14, 15)
}


@pytest.mark.parametrize("message", sorted(GOLDEN))
def test_field_numbers_match_the_contract(message: str) -> None:
    descriptor = getattr(pb, message).DESCRIPTOR
    assert {f.name: f.number for f in descriptor.fields} == GOLDEN[message]


def test_status_values_match_the_contract() -> None:
    values = {v.name: v.number for v in pb.InferenceServerStatus.DESCRIPTOR.values}
    assert values == GOLDEN_STATUS


def _fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """An independent proto wire decoder: (field number, wire type, value) in order."""
    out: list[tuple[int, int, bytes | int]] = []
    i = 0

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            byte = data[i]
            i += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        value: bytes | int
        if wire == 0:
            value = varint()
        elif wire == 1:
            value = data[i : i + 8]
            i += 8
        elif wire == 2:
            length = varint()
            value = data[i : i + length]
            i += length
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        out.append((number, wire, value))
    return out


def _full_stats() -> ModelStatsValue:
    return ModelStatsValue(
        last_mean_input_tps=1.5,
        output_tps=2.5,
        queue_size=3,
        queued_input_size=4,
        max_output_tps=5.5,
        kv_cache_capacity_tokens=6,
        kv_cache_used_tokens=7,
        kv_cache_free_tokens=8,
        num_running_queries=9,
        max_engine_concurrency=10,
        total_query_input_size=11,
        queue_time_estimate_ms_by_priority={0: 12, 5: 120},
        input_processing_queries=13,
        output_generation_queries=14,
        stats_observed_at_unix_ms=15,
        stats_capabilities=("queue", "kv"),
        stats_sources=("pylon",),
    )


def _options(**kwargs: object) -> RegistrationOptions:
    values: dict[str, object] = {
        "seeds": ("127.0.0.1:1",),
        "inference_server_id": "node-1",
        "inference_server_url": "quic://10.0.0.5:4433",
    }
    values.update(kwargs)
    return RegistrationOptions(**values)  # type: ignore[arg-type]


def test_snapshot_on_the_wire() -> None:
    board = GatewayBoard(reverse=False)
    snapshot = build_snapshot(
        _options(cluster_id="pool-a"), board, "gw:1", ["m1"], {"m1": _full_stats()}
    )
    top = _fields(snapshot.SerializeToString())
    assert [(n, w) for n, w, _ in top] == [(1, 2), (2, 2), (3, 2), (5, 2)]  # 4 false: omitted
    assert top[0][2] == b"node-1"
    assert top[1][2] == b"quic://10.0.0.5:4433"
    assert top[3][2] == b"pool-a"
    entry = _fields(top[2][2])  # type: ignore[arg-type]  # map entry: key 1, value 2
    assert entry[0] == (1, 2, b"m1")
    model = _fields(entry[1][2])  # type: ignore[arg-type]
    assert [(n, w) for n, w, _ in model] == [(1, 2), (2, 0)]
    assert model[1][2] == 1  # ACTIVE
    stats = _fields(model[0][2])  # type: ignore[arg-type]
    seen = {n: w for n, w, _ in stats}
    assert seen == GOLDEN_STATS_WIRE
    varints = {n: v for n, w, v in stats if w == 0}
    assert varints == {n: n for n in varints}  # each count set to its own field number


def test_snapshot_reverse_and_cluster_default() -> None:
    board = GatewayBoard(reverse=True)
    snapshot = build_snapshot(
        _options(inference_server_url="", reverse_tunnel=True), board, "gw:1", ["m1", "m1"], {}
    )
    top = _fields(snapshot.SerializeToString())
    assert [(n, w) for n, w, _ in top] == [(1, 2), (3, 2), (4, 0), (5, 2)]
    assert snapshot.cluster_id == "node-1"
    assert list(snapshot.models) == ["m1"]
    # No stats measured yet: the zero value, sent as an empty message.
    assert snapshot.models["m1"].stats == pb.ModelStats()


def test_status_gating() -> None:
    board = GatewayBoard(reverse=True)

    def statuses() -> dict[str, int]:
        snap = build_snapshot(_options(), board, "gw:1", ["a", "b"], {})
        return {m: e.status for m, e in snap.models.items()}

    inactive, active = pb.INFERENCE_SERVER_STATUS_INACTIVE, pb.INFERENCE_SERVER_STATUS_ACTIVE
    assert statuses() == {"a": inactive, "b": inactive}  # reverse: no tunnel to gw:1 yet
    board.set_tunnels("gw:1", 1)
    assert statuses() == {"a": active, "b": active}
    board.set_model_health("b", ModelHealth(False, "timeout"))
    assert statuses() == {"a": active, "b": inactive}
    board.start_drain()
    assert statuses() == {"a": inactive, "b": inactive}


def test_stats_value_fields_are_the_protos() -> None:
    names = [f.name for f in dataclasses.fields(ModelStatsValue)]
    assert names == list(GOLDEN["ModelStats"])


_u64 = st.integers(min_value=0, max_value=2**64 - 1)
_float = st.floats(allow_nan=False, allow_infinity=False, width=64)
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)


@given(
    floats=st.tuples(_float, _float, _float),
    counts=st.lists(_u64, min_size=11, max_size=11),
    priorities=st.dictionaries(st.integers(0, 2**32 - 1), _u64, max_size=4),
    capabilities=st.lists(_text, max_size=3),
    sources=st.lists(_text, max_size=3),
)
def test_stats_to_proto_round_trips(
    floats: tuple[float, float, float],
    counts: list[int],
    priorities: dict[int, int],
    capabilities: list[str],
    sources: list[str],
) -> None:
    count_names = [
        n for n, number in GOLDEN["ModelStats"].items() if GOLDEN_STATS_WIRE[number] == 0
    ]
    value = ModelStatsValue(
        last_mean_input_tps=floats[0],
        output_tps=floats[1],
        max_output_tps=floats[2],
        queue_time_estimate_ms_by_priority=priorities,
        stats_capabilities=tuple(capabilities),
        stats_sources=tuple(sources),
        **dict(zip(count_names, counts, strict=True)),
    )
    parsed = pb.ModelStats.FromString(value.to_proto().SerializeToString())
    for name in GOLDEN["ModelStats"]:
        got = getattr(parsed, name)
        want = getattr(value, name)
        if name == "queue_time_estimate_ms_by_priority":
            assert dict(got) == want
        elif name in ("stats_capabilities", "stats_sources"):
            assert tuple(got) == want
        else:
            assert got == want, name


def test_token_file(tmp_path: Path) -> None:
    assert read_token(None) is None
    path = tmp_path / "token"
    path.write_text("  secret-1 \n\n")
    assert read_token(path) == "secret-1"
    path.write_text(" \n")
    with pytest.raises(TokenUnreadable, match="empty"):
        read_token(path)
    path.write_bytes(b"x" * (MAX_TOKEN_BYTES + 1))
    with pytest.raises(TokenUnreadable, match="larger"):
        read_token(path)
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(TokenUnreadable, match="ASCII"):
        read_token(path)
    with pytest.raises(TokenUnreadable, match="FileNotFoundError"):
        read_token(tmp_path / "absent")

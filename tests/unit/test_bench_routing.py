"""The pure parts of the routing benchmark's Dynamo rows (scripts/bench_routing.py) and of
`scripts/dynamo_stack.py`: instance ids from the frontend's /health, the streamed usage, the
policy names, the hit rates and the mockers' timing profile."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "scripts", ROOT / "scripts" / "bench"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import bench_routing as br  # noqa: E402
from dynamo_stack import DynamoStack, worker_ids_from_health  # noqa: E402

U64 = st.integers(min_value=0, max_value=2**64 - 1)
PORTS = st.integers(min_value=1, max_value=65535)


def instance(port: int, instance_id: int, endpoint: str = "generate") -> dict[str, Any]:
    return {
        "endpoint": endpoint,
        "instance_id": instance_id,
        "transport": {"tcp": f"127.0.0.1:{port}/{instance_id:x}/dynamo.backend.generate"},
    }


def test_ids_follow_the_worker_ports_order() -> None:
    health = {
        "instances": [
            instance(27002, 2**64 - 5),
            instance(27001, 17),
            instance(27001, 99, endpoint="clear_kv_blocks"),  # another endpoint: ignored
            {"endpoint": "generate", "instance_id": 3, "transport": {"nats": "x"}},
            "not a record",
        ]
    }
    assert worker_ids_from_health(health, [27001, 27002]) == [17, 2**64 - 5]
    assert worker_ids_from_health(health, [27002]) == [2**64 - 5]


def test_ids_are_none_until_every_worker_is_listed() -> None:
    assert worker_ids_from_health({}, [27001]) is None
    assert worker_ids_from_health({"instances": None}, [27001]) is None
    health = {"instances": [instance(27001, 17)]}
    assert worker_ids_from_health(health, [27001, 27002]) is None
    # A port that only shares a prefix with a worker's port is not that worker.
    assert worker_ids_from_health({"instances": [instance(270011, 5)]}, [27001]) is None


@given(st.dictionaries(PORTS, U64, min_size=1, max_size=8))
def test_ids_round_trip(by_port: dict[int, int]) -> None:
    health = {"instances": [instance(port, wid) for port, wid in by_port.items()]}
    ports = sorted(by_port)
    assert worker_ids_from_health(health, ports) == [by_port[p] for p in ports]


def test_the_stack_maps_ids_to_workers() -> None:
    stack = DynamoStack(num_workers=2, kv_event_ports=[5601, 5602])
    stack.worker_ids = [2**63 + 1, 7]
    assert stack.worker_index(7) == 1
    assert stack.worker_index(2**63 + 1) == 0
    with pytest.raises(ValueError):
        stack.worker_index(8)
    assert stack.kv_events_endpoint(1) == "tcp://127.0.0.1:5602"
    with pytest.raises(ValueError, match="kv_event_ports"):
        DynamoStack(num_workers=1).kv_events_endpoint(0)


def test_the_stack_refuses_per_worker_lists_of_the_wrong_length(tmp_path: Path) -> None:
    stack = DynamoStack(
        num_workers=2, kv_event_ports=[5601], state_dir=tmp_path, model_dir=tmp_path / "m"
    )
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / ".complete").write_text("ok\n")  # no model build: it fails before use
    with pytest.raises(ValueError, match="kv_event_ports must have num_workers entries"):
        stack.start()


def chunk(usage: dict[str, Any] | None) -> bytes:
    return b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n"


def test_usage_is_read_from_the_usage_chunk_only() -> None:
    details = {"prompt_tokens_details": {"cached_tokens": 1024}}
    assert br.usage_of(chunk({"prompt_tokens": 1080, **details})) == (1080, 1024)
    assert br.usage_of(chunk({"prompt_tokens": 1080})) == (1080, 0)
    assert br.usage_of(chunk({"prompt_tokens": 9, "prompt_tokens_details": None})) == (9, 0)
    assert br.usage_of(chunk(None)) is None
    assert br.usage_of(b"data: [DONE]\n") is None
    assert br.usage_of(b'data: {"prompt_tokens": ') is None  # cut short
    assert br.usage_of(b'event: x "prompt_tokens"\n') is None
    assert br.usage_of(chunk({"prompt_tokens": "9"})) is None


def test_hit_rates_from_usage() -> None:
    row = br.Row("dynamo:kv", "kv")
    measured = [
        br.Outcome(ttft_s=0.01, prompt_tokens=100, cached_tokens=96),  # 6 of 6 blocks
        br.Outcome(ttft_s=0.05, prompt_tokens=100, cached_tokens=0),  # 0 of 6
        br.Outcome(ttft_s=0.02),  # no usage chunk: an error of the row
    ]
    br._usage_hit_rates(measured, row, block_size=16)
    assert row.hit_source == br.HIT_FROM_USAGE
    assert row.token_hit_rate == pytest.approx(96 / 200)
    assert row.hit_rate == pytest.approx(6 / 12)
    assert row.errors == 1
    empty = br.Row("dynamo:kv", "kv")
    br._usage_hit_rates([], empty)
    assert math.isnan(empty.hit_rate) and math.isnan(empty.token_hit_rate)


def test_policy_names() -> None:
    assert br.expand_policies("round-robin, dynamo ,kv@8") == [
        "round-robin",
        *br.DYNAMO_DEFAULT.split(","),
        "kv@8",
    ]
    for good in ("kv@8", "dynamo:kv@0.5", "dynamo:frontend-kv@8", "dynamo:round-robin"):
        assert br.valid_policy(good), good
    for bad in ("dynamo:round-robin@8", "dynamo:least-loaded", "kv@-1", "kv@x", "dynamo"):
        assert not br.valid_policy(bad), bad


def test_the_timing_profile_is_the_mocks_cost_model() -> None:
    arrays = br.perf_profile(ttft_ms=1.0, prefill_tokens_per_s=20000.0, itl_ms=2.0)
    isl, ttft = arrays["prefill_isl"], arrays["prefill_ttft_ms"]
    assert isinstance(isl[0], float) and isinstance(ttft[0], float)
    slope = (ttft[1] - ttft[0]) / (isl[1] - isl[0])  # ms per new token
    assert ttft[0] == 1.0 and slope == pytest.approx(1000.0 / 20000.0)
    assert arrays["decode_itl"] == [[2.0, 2.0], [2.0, 2.0]]
    assert len(arrays["decode_active_kv_tokens"]) == len(arrays["decode_context_length"]) == 2

"""The pure parts of the routing benchmark (scripts/bench_routing.py) and of
`scripts/dynamo_stack.py`: instance ids from the frontend's /health, the streamed usage, the
policy names, the hit rates and the mockers' timing profile; for the scale rows, their flags,
how their bookings were shared (from the metrics), the race's order and mis-picks, and the
summary table."""

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


def exposition(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def test_scale_rows_from_the_options() -> None:
    assert br.parse_scales("1, 2,4", "on,off") == [
        br.Scale(processes=1),
        br.Scale(processes=2),
        br.Scale(processes=4),
        br.Scale(replicas=2, sync=True),
        br.Scale(replicas=2, sync=False),
    ]
    assert br.parse_scales("", "") == []
    for processes, replicas in (("0", ""), ("two", ""), ("", "yes"), ("-1", "")):
        with pytest.raises(ValueError):
            br.parse_scales(processes, replicas)
    assert br.Scale().label == "kv, 1 process"
    assert br.Scale(processes=4).label == "kv, 4 processes"
    assert br.Scale(replicas=2, sync=True).label == "kv, 2 replicas, sync on"


def test_the_scale_rows_flags() -> None:
    assert br.Scale().flags(0, []) == []
    assert br.Scale(processes=2).flags(0, []) == ["--processes", "2"]
    synced = br.Scale(replicas=2, sync=True)
    # Each replica publishes on its own port and lists every other one as a peer.
    assert synced.flags(0, [7001, 7002]) == [
        "--replica-sync-port", "7001", "--replica-peer", "127.0.0.1:7002",
    ]  # fmt: skip
    assert synced.flags(1, [7001, 7002]) == [
        "--replica-sync-port", "7002", "--replica-peer", "127.0.0.1:7001",
    ]  # fmt: skip
    assert br.Scale(replicas=2).flags(1, []) == []  # sync off: no flags


def test_how_the_processes_booked_comes_from_the_merged_metrics() -> None:
    gauge = "# TYPE pylon_router_authority_connected gauge"
    both = exposition(
        [
            gauge,
            'pylon_router_authority_connected{process="0"} 1.0',
            'pylon_router_authority_connected{process="1"} 1.0',
        ]
    )
    one_lost = both.replace('"1"} 1.0', '"1"} 0.0')
    assert br.authority_state(both) == (2, 2)
    assert br.authority_state(one_lost) == (1, 2)
    assert br.authority_state("") == (0, 0)  # no authority: the gauge is absent
    scraped = exposition(
        [
            "# TYPE pylon_supervisor_process_scraped gauge",
            'pylon_supervisor_process_scraped{process="0"} 1.0',
            'pylon_supervisor_process_scraped{process="1"} 0.0',
        ]
    )
    assert br.scraped_processes(scraped) == 1
    assert br.scraped_processes(both) == 0
    two = br.Scale(processes=2)
    assert br.booking_label(two, 2, 2) == "authority (2/2 connected)"
    assert br.booking_label(two, 0, 0) == "each process alone (no authority)"
    assert br.booking_label(br.Scale(), 0, 0) == "one process"
    assert br.booking_label(br.Scale(replicas=2, sync=True), 0, 0) == "replica sync"
    assert br.booking_label(br.Scale(replicas=2), 0, 0) == "each replica alone"
    # The KV-event subscribers each worker waits for: two per selection core.
    assert br.cores(None, "-") == 1
    assert br.cores(br.Scale(processes=4), "authority (4/4 connected)") == 1
    assert br.cores(br.Scale(processes=4), "each process alone (no authority)") == 4
    assert br.cores(br.Scale(replicas=2, sync=True), "replica sync") == 2


def test_what_the_run_showed_is_added_to_the_booking() -> None:
    sync = exposition(
        [
            "# TYPE pylon_router_replica_sync_events_total counter",
            'pylon_router_replica_sync_events_total{peer="a",result="applied"} 40.0',
            'pylon_router_replica_sync_events_total{peer="a",result="unknown_worker"} 2.0',
        ]
    )
    synced = br.Scale(replicas=2, sync=True)
    assert br.booking_after(synced, "replica sync", [sync, sync]) == (
        "replica sync (80 peer events applied)"
    )
    assert br.booking_after(synced, "replica sync", [""]) == "replica sync (0 peer events applied)"
    local = exposition(
        [
            "# TYPE pylon_router_authority_events_total counter",
            'pylon_router_authority_events_total{event="local_bookings",process="0"} 3.0',
            'pylon_router_authority_events_total{event="connects",process="0"} 1.0',
        ]
    )
    two = br.Scale(processes=2)
    label = "authority (2/2 connected)"
    assert br.booking_after(two, label, [local]) == f"{label}, 3 booked alone"
    assert br.booking_after(two, label, [""]) == label


def test_the_race_is_replayed_in_send_order() -> None:
    from bench_bookings import mis_picks

    record = {"headers": [["X-Request-Id", "race-12"], ["content-type", "x"]]}
    assert br.race_number(record) == 12
    assert br.race_number({"headers": [["x-request-id", "route-3"]]}) is None
    assert br.race_number({"headers": [["x-request-id", "race-x"]]}) is None
    assert br.race_number({}) is None
    # Worker 0 got requests 0 and 3, worker 1 got 1, worker 2 got 2: an exact rotation.
    order = br.race_order([[3, 0], [1], [2]])
    assert order == [0, 1, 2, 0]
    assert mis_picks([str(w) for w in order], ["0", "1", "2"]) == 0
    # Two processes that both saw worker 0 idle: the second choice is a mis-pick.
    assert mis_picks([str(w) for w in br.race_order([[0, 1], [], []])], ["0", "1", "2"]) == 1


@given(st.lists(st.integers(min_value=0, max_value=3), max_size=60))
def test_the_race_order_inverts_the_spread(choices: list[int]) -> None:
    received: list[list[int]] = [[], [], [], []]
    for n, worker in enumerate(choices):
        received[worker].append(n)
    assert br.race_order(received) == choices


def test_the_scale_summary_and_the_target() -> None:
    one = br.Row(br.Scale().label, "kv", ttft_p99_ms=100.0, hit_rate=0.9, booking="one process")
    one.race = {"50": 0.0, "1000": 0.0}
    four = br.Row(
        br.Scale(processes=4).label, "kv", ttft_p99_ms=120.0, hit_rate=0.8, booking="authority"
    )
    four.race = {"50": 0.0, "1000": 0.015}
    failed = br.Row(br.Scale(replicas=2, sync=True).label, "kv", failed="RuntimeError: x")
    other = br.Row("round-robin", "round-robin", ttft_p99_ms=300.0)
    text = br.scale_table([other, one, four, failed], [50.0, 200.0, 1000.0])
    lines = text.splitlines()
    assert lines[0].startswith("| row | bookings | TTFT p99 ms | p99 vs 1 process |")
    assert lines[0].count("|") == lines[1].count("|") == 9
    assert lines[2] == "| kv, 1 process | one process | 100.0 | 1.00x | 90.0% | 0.0% | - | 0.0% |"
    assert lines[3] == "| kv, 4 processes | authority | 120.0 | 1.20x | 80.0% | 0.0% | - | 1.5% |"
    assert lines[4].startswith("| kv, 2 replicas, sync on | FAILED: RuntimeError: x |")
    assert lines[4].count("|") == 9
    assert len(lines) == 5  # the policy rows are not in it
    (target,) = br.scale_target_lines([one, four, failed])
    assert "kv, 4 processes (authority)" in target and "+20%" in target
    assert target.endswith("NOT within 10 %")
    four.ttft_p99_ms = 105.0
    assert br.scale_target_lines([one, four])[0].endswith(": within 10 %")
    assert br.scale_target_lines([four]) == []  # no one-process row to compare with
    assert br._ratio(math.nan, 1.0) == "-" and br._ratio(1.0, 0.0) == "-"

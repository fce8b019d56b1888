"""Pure bookkeeping rules of mock_dynamo.state and mock_dynamo.config."""

from __future__ import annotations

import pytest

from mock_dynamo.config import MockConfig
from mock_dynamo.state import FaultTable, Knobs, Recorder, RequestRecord


def _record(path: str = "/v1/models") -> RequestRecord:
    return RequestRecord(
        method="GET", path=path, endpoint=path, headers=[], body=None, received_at=0.0
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"flavor": "trt"},
        {"models": ()},
        {"models": ("",)},
        {"ttft_ms": -1},
        {"num_tokens": -1},
        {"capacity": 0},
    ],
)
def test_config_rejects_invalid(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MockConfig(**kwargs)  # type: ignore[arg-type]


def test_cancel_after_finish_is_ignored() -> None:
    recorder = Recorder(capacity=2)
    record = recorder.start(_record())
    recorder.finish(record, 200)
    recorder.cancel(record)
    assert record.cancelled_at is None and recorder.cancelled == 0


def test_last_by_endpoint_model_is_bounded() -> None:
    recorder = Recorder(capacity=2)
    for model in ("a", "b", "c"):
        recorder.set_model(recorder.start(_record()), model)
    assert list(recorder.snapshot()["last_by_endpoint_model"]) == ["/v1/models|b", "/v1/models|c"]


def test_fault_times_zero_never_fires_and_first_match_wins() -> None:
    table = FaultTable()
    table.replace([{"status": 500, "times": 0}, {"status": 502, "times": 1}, {"status": 503}])
    taken = [table.take("/v1/completions", "m", inference=True) for _ in range(3)]
    assert [f.status if f else None for f in taken] == [502, 503, 503]


def test_failed_fault_replace_keeps_previous() -> None:
    table = FaultTable()
    table.replace([{"status": 500}])
    with pytest.raises(ValueError):
        table.replace([{"status": 501}, {"bogus": True}])
    fault = table.take("/v1/completions", None, inference=True)
    assert fault is not None and fault.status == 500


def test_knobs_reject_bool_counts() -> None:
    knobs = Knobs(0.0, 0.0, 4)
    with pytest.raises(ValueError):
        knobs.update({"num_tokens": False})
    knobs.update({"num_tokens": 0})
    assert knobs.num_tokens == 0


def test_record_query_string_and_request_id() -> None:
    record = RequestRecord(
        method="GET",
        path="/a b",
        endpoint="/a b",
        headers=[("X-Request-ID", "r1"), ("x-request-id", "r2")],
        body=None,
        received_at=0.0,
        raw_path="/a%20b?x=1?y#z",
        raw_body=b"\x00\xff",
    )
    assert record.query_string == "x=1?y#z"
    assert record.has_request_id("r1") and record.has_request_id("r2")
    assert not record.has_request_id("R1")
    as_json = record.to_json()
    assert as_json["body_b64"] == "AP8=" and as_json["body_bytes"] == 2
    assert _record().to_json()["query_string"] == ""


def test_listeners_hear_every_change_and_latest_id_wins() -> None:
    recorder = Recorder(capacity=3)
    calls: list[int] = []

    def listener() -> None:
        calls.append(recorder.total)

    recorder.add_listener(listener)
    first = recorder.start(_with_id("r"))
    recorder.set_model(first, "m")
    recorder.finish(first, 200)
    recorder.cancel(first)  # ignored: already finished, so no change either
    second = recorder.start(_with_id("r"))
    recorder.cancel(second)
    assert calls == [1, 1, 1, 2, 2]
    assert recorder.latest_with_request_id("r") is second
    assert second.has_happened("cancelled") and second.has_happened("finished")
    assert not second.has_happened("completed") and first.has_happened("completed")
    assert recorder.latest_with_request_id("other") is None
    recorder.reset()
    assert calls[-1] == 0 and recorder.latest_with_request_id("r") is None
    recorder.remove_listener(listener)
    recorder.start(_with_id("r"))
    assert len(calls) == 6
    with pytest.raises(ValueError):
        first.has_happened("done")


def _with_id(request_id: str) -> RequestRecord:
    record = _record()
    record.headers = [("X-Request-Id", request_id)]
    return record

"""The metrics' bounded labels and arithmetic, without a server: `MetricsObserver` fed events by
hand, read back through prometheus-client's own parser."""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pylon.core.errors import ClientError, ErrorCode, UpstreamError
from pylon.core.queue import QueueDecision, QueueSnapshot, Result
from pylon.core.record import RequestRecord
from pylon.core.retry import RetryMark
from pylon.core.sanitize import (
    DENIED_BODY_FIELDS,
    DENIED_NVEXT_FIELDS,
    header_denied_reason,
    sanitize_request_headers,
    stripped_control_label,
    stripped_control_labels,
)
from pylon.gateway.board import ModelStatus
from pylon.gateway.registration import GatewayReport
from pylon.metrics import MetricsObserver
from pylon.routing.build import RoutingSnapshot
from pylon.routing.fleet import WorkerView

# --- stripped-control labels ---------------------------------------------------------------


def test_labels_name_the_rule_never_the_client_text() -> None:
    assert stripped_control_label("x-dynamo-request-priority") == ("x-dynamo-*", "header")
    assert stripped_control_label("x-dynamo-anything-at-all-1234") == ("x-dynamo-*", "header")
    assert stripped_control_label("x_dynamo_anything") == ("x_dynamo_*", "header")
    assert stripped_control_label("x-dynamo_mixed") == ("x_dynamo_*", "header")
    assert stripped_control_label("x-worker-instance-id") == ("x-worker-instance-id", "header")
    assert stripped_control_label("x_worker_instance_id") == ("x_worker_instance_id", "header")
    assert stripped_control_label("x_model") == ("x_model", "header")  # a tunnel header's twin
    assert stripped_control_label("priority") == ("priority", "body")
    assert stripped_control_label("nvext.backend_instance_id") == (
        "nvext.backend_instance_id",
        "body",
    )
    assert stripped_control_label("vllm_xargs.session_id") == ("vllm_xargs.session_id", "body")
    assert stripped_control_label("not-a-control") == ("_other", "header")


def test_no_body_label_is_also_a_header_rule() -> None:
    """A plan's `stripped` mixes header names and body paths: their labels cannot collide."""
    bodies = {label for label, location in stripped_control_labels() if location == "body"}
    assert set(DENIED_BODY_FIELDS) <= bodies
    assert {f"nvext.{key}" for key in DENIED_NVEXT_FIELDS} <= bodies
    for label in bodies:
        assert header_denied_reason(label.encode()) is None, label


_header_name = st.one_of(
    st.sampled_from(
        [
            "x-dynamo-",
            "x_dynamo_",
            "x-stargate-",
            "x-gateway-",
            "X-Override-",
            "x-smg-",
            "x-epp-",
            "x-worker-instance-id",
            "x_tenant_id",
            "x_request_id",
            "x_model",
            "x-session-id",
            "forwarded",
            "connection",
            "x-ordinary",
        ]
    ).flatmap(lambda stem: st.text("abcxyz-_0", max_size=8).map(lambda tail: stem + tail)),
    st.text("abcdefghijklmnopqrstuvwxyz-_", min_size=1, max_size=20),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_header_name, max_size=10))
def test_every_stripped_header_has_a_bounded_label(names: list[str]) -> None:
    stripped = sanitize_request_headers([(n.encode(), b"1") for n in names]).stripped
    allowed = stripped_control_labels()
    for name in stripped:
        label = stripped_control_label(name)
        assert label in allowed
        assert label[0] != "_other", name  # whatever the sanitizer strips, a rule matched


def test_the_underscore_twin_of_a_hop_by_hop_field_has_its_own_label() -> None:
    """`keep_alive` is stripped (a stack reading `_` as `-` takes it for `keep-alive`): its
    label names it, as hypothesis once found it fell to `_other`."""
    for name in ("keep_alive", "proxy_connection", "transfer_encoding"):
        assert sanitize_request_headers([(name.encode(), b"1")]).stripped == (name,)
        assert stripped_control_label(name) == (name, "header")
        assert stripped_control_label(name) in stripped_control_labels()


# --- the observer --------------------------------------------------------------------------


def scrape(metrics: MetricsObserver) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {sorted labels: value}."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def record(model: str | None, transport: str = "http1", at: float = 100.0) -> RequestRecord:
    entry = RequestRecord(transport, 1, at)
    entry.model = model
    return entry


def forward(metrics: MetricsObserver, entry: RequestRecord, status: int = 200) -> None:
    """A forwarded request's events, as the proxy sends them, 0.5 s from head to done."""
    entry.dispatched_at = entry.head_at + 0.1
    entry.engine_priority = 7
    metrics.dispatched(entry)
    entry.first_byte_at = entry.first_output_at = entry.head_at + 0.2
    metrics.first_output(entry)
    entry.status = status
    entry.done_at = entry.head_at + 0.5
    metrics.complete(entry)


def test_models_past_the_limit_are_counted_as_other() -> None:
    metrics = MetricsObserver("dynamo", model_limit=2)
    for model in ("a", "b", "c", "d", "a", None, "_other", "_none"):
        forward(metrics, record(model))
    totals = scrape(metrics)["pylon_requests_total"]
    by_model = {dict(labels)["model"]: value for labels, value in totals.items()}
    assert by_model == {"a": 2, "b": 1, "_other": 3, "_none": 2}


def test_in_flight_counts_the_requests_at_the_engine() -> None:
    metrics = MetricsObserver("vllm")
    first, second = record("m", "h2"), record("m", "h2")
    for entry in (first, second):
        entry.dispatched_at = 1.0
        metrics.dispatched(entry)
    key = (("backend", "vllm"), ("model", "m"), ("transport", "h2"))
    assert scrape(metrics)["pylon_requests_in_flight"][key] == 2
    first.done_at = second.done_at = 2.0
    metrics.complete(first)
    assert scrape(metrics)["pylon_requests_in_flight"][key] == 1
    metrics.complete(second)
    assert scrape(metrics)["pylon_requests_in_flight"][key] == 0
    # A request pylon refused before the engine never counted as in flight.
    refused = record("m", "h2")
    metrics.rejected(refused, ClientError("x", code=ErrorCode.MODEL_MISMATCH))
    assert scrape(metrics)["pylon_requests_in_flight"][key] == 0


def test_histograms_are_cumulative() -> None:
    metrics = MetricsObserver("dynamo")
    for _ in range(3):
        forward(metrics, record("m"))
    samples = scrape(metrics)
    buckets = samples["pylon_request_duration_seconds_bucket"]
    assert buckets[(("le", "0.25"), ("model", "m"))] == 0
    assert buckets[(("le", "0.5"), ("model", "m"))] == 3
    assert buckets[(("le", "+Inf"), ("model", "m"))] == 3
    assert samples["pylon_request_duration_seconds_count"][(("model", "m"),)] == 3
    assert abs(samples["pylon_request_duration_seconds_sum"][(("model", "m"),)] - 1.5) < 1e-9
    head = samples["pylon_request_time_to_response_head_seconds_bucket"]
    assert head[(("le", "0.1"), ("model", "m"))] == 0
    assert head[(("le", "0.25"), ("model", "m"))] == 3
    priority = samples["pylon_engine_priority_bucket"]
    assert priority[(("backend", "dynamo"), ("le", "0.0"))] == 0
    assert priority[(("backend", "dynamo"), ("le", "225.0"))] == 3  # 3600 / 16


def test_markings_are_counted_as_written() -> None:
    metrics = MetricsObserver("dynamo", local_connect_retryable=True)
    metrics.rejected(record("m"), UpstreamError("x", code=ErrorCode.SHUTTING_DOWN))
    metrics.upstream_status(record("m"), RetryMark(False, "missing_upstream_retry_header"))
    refused = UpstreamError("refused", code=ErrorCode.UPSTREAM_UNAVAILABLE)
    metrics.upstream_failed(record("m"), refused, after_head=False)
    broken = UpstreamError("cut", code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
    metrics.upstream_failed(record("m"), broken, after_head=True)
    samples = scrape(metrics)
    assert samples["pylon_retry_markings_total"] == {
        (("reason", "shutting_down"), ("retryable", "true")): 1,
        (("reason", "missing_upstream_retry_header"), ("retryable", "false")): 1,
        (("reason", "local_connect_failure"), ("retryable", "true")): 1,
    }
    assert samples["pylon_upstream_errors_total"] == {
        (("reason", "upstream_unavailable"), ("stage", "before_head")): 1,
        (("reason", "upstream_protocol_error"), ("stage", "after_head")): 1,
    }


def test_each_pylon_has_its_own_registry() -> None:
    one, two = MetricsObserver("dynamo"), MetricsObserver("dynamo")
    forward(one, record("m"))
    assert "pylon_requests_total" in scrape(one)
    assert "pylon_requests_total" not in scrape(two)


# --- the exposition, byte for byte ---------------------------------------------------------

GOLDEN_EXPOSITION = Path(__file__).with_name("metrics_exposition.golden.txt")


def answered(metrics: MetricsObserver, entry: RequestRecord, status: int, priority: int) -> None:
    """An engine's answer: dispatched at +0.125 s, head and first output at +0.25 s, done at
    +0.5 s (binary fractions, so the sums print exactly)."""
    entry.dispatched_at, entry.engine_priority = entry.head_at + 0.125, priority
    metrics.dispatched(entry)
    entry.first_byte_at = entry.first_output_at = entry.head_at + 0.25
    entry.status = status
    metrics.response_head(entry)
    metrics.first_output(entry)
    entry.done_at = entry.head_at + 0.5
    metrics.complete(entry)


def feed_fixed_events(metrics: MetricsObserver) -> None:
    """Every event the metrics count, in an order the proxy could send them, and a queue and a
    routing snapshot: every family of `METRICS` gets a value."""
    streamed = record("m", "h2")  # a stream: tokens, priority, stripped controls
    streamed.stripped = ("x-dynamo-request-priority", "nvext.backend_instance_id")
    streamed.input_tokens, streamed.input_tokens_source = 100, "usage"
    streamed.output_tokens, streamed.output_tokens_source = 20, "estimate"
    metrics.admitted(streamed)
    streamed.dispatched_at, streamed.engine_priority = streamed.head_at + 0.125, 7
    metrics.dispatched(streamed)
    streamed.first_byte_at, streamed.status = streamed.head_at + 0.25, 200
    metrics.response_head(streamed)
    streamed.first_output_at = streamed.head_at + 1.5
    metrics.first_output(streamed)
    metrics.output(streamed, 19)
    streamed.done_at = streamed.head_at + 3.0
    metrics.complete(streamed)
    unreachable = record("m")  # dispatched, never answered
    unreachable.dispatched_at = unreachable.head_at + 0.25
    metrics.dispatched(unreachable)
    refused = UpstreamError("refused", code=ErrorCode.UPSTREAM_UNAVAILABLE)
    metrics.upstream_failed(unreachable, refused, after_head=False)
    unreachable.status, unreachable.done_at = 503, unreachable.head_at + 0.75
    metrics.complete(unreachable)
    cut = record("m", "h3")  # the engine broke off after its head
    cut.input_tokens, cut.input_tokens_source = 3000, "gateway"
    answered(metrics, cut, 200, 7)
    broken = UpstreamError("cut", code=ErrorCode.UPSTREAM_PROTOCOL_ERROR)
    metrics.upstream_failed(cut, broken, after_head=True)
    answered(metrics, record("beyond-the-limit", "h3"), 404, 7)
    metrics.upstream_status(record("m"), RetryMark(False, "missing_upstream_retry_header"))
    waiting = record("m", "h2")  # still at the engine at the scrape
    waiting.dispatched_at, waiting.engine_priority = waiting.head_at + 0.125, 3600
    metrics.dispatched(waiting)
    nameless = record(None)
    nameless.stripped = ("x_dynamo_anything",)
    metrics.rejected(nameless, ClientError("no model", code=ErrorCode.MISSING_MODEL))
    accepted = QueueDecision(Result.ACCEPTED, "m", 7, 100, 80, 125)
    metrics.queue_gate(record("m"), accepted)
    metrics.queue_gate(record("m"), accepted)
    metrics.queue_gate(record("m"), QueueDecision(Result.UNKNOWN_ESTIMATE, "m", 7, 100, None, 0))
    metrics.crashed(None, None)
    metrics.transport_event("flood_guard", "h2", frames=1000)
    metrics.transport_event("client_timeout", "http1")
    metrics.transport_event("flood_guard", "h2")
    metrics.process_event("tls_identity_loaded", not_after="2030-01-01T00:00:00+00:00")
    metrics.process_event("tls_reloaded", not_after="2031-01-01T00:00:00+00:00")
    metrics.process_event("tls_reload_rejected", reason="key mismatch")
    metrics.process_event("model_discovery_poll", outcome="ok", reason=None)
    metrics.process_event("model_discovery_poll", outcome="failed", reason="timeout")
    metrics.process_event("model_published", model="m")
    metrics.process_event("model_published", model="n")
    metrics.process_event("readiness_changed", ready=True, reason="ready", detail=None)
    metrics.process_event("model_retired", model="n")
    metrics.queue_snapshot = lambda: (
        QueueSnapshot("m", 2000.0, 1, 50, 1, 100, 0, ((0, 75), (7, 125)), 50),
        QueueSnapshot("beyond-the-limit", 10.0, 0, 0, 0, 0, 0, (), 0),  # no label of its own
        QueueSnapshot("unseen", None, 0, 0, 0, 0, 0, (), None),  # never counted: no label
    )
    workers = (
        WorkerView("w0", in_rotation=True, active=2, decisions={"kv": 5}, kv_faults={"gap": 1}),
        WorkerView(
            "w1",
            in_rotation=False,
            active=0,
            decisions={},
            kv_faults={},
            ejected=True,
            ejections={"status_5xx": 2, "connect_failure": 1},
        ),
    )
    select = (4, 1, 0, 0.0125)  # counts per bound, +Inf, sum
    metrics.routing_snapshot = lambda: RoutingSnapshot(
        "kv",
        workers,
        (0.001, 0.01),
        select,
        catalogue_digest="0123456789abcdef",
        core_active={"w0": 5, "w1": 0},
        replica_sync_events={
            ("10.0.0.2:7000", "applied"): 9,
            ("10.0.0.2:7000", "unknown_worker"): 1,
        },
        catalogue_reloads=(3, 1),
        authority=(True, {"connects": 2, "losses": 1, "timeouts": 0, "local_bookings": 3}),
    )
    metrics.gateway_report = lambda: {
        "gw-a.example:50071": GatewayReport(
            connected=True,
            acks_total=42,
            reconnects_total={"unavailable": 2, "unauthenticated": 1},
            model_status={"m": ModelStatus.ACTIVE, "n": ModelStatus.INACTIVE},
            tunnels=2,
            tunnel_refusals={"duplicate connection": 1},
        ),
        "10.0.0.9:50071": GatewayReport(
            connected=False, acks_total=0, reconnects_total={"connect_timeout": 3}, model_status={}
        ),
    }


PEER = "10.0.0.2:7000"


def exposition(metrics: MetricsObserver) -> str:
    """The /metrics text, the process collector's families left out (their values move)."""
    lines = generate_latest(metrics.registry).decode().splitlines(keepends=True)
    process = [line for line in lines if _family_of(line).startswith("pylon_process_")]
    assert process, "the process collector is registered"
    return "".join(line for line in lines if line not in process)


def _family_of(line: str) -> str:
    return line.removeprefix("# HELP ").removeprefix("# TYPE ")


def test_the_exposition_is_pinned_byte_for_byte() -> None:
    """Every family's name, help, type, label order, sample order and number formatting, as
    scraped: a change here is a change for every dashboard, alert and recording rule. Do not
    regenerate the golden file to make this pass: find out what changed the text."""
    metrics = MetricsObserver("dynamo", model_limit=1)
    feed_fixed_events(metrics)
    build = f'python="{platform.python_version()}",version="{metadata.version("pylon")}"'
    golden = GOLDEN_EXPOSITION.read_text(encoding="utf-8")
    assert exposition(metrics) == golden.replace('python="PYTHON",version="VERSION"', build)

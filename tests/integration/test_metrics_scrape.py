"""`/metrics` scraped from the admin listener after known traffic over HTTP/1.1, HTTP/2 and HTTP/3.

The metric names, types and label sets are pinned against the hand-written list below, not
against pylon's own `METRICS` table: renaming a metric or a label is a change for every
dashboard and alert, and must show up here. The counts must move as the traffic says.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.certs import make_ca, make_leaf, write_pair
from tests.stack import MODEL, PROTOCOLS, Stack, StackFactory

CHAT = "/v1/chat/completions"

# family (as Prometheus' parser names it: counters without `_total`) -> (type, label names)
GOLDEN: dict[str, tuple[str, frozenset[str]]] = {
    "pylon_build_info": ("gauge", frozenset({"version", "python"})),
    "pylon_requests": ("counter", frozenset({"model", "status_class", "transport", "backend"})),
    "pylon_requests_in_flight": ("gauge", frozenset({"model", "transport", "backend"})),
    "pylon_request_time_to_response_head_seconds": ("histogram", frozenset({"model"})),
    "pylon_request_time_to_first_output_seconds": ("histogram", frozenset({"model"})),
    "pylon_request_duration_seconds": ("histogram", frozenset({"model"})),
    "pylon_request_input_tokens": ("histogram", frozenset({"model", "source"})),
    "pylon_request_output_tokens": ("histogram", frozenset({"model", "source"})),
    "pylon_engine_priority": ("histogram", frozenset({"backend"})),
    "pylon_upstream_errors": ("counter", frozenset({"reason", "stage"})),
    "pylon_retry_markings": ("counter", frozenset({"reason", "retryable"})),
    "pylon_stripped_controls": ("counter", frozenset({"control", "location"})),
    "pylon_transport_events": ("counter", frozenset({"protocol", "event"})),
    "pylon_request_crashes": ("counter", frozenset()),
    "pylon_queue_admission_decisions": ("counter", frozenset({"result"})),
    "pylon_queue_estimate_milliseconds": ("gauge", frozenset({"model", "level"})),
    "pylon_queue_input_tokens_per_second": ("gauge", frozenset({"model"})),
    "pylon_model_discovery_polls": ("counter", frozenset({"outcome", "reason"})),
    "pylon_models_published": ("gauge", frozenset()),
    "pylon_ready": ("gauge", frozenset()),
    "pylon_tls_certificate_expiry_timestamp_seconds": ("gauge", frozenset()),
    "pylon_tls_reloads": ("counter", frozenset({"result"})),
    # With --routing other than off (empty families otherwise: tests/integration/test_routing.py)
    "pylon_router_catalogue_reloads": ("counter", frozenset({"result"})),
    "pylon_router_active_bookings": ("gauge", frozenset({"worker"})),
    "pylon_router_worker_healthy": ("gauge", frozenset({"worker"})),
    "pylon_router_worker_ejected": ("gauge", frozenset({"worker"})),
    "pylon_router_worker_ejections": ("counter", frozenset({"worker", "reason"})),
    "pylon_router_decisions": ("counter", frozenset({"worker", "policy"})),
    "pylon_router_select_seconds": ("histogram", frozenset({"policy"})),
    "pylon_router_kv_event_faults": ("counter", frozenset({"worker", "kind"})),
    "pylon_router_core_active_requests": ("gauge", frozenset({"worker"})),
    "pylon_router_catalogue_info": ("gauge", frozenset({"digest"})),
    "pylon_router_replica_sync_events": ("counter", frozenset({"peer", "result"})),
    # A process booked at the node's booking authority (empty families otherwise)
    "pylon_router_authority_connected": ("gauge", frozenset()),
    "pylon_router_authority_events": ("counter", frozenset({"event"})),
    # The gateway side's families are there without --gateway too, with no series.
    "pylon_gateway_registration_connected": ("gauge", frozenset({"gateway"})),
    "pylon_gateway_acks": ("counter", frozenset({"gateway"})),
    "pylon_gateway_reconnects": ("counter", frozenset({"gateway", "reason"})),
    "pylon_gateway_model_status": ("gauge", frozenset({"gateway", "model"})),
    "pylon_gateway_tunnel_connections": ("gauge", frozenset({"gateway"})),
    "pylon_gateway_tunnel_refusals": ("counter", frozenset({"gateway", "reason"})),
}
# prometheus-client's process collector, namespaced: present, not pinned label by label.
PROCESS = ("pylon_process_cpu_seconds", "pylon_process_resident_memory_bytes")

Samples = dict[str, dict[frozenset[tuple[str, str]], float]]


async def scrape(stack: Stack) -> tuple[dict[str, Any], Samples]:
    """(families by name, sample name -> {labels: value})."""
    assert stack.running.admin_url is not None
    reply = await stack.client.get(f"{stack.running.admin_url}/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(reply.text)}
    samples: Samples = {}
    for family in families.values():
        for sample in family.samples:
            samples.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return families, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels (0 when absent)."""
    return samples.get(name, {}).get(frozenset(labels.items()), 0.0)


def chat_body(stream: bool = False, **extra: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}]}
    return json.dumps({**body, "max_tokens": 4, "stream": stream, **extra}).encode()


def headers(request_id: str, **extra: str) -> list[tuple[str, str]]:
    return [("x-request-id", request_id), ("x-model", MODEL), *extra.items()]


async def test_names_types_and_labels_after_traffic_on_every_transport(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 4})
    for protocol in PROTOCOLS:
        # A steering header and a body priority: both stripped, both counted.
        reply = await stack.send(
            protocol,
            CHAT,
            headers(f"ok-{protocol}", **{"x-dynamo-worker-instance-id": "7", "x-priority": "3"}),
            chat_body(priority=99),
        )
        assert reply.status == 200, reply.body
    # A 4xx rejection: no x-model, refused before the contract (so no model label).
    refused = await stack.send("http1", CHAT, [("x-request-id", "no-model")], chat_body())
    assert refused.status == 400
    families, samples = await scrape(stack)

    pylon = {name for name in families if name.startswith("pylon_")}
    assert pylon - {name for name in pylon if name.startswith("pylon_process_")} == set(GOLDEN)
    for name in PROCESS:
        assert name in families
    for name, (kind, labels) in GOLDEN.items():
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            names = set(sample.labels) - ({"le"} if sample.name.endswith("_bucket") else set())
            assert names == labels, (sample.name, sample.labels)

    for protocol in PROTOCOLS:
        requests = value(
            samples,
            "pylon_requests_total",
            model=MODEL,
            status_class="2xx",
            transport=protocol,
            backend="dynamo",
        )
        assert requests == 1, protocol
        in_flight = value(
            samples, "pylon_requests_in_flight", model=MODEL, transport=protocol, backend="dynamo"
        )
        assert in_flight == 0, protocol
    rejected = value(
        samples,
        "pylon_requests_total",
        model="_none",
        status_class="4xx",
        transport="http1",
        backend="dynamo",
    )
    assert rejected == 1
    assert (
        value(samples, "pylon_retry_markings_total", reason="missing_model", retryable="false") == 1
    )
    stripped_header = value(
        samples, "pylon_stripped_controls_total", control="x-dynamo-*", location="header"
    )
    assert stripped_header == 3
    stripped_body = value(
        samples, "pylon_stripped_controls_total", control="priority", location="body"
    )
    assert stripped_body == 3
    for name in (
        "pylon_request_time_to_response_head_seconds_count",
        "pylon_request_time_to_first_output_seconds_count",
        "pylon_request_duration_seconds_count",
    ):
        assert value(samples, name, model=MODEL) == 3, name
    # x-priority 3 under the default ceiling 3600: Dynamo gets 3597, in the top bucket.
    assert value(samples, "pylon_engine_priority_count", backend="dynamo") == 3
    assert value(samples, "pylon_engine_priority_sum", backend="dynamo") == 3 * 3597
    assert value(samples, "pylon_engine_priority_bucket", backend="dynamo", le="2700.0") == 0
    # The mock's non-stream answers carry usage: 4 completion tokens each.
    assert value(samples, "pylon_request_output_tokens_count", model=MODEL, source="usage") == 3
    assert value(samples, "pylon_request_output_tokens_sum", model=MODEL, source="usage") == 12
    # HTTP/3 needs a TLS identity (self-signed here): its expiry is exported.
    assert stack.running.listeners.h3 is not None
    not_after = stack.identity.current.not_after.timestamp()
    assert value(samples, "pylon_tls_certificate_expiry_timestamp_seconds") == not_after
    assert value(samples, "pylon_tls_reloads_total", result="ok") == 0
    assert value(samples, "pylon_request_crashes_total") == 0
    info = value(
        samples, "pylon_build_info", **dict(families["pylon_build_info"].samples[0].labels)
    )
    assert info == 1


async def test_token_counts_from_usage_the_gateway_or_the_stream(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 5}, quic_listen=None)
    # A stream with usage at its end: the engine's counts.
    with_usage = chat_body(stream=True, max_tokens=5, stream_options={"include_usage": True})
    reply = await stack.send("h2", CHAT, headers("s-usage"), with_usage)
    assert reply.status == 200 and b'"usage"' in reply.body
    # A stream without: the data events are the estimate (role chunk, 5 tokens, finish chunk),
    # and the input is what the gateway said.
    reply = await stack.send(
        "http1",
        CHAT,
        headers("s-estimate", **{"x-input-tokens": "42"}),
        chat_body(True, max_tokens=5),
    )
    assert reply.status == 200
    # The Responses API reports usage in its last event, `response.completed`.
    responses = json.dumps(
        {"model": MODEL, "input": "one two three", "stream": True, "max_output_tokens": 3}
    ).encode()
    reply = await stack.send("http1", "/v1/responses", headers("r-usage"), responses)
    assert reply.status == 200 and b"response.completed" in reply.body
    _, samples = await scrape(stack)
    assert value(samples, "pylon_request_output_tokens_sum", model=MODEL, source="usage") == 5 + 3
    assert value(samples, "pylon_request_output_tokens_sum", model=MODEL, source="estimate") == 7
    assert value(samples, "pylon_request_input_tokens_sum", model=MODEL, source="gateway") == 42
    usage_input = value(samples, "pylon_request_input_tokens_count", model=MODEL, source="usage")
    assert usage_input == 2


async def test_engine_errors_and_markings(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", mock={"num_tokens": 6}, quic_listen=None)
    await stack.faults([{"status": 503, "retryable": True, "times": 1}])
    reply = await stack.send("http1", CHAT, headers("busy"), chat_body())
    assert reply.status == 503
    await stack.faults([{"status": 500, "times": 1}])
    reply = await stack.send("http1", CHAT, headers("broken"), chat_body())
    assert reply.status == 500
    await stack.faults([{"drop_after_events": 2, "times": 1}])
    reply = await stack.send("h2", CHAT, headers("dropped"), chat_body(stream=True))
    assert reply.status == 200 and b"upstream_protocol_error" in reply.body
    _, samples = await scrape(stack)
    marked = value(
        samples,
        "pylon_retry_markings_total",
        reason="upstream_admission_rejected",
        retryable="true",
    )
    assert marked == 1
    not_retryable = value(
        samples,
        "pylon_retry_markings_total",
        reason="upstream_nonretryable_status",
        retryable="false",
    )
    assert not_retryable == 1
    errors = value(
        samples, "pylon_upstream_errors_total", reason="upstream_protocol_error", stage="after_head"
    )
    assert errors == 1
    for status_class, count in (("5xx", 2), ("2xx", 1)):
        total = sum(
            v
            for labels, v in samples["pylon_requests_total"].items()
            if ("status_class", status_class) in labels and ("model", MODEL) in labels
        )
        assert total == count, status_class


async def test_in_flight_while_streaming_and_a_client_that_leaves(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(
        "dynamo", mock={"num_tokens": 400, "token_delay_ms": 20}, quic_listen=None
    )
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    body = chat_body(stream=True, max_tokens=400)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: leaver\r\nx-model: {MODEL}\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while seen.count(b"data:") < 2:  # streaming: at the engine, in flight
        seen += await asyncio.wait_for(reader.read(4096), 5)
    _, samples = await scrape(stack)
    labels = {"model": MODEL, "transport": "http1", "backend": "dynamo"}
    assert value(samples, "pylon_requests_in_flight", **labels) == 1
    writer.transport.abort()
    await stack.wait_record("leaver", "cancelled")
    _, samples = await scrape(stack)
    assert value(samples, "pylon_requests_in_flight", **labels) == 0
    cancelled = value(
        samples, "pylon_transport_events_total", protocol="http1", event="stream_cancelled"
    )
    assert cancelled == 1
    # The head had gone out: a 2xx whose client left; the estimate counts what was relayed.
    assert value(samples, "pylon_requests_total", status_class="2xx", **labels) == 1
    assert value(samples, "pylon_request_output_tokens_count", model=MODEL, source="estimate") == 1


async def test_tls_reloads_are_counted(make_stack: StackFactory, tmp_path: Path) -> None:
    """The reload poller runs hourly here: the test drives `check_reload` itself."""
    ca = make_ca()
    cert, key = write_pair(tmp_path, make_leaf(ca))
    stack = await make_stack(
        "dynamo", tls_cert=str(cert), tls_key=str(key), tls_reload_interval=3600
    )
    identity = stack.identity
    second = make_leaf(ca)
    write_pair(tmp_path, second)
    assert identity.check_reload() is True
    cert.write_bytes(b"not a certificate")
    assert identity.check_reload() is False
    _, samples = await scrape(stack)
    assert value(samples, "pylon_tls_reloads_total", result="ok") == 1
    assert value(samples, "pylon_tls_reloads_total", result="rejected") == 1
    expiry = value(samples, "pylon_tls_certificate_expiry_timestamp_seconds")
    assert expiry == identity.current.not_after.timestamp()


async def test_queue_admission_and_model_discovery_are_counted(make_stack: StackFactory) -> None:
    stack = await make_stack("dynamo", quic_listen=None, initial_input_tps=1000.0)
    expected = {"x-stargate-expected-queue-ms": "5000"}
    reply = await stack.send("http1", CHAT, headers("queue-1", **expected), chat_body())
    assert reply.status == 200
    await stack.send("http1", CHAT, headers("queue-2"), chat_body())  # no header: no decision
    _, samples = await scrape(stack)
    assert value(samples, "pylon_queue_admission_decisions_total", result="accepted") == 1
    assert sum(samples.get("pylon_queue_admission_decisions_total", {}).values()) == 1
    assert value(samples, "pylon_queue_input_tokens_per_second", model=MODEL) == 1000.0
    assert value(samples, "pylon_queue_estimate_milliseconds", model=MODEL, level="idle") == 0
    # Bring-up polled /v1/models once (make_stack's discovery interval is an hour).
    assert value(samples, "pylon_model_discovery_polls_total", outcome="ok", reason="") == 1
    assert value(samples, "pylon_models_published") == 1

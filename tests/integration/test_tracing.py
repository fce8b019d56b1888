"""Tracing over every transport: one `pylon.forward` span per engine exchange, child of the
client's W3C traceparent, and the engine continues pylon's span (it receives a traceparent whose
parent-id is pylon's span id). Spans go to an in-memory exporter; the engine's view is what
mock_dynamo recorded on the wire. With tracing off, nothing is built and the client's trace
context reaches the engine unchanged."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mock_dynamo.server import MockConfig, start_mock
from pylon.core.upstream import Upstream
from pylon.logs import configure_logging
from pylon.observe import LogObserver
from pylon.run import start
from pylon.settings import load_settings
from pylon.tracing import SPAN_NAME
from tests.integration.conftest import MODEL, Stack, StackFactory, header_values
from tests.stack import NO_BRINGUP, PROTOCOLS

CHAT = "/v1/chat/completions"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "gateway=t61rcWkgMzE,other=x"


class SpanWaiter(InMemorySpanExporter):
    """Keeps finished spans; a test awaits the span of one request id (no polling)."""

    def __init__(self) -> None:
        super().__init__()
        self._exported = asyncio.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = super().export(spans)
        self._exported.set()  # the SimpleSpanProcessor exports on the event loop, at span end
        return result

    def of(self, request_id: str) -> list[ReadableSpan]:
        return [
            span
            for span in self.get_finished_spans()
            if span.attributes is not None and span.attributes.get("pylon.request_id") == request_id
        ]

    async def span(self, request_id: str, timeout: float = 5.0) -> ReadableSpan:
        async with asyncio.timeout(timeout):
            while not (found := self.of(request_id)):
                self._exported.clear()
                await self._exported.wait()
        assert len(found) == 1, f"one span per exchange, got {len(found)}"
        return found[0]


def chat(stream: bool = False) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return json.dumps(body).encode()


def tunnel_headers(request_id: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    return [
        ("x-request-id", request_id),
        ("x-model", MODEL),
        *extra,
    ]


def traceparent_of(record: dict[str, Any]) -> tuple[str, str, str, str]:
    """The one traceparent the engine received, split into its four fields."""
    values = header_values(record, "traceparent")
    assert len(values) == 1, values
    version, trace_id, parent_id, flags = values[0].split("-")
    return version, trace_id, parent_id, flags


def attributes(span: ReadableSpan) -> dict[str, Any]:
    assert span.attributes is not None
    return dict(span.attributes)


async def traced_stack(make_stack: StackFactory, **settings: Any) -> tuple[Stack, SpanWaiter]:
    exporter = SpanWaiter()
    stack = await make_stack(span_exporter=exporter, **settings)
    return stack, exporter


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_span_is_the_child_of_the_callers_trace_and_the_parent_of_the_engines(
    make_stack: StackFactory, protocol: str
) -> None:
    stack, exporter = await traced_stack(make_stack)
    rid = f"traced-{protocol}"
    headers = tunnel_headers(
        rid, ("traceparent", TRACEPARENT), ("tracestate", TRACESTATE), ("x-priority", "100")
    )
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert reply.status == 200, reply.body
    span = await exporter.span(rid)

    assert span.name == SPAN_NAME
    assert span.kind is SpanKind.CLIENT
    assert span.context is not None and span.parent is not None
    assert f"{span.context.trace_id:032x}" == TRACE_ID  # the caller's trace
    assert f"{span.parent.span_id:016x}" == PARENT_ID  # under the caller's span
    assert span.parent.is_remote
    assert span.status.status_code is StatusCode.UNSET
    assert attributes(span) == {
        "pylon.request_id": rid,
        "pylon.model": MODEL,
        "pylon.backend": "dynamo",
        "pylon.transport": protocol,
        "pylon.worker": Upstream.from_url(stack.running.upstream).label,
        "pylon.priority": 100,
        "pylon.engine_priority": 3600 - 100,  # Dynamo: ceiling minus rank
        "http.request.method": "POST",
        "url.path": CHAT,
        "http.response.status_code": 200,
        "pylon.outcome": "ok",
    }
    assert span.resource.attributes["service.name"] == "pylon"
    # The request's own clock readings: head, written to the engine, engine's head, end.
    assert [event.name for event in span.events] == ["pylon.dispatched", "pylon.response_head"]
    assert span.start_time is not None and span.end_time is not None
    stamps = [span.start_time, *(event.timestamp for event in span.events), span.end_time]
    assert stamps == sorted(stamps)

    # The engine continues pylon's span: same trace, pylon's span id as its parent, the
    # caller's sampling decision and tracestate carried.
    record = await stack.last_request()
    version, trace_id, parent_id, flags = traceparent_of(record)
    assert (version, trace_id) == ("00", TRACE_ID)
    assert parent_id == f"{span.context.span_id:016x}" != PARENT_ID
    assert int(flags, 16) & 1 == 1
    assert header_values(record, "tracestate") == [TRACESTATE]


@pytest.mark.parametrize(
    "incoming",
    [
        [],
        [("traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01")],
        [("traceparent", "garbage"), ("tracestate", "dropped=1")],
    ],
    ids=["none", "zero-trace-id", "malformed"],
)
async def test_without_a_valid_traceparent_pylon_starts_the_trace_the_engine_continues(
    make_stack: StackFactory, incoming: list[tuple[str, str]]
) -> None:
    stack, exporter = await traced_stack(make_stack, quic_listen=None)
    reply = await stack.send("http1", CHAT, tunnel_headers("new-trace", *incoming), chat())
    assert reply.status == 200, reply.body
    span = await exporter.span("new-trace")
    assert span.parent is None and span.context is not None
    record = await stack.last_request()
    _, trace_id, parent_id, _ = traceparent_of(record)
    assert trace_id == f"{span.context.trace_id:032x}" != "0" * 32
    assert parent_id == f"{span.context.span_id:016x}"
    assert header_values(record, "tracestate") == []  # nothing carried without a parent


async def test_an_unsampled_caller_is_followed_and_still_propagated(
    make_stack: StackFactory,
) -> None:
    """The caller decided not to sample: pylon exports nothing, but the engine still gets a
    child context (same trace, not sampled) so its own decision follows the caller's."""
    stack, exporter = await traced_stack(make_stack, quic_listen=None)
    unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
    headers = tunnel_headers("unsampled", ("traceparent", unsampled))
    reply = await stack.send("http1", CHAT, headers, chat())
    assert reply.status == 200
    record = await stack.last_request()
    _, trace_id, parent_id, flags = traceparent_of(record)
    assert trace_id == TRACE_ID
    assert parent_id not in (PARENT_ID, "0" * 16)
    assert int(flags, 16) & 1 == 0
    # A sampled request afterwards is exported; the unsampled one never was.
    await stack.send("http1", CHAT, tunnel_headers("sampled-after"), chat())
    await exporter.span("sampled-after")
    assert exporter.of("unsampled") == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_engine_error_status_is_a_span_error(make_stack: StackFactory, protocol: str) -> None:
    stack, exporter = await traced_stack(make_stack)
    await stack.faults([{"status": 500, "times": 1}])
    rid = f"engine-500-{protocol}"
    reply = await stack.send(protocol, CHAT, tunnel_headers(rid), chat())
    assert reply.status == 500
    span = await exporter.span(rid)
    assert span.status.status_code is StatusCode.ERROR
    assert attributes(span)["http.response.status_code"] == 500
    assert attributes(span)["error.type"] == "500"
    assert attributes(span)["pylon.transport"] == protocol


async def test_engine_breaking_the_stream_is_a_span_error(make_stack: StackFactory) -> None:
    stack, exporter = await traced_stack(make_stack, quic_listen=None)
    await stack.faults([{"drop_after_events": 2, "times": 1}])
    reply = await stack.send("h2", CHAT, tunnel_headers("dropped"), chat(stream=True))
    assert reply.status == 200  # the head went out before the engine broke off
    span = await exporter.span("dropped")
    assert span.status.status_code is StatusCode.ERROR
    assert attributes(span)["error.type"] == "upstream_protocol_error"
    assert attributes(span)["pylon.outcome"] == "upstream_protocol_error"
    assert attributes(span)["http.response.status_code"] == 200


async def test_a_client_that_leaves_ends_the_span_without_an_error(
    make_stack: StackFactory,
) -> None:
    """The client goes away mid-stream: the span still ends (the cancelled exchange's exit
    path), says how, and is not an engine failure."""
    stack, exporter = await traced_stack(make_stack, quic_listen=None)
    await stack.knobs(num_tokens=400, token_delay_ms=50)
    host, port = stack.pylon_address
    reader, writer = await asyncio.open_connection(host, port)
    body = chat(stream=True)
    writer.write(
        f"POST {CHAT} HTTP/1.1\r\nhost: x\r\nx-request-id: leaver\r\nx-model: {MODEL}\r\n"
        f"traceparent: {TRACEPARENT}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    seen = b""
    while seen.count(b"data:") < 2:
        seen += await asyncio.wait_for(reader.read(4096), 5)
    writer.transport.abort()
    span = await exporter.span("leaver")
    assert attributes(span)["pylon.outcome"] == "client_disconnected"
    assert attributes(span)["http.response.status_code"] == 200
    assert "error.type" not in attributes(span)
    assert span.status.status_code is StatusCode.UNSET


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_unreachable_engine_is_a_span_error(make_stack: StackFactory) -> None:
    stack, exporter = await traced_stack(
        make_stack,
        quic_listen=None,
        upstream=f"http://127.0.0.1:{_closed_port()}",
        **NO_BRINGUP,  # nothing listens there: no health gate to pass
    )
    reply = await stack.send("http1", CHAT, tunnel_headers("refused"), chat())
    assert reply.status == 503
    span = await exporter.span("refused")
    assert span.status.status_code is StatusCode.ERROR
    assert attributes(span)["error.type"] == "upstream_unavailable"
    assert "http.response.status_code" not in attributes(span)  # the engine never answered
    assert [event.name for event in span.events] == []


async def test_health_checks_and_rejections_are_not_traced(make_stack: StackFactory) -> None:
    stack, exporter = await traced_stack(make_stack, quic_listen=None)
    health = await stack.client.get(f"{stack.pylon_url}/health")
    assert health.status_code == 200
    rejected = await stack.send("http1", CHAT, [("x-request-id", "no-model")], chat())
    assert rejected.status == 400
    await stack.send("http1", CHAT, tunnel_headers("traced"), chat())
    await exporter.span("traced")
    assert [attributes(span)["pylon.request_id"] for span in exporter.get_finished_spans()] == [
        "traced"
    ]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_tracing_off_builds_nothing_and_forwards_the_callers_context(
    make_stack: StackFactory, protocol: str
) -> None:
    stack = await make_stack()
    assert stack.running.core.tracer is None
    assert stack.running.core.proxy._tracer is None
    headers = tunnel_headers("untraced", ("traceparent", TRACEPARENT), ("tracestate", TRACESTATE))
    reply = await stack.send(protocol, CHAT, headers, chat())
    assert reply.status == 200
    record = await stack.last_request()
    assert header_values(record, "traceparent") == [TRACEPARENT]
    assert header_values(record, "tracestate") == [TRACESTATE]


# --- OTLP export, as `pylon serve --otel-endpoint` runs it ------------------------------------


@contextlib.asynccontextmanager
async def otlp_collector(
    status: int = 200,
) -> AsyncIterator[tuple[str, list[ExportTraceServiceRequest]]]:
    """A minimal OTLP/HTTP collector on 127.0.0.1: keeps every decoded export request and
    answers `status`."""
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(status=status, body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", received
    finally:
        await runner.cleanup()


async def test_otlp_export_is_flushed_when_pylon_stops() -> None:
    engine = await start_mock(MockConfig(models=(MODEL,)), host="127.0.0.1", port=0)
    try:
        async with otlp_collector() as (endpoint, received):
            settings = load_settings(
                {
                    "listen": "127.0.0.1:0",
                    "upstream": engine.base_url,
                    "log_level": "warning",
                    "otel_endpoint": endpoint,  # the base URL: pylon posts to /v1/traces
                    "otel_service_name": "pylon-test",
                }
            )
            async with start(settings) as running, httpx.AsyncClient() as client:
                headers = {"x-request-id": "exported", "x-model": MODEL, "traceparent": TRACEPARENT}
                reply = await client.post(
                    f"{running.url}{CHAT}", content=chat(), headers=headers, timeout=10
                )
                assert reply.status_code == 200
            # Leaving `start` shut the batch processor down, which exported what it held.
            spans = [
                (resource_spans.resource, span)
                for message in received
                for resource_spans in message.resource_spans
                for scope_spans in resource_spans.scope_spans
                for span in scope_spans.spans
            ]
            assert len(spans) == 1
            resource, span = spans[0]
            assert span.name == SPAN_NAME
            assert span.trace_id.hex() == TRACE_ID
            assert span.parent_span_id.hex() == PARENT_ID
            service = {a.key: a.value.string_value for a in resource.attributes}["service.name"]
            assert service == "pylon-test"
            record = (await engine_records(engine.base_url))[-1]
            assert traceparent_of(record)[2] == span.span_id.hex()
    finally:
        await engine.stop()


class ProcessEvents(LogObserver):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def process_event(self, kind: str, /, **fields: Any) -> None:
        self.events.append((kind, fields))
        super().process_event(kind, **fields)


async def test_a_failed_export_is_a_pylon_log_event_not_sdk_text(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The SDK logs a refused export from its own thread; pylon's observer gets it, on the
    loop, as `tracing_error`, and nothing else reaches stderr as plain text."""
    configure_logging("json", "warning")
    engine = await start_mock(MockConfig(models=(MODEL,)), host="127.0.0.1", port=0)
    observer = ProcessEvents()
    try:
        async with otlp_collector(status=400) as (endpoint, received):
            settings = load_settings(
                {"listen": "127.0.0.1:0", "upstream": engine.base_url, "otel_endpoint": endpoint}
            )
            async with start(settings, observer) as running, httpx.AsyncClient() as client:
                headers = {"x-request-id": "refused-export", "x-model": MODEL}
                reply = await client.post(f"{running.url}{CHAT}", content=chat(), headers=headers)
                assert reply.status_code == 200
            assert len(received) == 1  # the flush at stop tried, and the collector said no
    finally:
        await engine.stop()
    kinds = [kind for kind, _ in observer.events]
    assert kinds.index("tracing") < kinds.index("listening")  # said before traffic can come
    errors = [fields for kind, fields in observer.events if kind == "tracing_error"]
    assert errors and "400" in errors[0]["detail"], observer.events
    assert errors[0]["logger"].startswith("opentelemetry")
    captured = capfd.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "export" in line]
    assert lines  # the warning was logged...
    for line in lines:
        assert json.loads(line)["event"] == "tracing_error"  # ...as pylon's JSON line only


async def engine_records(base_url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient() as client:
        reply = await client.get(f"{base_url}/test-control")
        requests: list[dict[str, Any]] = reply.json()["requests"]
        return requests

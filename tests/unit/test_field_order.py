"""The values built positionally on the hot path: their field order, and every construction site.

On Python 3.11 keywords to a class call build a dict, so the per-request values are built with
positional arguments, in field order. Several fields in a row share a type (`TunnelRequest` has
five `str` in a row, the queue decision three `int`), so a
swap at a construction site type-checks. Two guards:
- the field order and types are pinned here, so reordering a class (which would silently
  reinterpret every positional call) fails;
- each positional site is driven by the real code path with a distinct value per field, and each
  field is read back by name, so a swap at a site fails.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.body import BodyView, inspect_body
from pylon.core.contract import TunnelRequest, parse_request
from pylon.core.head import RequestHead, http1_head, pseudo_head
from pylon.core.plan import ForwardPlan, Planner
from pylon.core.priority import PriorityWrite, Route
from pylon.core.queue import QueueDecision, QueueGate, QueuePolicy, QueueTable, Result
from pylon.core.sanitize import ResponseHead, sanitize_response_head
from pylon.core.upstream import Upstream

from .helpers import TRACEPARENT, EveryRoute


def field_types(cls: type) -> list[tuple[str, object]]:
    return [(f.name, f.type) for f in dataclasses.fields(cls)]


def assert_fields(cls: type, expected: list[tuple[str, str]]) -> None:
    seen = field_types(cls)
    if (sys.modules[cls.__module__].__file__ or "").endswith(".py"):
        assert seen == expected
        return
    # Compiled by mypyc (docs/mypyc-notes.md): the annotations are erased to classes (`int |
    # None` reads `type`), so the compiled run pins the order; the pure run pins the types too.
    assert [name for name, _ in seen] == [name for name, _ in expected]


def test_tunnel_request_field_order() -> None:
    assert_fields(
        TunnelRequest,
        [
            ("method", "str"),
            ("target", "str"),
            ("path", "str"),
            ("request_id", "str"),
            ("model", "str"),
            ("input_tokens", "int | None"),
            ("priority", "int | None"),
            ("routing_key", "str | None"),
            ("expected_queue_ms", "int | None"),
            ("trace", "TraceContext | None"),
            ("headers", "tuple[Header, ...]"),
            ("names", "tuple[bytes, ...]"),
        ],
    )


def test_request_head_field_order() -> None:
    assert_fields(
        RequestHead,
        [
            ("method", "bytes"),
            ("target", "bytes"),
            ("headers", "list[Header]"),
            ("content_length", "int | None"),
            ("expects_continue", "bool"),
            ("content_coding", "bytes | None"),
            ("names", "list[bytes] | None"),
        ],
    )


def test_forward_plan_field_order() -> None:
    assert_fields(
        ForwardPlan,
        [
            ("method", "str"),
            ("target", "str"),
            ("headers", "tuple[Header, ...]"),
            ("body", "bytes"),
            ("request_id", "str | None"),
            ("model", "str | None"),
            ("stream_requested", "bool"),
            ("stripped", "tuple[str, ...]"),
            ("priority", "PriorityWrite"),
            ("upstream", "Upstream | None"),
        ],
    )


def test_body_view_field_order() -> None:
    assert_fields(
        BodyView,
        [
            ("stream", "bool"),
            ("model", "builtins.object"),  # `object`, spelt for a mypyc build (pylon.core.body)
            ("model_count", "int"),
            ("stripped", "tuple[str, ...]"),
            ("repeated", "tuple[str, ...]"),
            ("containers", "Mapping[str, dict[str, msgspec.Raw]]"),
            ("selectors", "tuple[tuple[str, object], ...]"),
        ],
    )


def test_queue_decision_field_order() -> None:
    assert_fields(
        QueueDecision,
        [
            ("result", "Result"),
            ("model", "str"),
            ("level", "int"),
            ("expected_ms", "int"),
            ("estimate_ms", "int | None"),
            ("threshold_ms", "int"),
        ],
    )


# --- each positional site, one distinct value per field ---------------------------------------

TARGET = b"/v1/chat%2dcompletions?x=1"  # target, path: differ (percent-decoded, no query)
FULL_HEADERS = [
    (b"X-Request-ID", b"req-A"),
    (b"x-model", b"model-B"),
    (b"x-input-tokens", b"7"),
    (b"x-priority", b"3"),
    (b"x-routing-key", b"key-C"),
    (b"x-stargate-expected-queue-ms", b"11"),
    (b"traceparent", TRACEPARENT),
    (b"tracestate", b"a=1"),
]


def full_request() -> TunnelRequest:
    request = parse_request(b"PUT", TARGET, FULL_HEADERS)
    assert isinstance(request, TunnelRequest)
    return request


def test_parse_request_puts_each_value_in_its_field() -> None:
    request = full_request()
    assert request.method == "PUT"
    assert request.target == "/v1/chat%2dcompletions?x=1"
    assert request.path == "/v1/chat-completions"
    assert request.request_id == "req-A"
    assert request.model == "model-B"
    assert request.input_tokens == 7
    assert request.priority == 3
    assert request.routing_key == "key-C"
    assert request.expected_queue_ms == 11
    assert request.trace is not None
    assert request.trace.traceparent == TRACEPARENT.decode()
    assert request.trace.tracestate == "a=1"
    assert request.headers == tuple(FULL_HEADERS)
    assert request.names == tuple(name.lower() for name, _ in FULL_HEADERS)


def test_the_http1_head_puts_each_value_in_its_field() -> None:
    fields = [
        (b"Host", b"h"),
        (b"Content-Length", b"5"),
        (b"Expect", b"100-continue"),
        (b"Content-Encoding", b"gzip"),
    ]
    head = http1_head(b"POST", b"/a?b", fields, http10=False)
    assert (head.method, head.target) == (b"POST", b"/a?b")
    assert head.headers == fields
    assert head.content_length == 5
    assert head.expects_continue is True
    assert head.content_coding == b"gzip"
    assert head.names == [b"host", b"content-length", b"expect", b"content-encoding"]


def test_the_pseudo_head_puts_each_value_in_its_field() -> None:
    fields = [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":path", b"/a?b"),
        (b":authority", b"h"),
        (b"content-length", b"5"),
        (b"content-encoding", b"br"),
    ]
    head = pseudo_head(fields)
    assert (head.method, head.target) == (b"POST", b"/a?b")
    assert head.headers == [
        (b"host", b"h"),
        (b"content-length", b"5"),
        (b"content-encoding", b"br"),
    ]
    assert head.content_length == 5
    assert head.expects_continue is False
    assert head.content_coding == b"br"
    assert head.names == [b"host", b"content-length", b"content-encoding"]


def planner() -> Planner:
    # Any route (this request's is no engine's): the test is about where each value goes. Not
    # scheduled (no body priority written), but reading `stream`, so every field has a value.
    adapter = build_adapter("vllm", AdapterOptions(3600), derive=True)
    return Planner(EveryRoute(adapter, Route(schedules=False, body_model=False, streams=True)))


def test_the_plan_puts_each_value_in_its_field() -> None:
    request = full_request()
    plan = planner().plan(request, b'{"model": "model-B", "stream": true, "vllm_xargs": {}}')
    assert (plan.method, plan.target) == ("PUT", "/v1/chat%2dcompletions?x=1")
    assert plan.request_id == "req-A"
    assert plan.model == "model-B"
    assert plan.stream_requested is True
    assert plan.headers[0] == (b"x-request-id", b"req-A")
    assert plan.body == b'{"model":"model-B","stream":true}'
    assert plan.stripped == ("x-stargate-expected-queue-ms", "vllm_xargs")  # header, then body
    assert plan.priority == build_adapter("vllm", AdapterOptions(3600), derive=True).derive(3)
    assert plan.priority != PriorityWrite()
    assert plan.upstream is None


@pytest.mark.parametrize("body", [None, b'{"model": "model-B", "x": 1}'])
def test_the_routed_plan_keeps_every_field_but_the_ones_routing_sets(body: bytes | None) -> None:
    plan = planner().plan(full_request(), b'{"model": "model-B", "stream": true, "vllm_xargs": {}}')
    upstream = Upstream("127.0.0.1", 9, "/base")
    routed = plan.routed(upstream, ((b"x-worker", b"1"),), body=body)
    assert routed.upstream == upstream
    assert routed.headers == (*plan.headers, (b"x-worker", b"1"))
    assert routed.body == (plan.body if body is None else body)
    for field in dataclasses.fields(ForwardPlan):
        if field.name not in ("upstream", "headers", "body"):
            assert getattr(routed, field.name) == getattr(plan, field.name), field.name


@pytest.mark.parametrize(
    "body",
    [
        b'{"stream": true, "model": "m"}',  # the plain view, without the key census
        b'{"stream": true, "model": "m", "nvext": {"backend_instance_id": 1}}',  # the census
    ],
)
def test_the_body_view_puts_each_value_in_its_field(body: bytes) -> None:
    view = inspect_body(body)
    assert view.stream is True
    assert view.model == "m"
    assert view.model_count == 1
    assert view.repeated == ()
    assert view.stripped == (() if b"nvext" not in body else ("nvext.backend_instance_id",))


def test_the_queue_decision_puts_each_value_in_its_field() -> None:
    adapter = build_adapter("vllm", AdapterOptions(3600), derive=True)
    policy = QueuePolicy(min_delta_ms=25, factor=1.25)
    admission = QueueGate(QueueTable(1000.0), policy, adapter)
    ahead = full_request()
    admission.admit(dataclasses.replace(ahead, expected_queue_ms=None, input_tokens=4000), 0, True)
    request = dataclasses.replace(ahead, expected_queue_ms=900, priority=5)
    level = adapter.queue_level(5)
    estimate = admission.table.estimate_ms("model-B", level)
    entry = admission.admit(request, 0, True)
    decision = entry.decision
    assert decision is not None
    assert decision.result is Result.REJECTED
    assert decision.model == "model-B"
    assert decision.level == level
    assert decision.expected_ms == 900
    assert decision.estimate_ms == estimate
    assert decision.threshold_ms == policy.threshold_ms(900)
    # Distinct values, so that a swap of two `int` fields would be seen.
    assert len({decision.level, 900, estimate, decision.threshold_ms}) == 4
    assert (entry.level, entry.tokens) == (level, 7)  # QueueEntry: two `int` in a row too


def test_response_head_field_order() -> None:
    assert_fields(
        ResponseHead,
        [
            ("status", "int"),
            ("fields", "list[Header]"),
            ("content_length", "int | None"),
            ("event_stream", "bool"),
        ],
    )


def test_the_response_head_normaliser_puts_each_value_in_its_field() -> None:
    fields = [(b"content-length", b"5"), (b"content-type", b"text/event-stream"), (b"x-a", b"1")]
    head = sanitize_response_head(201, fields)
    assert head.status == 201
    assert head.fields == [(b"content-type", b"text/event-stream"), (b"x-a", b"1")]
    assert head.content_length == 5
    assert head.event_stream is True

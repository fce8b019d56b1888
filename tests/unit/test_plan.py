"""ForwardPlan: exactly what goes to the engine."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.contract import HealthRequest, TraceContext, parse_request
from pylon.core.errors import BodyError, BodyFieldError, ErrorCode, RouteError
from pylon.core.http import Header
from pylon.core.plan import Planner, append_member
from pylon.core.upstream import Upstream

from .helpers import TRACEPARENT, tunnel

# Bodies with formatting a re-encode would change: spacing, escapes, exponents, huge ints.
ODD_BODIES = [
    b'{"model":"m"}',
    b'{ "model" : "m" ,\n  "x": 1.0e5, "y": 18446744073709551617999 }\n',
    b'{"model":"m","s":"caf\\u00e9 \\ud83d\\ude00","t":"caf\xc3\xa9","n":-0.0,"z":1E2}',
    b'{"model":"m","a":{}}',
    b'  { "model":"m"  }  ',
    b'{"stream":true,"messages":[{"role":"user","content":"priority nvext dp_rank"}],"model":"m"}',
]
# Routes both vLLM and SGLang schedule with a body priority (tests/unit/test_routes.py has the
# full golden list per backend).
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"]


def planner(backend: str, derive: bool = True) -> Planner:
    return Planner(build_adapter(backend, AdapterOptions(3600), derive=derive))


@pytest.mark.parametrize("body", ODD_BODIES)
@pytest.mark.parametrize(
    ("backend", "derive"),
    [("dynamo", True), ("passthrough", True), ("vllm", False), ("sglang", False)],
)
def test_body_byte_identical_when_nothing_changes(body: bytes, backend: str, derive: bool) -> None:
    plan = planner(backend, derive).plan(tunnel(), body)
    assert plan.body == body
    assert plan.stripped == ()


@pytest.mark.parametrize("body", ODD_BODIES)
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_priority_appended_without_reencoding(body: bytes, backend: str) -> None:
    plan = planner(backend).plan(tunnel((b"x-priority", b"7")), body)
    value = 7 if backend == "vllm" else 3593
    prefix = body.rstrip()[:-1].rstrip()
    assert plan.body.startswith(prefix)
    assert plan.body[len(prefix) :] in (b',"priority":%d}' % value, b'"priority":%d}' % value)
    assert json.loads(plan.body) == {**json.loads(body), "priority": value}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_body_priority_on_inference_paths(path: str, backend: str) -> None:
    plan = planner(backend).plan(tunnel(target=path.encode() + b"?x=1"), b'{"model":"m"}')
    assert "priority" in json.loads(plan.body)


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/models",
        b"/metrics",
        b"/v1/chat/completions/x",
        b"/v1/tokenize",
        b"/V1/chat/completions",
    ],
)
@pytest.mark.parametrize("backend", ["vllm", "sglang", "dynamo"])
def test_posts_to_routes_pylon_does_not_steer_are_refused(target: bytes, backend: str) -> None:
    with pytest.raises(RouteError) as refused:
        planner(backend).plan(tunnel(target=target), b'{"priority":1,"model":"m"}')
    assert refused.value.code is ErrorCode.ROUTE_NOT_SERVED and refused.value.status == 404


def test_plan_headers_order_and_ownership() -> None:
    request = tunnel(
        (b"traceparent", TRACEPARENT),
        (b"tracestate", b"a=1"),
        (b"Host", b"evil"),
        (b"Content-Length", b"999"),
        (b"Accept", b"text/event-stream"),
        (b"X-Tenant-Id", b"t"),
    )
    plan = planner("dynamo").plan(request, b'{"stream":true,"model":"m"}')
    assert plan.headers == (
        (b"x-request-id", b"req-1"),
        (b"traceparent", TRACEPARENT),
        (b"tracestate", b"a=1"),
        (b"x-model", b"m"),
        (b"Accept", b"text/event-stream"),
        (b"x-dynamo-request-priority", b"0"),
        (b"x-dynamo-request-strict-priority", b"0"),
    )
    assert plan.stream_requested is True
    assert plan.stripped == ("x-tenant-id",)
    assert (plan.method, plan.target, plan.request_id, plan.model) == (
        "POST",
        "/v1/chat/completions",
        "req-1",
        "m",
    )


@pytest.mark.parametrize(
    ("body", "stream"),
    [
        (b'{"model":"m","stream":true}', True),
        (b'{"model":"m","stream" : true }', True),
        (b'{"model":"m","stream":false}', False),
        (b'{"model":"m","stream":null}', False),
        (b'{"model":"m"}', False),
    ],
)
def test_stream_requested_only_for_literal_true(body: bytes, stream: bool) -> None:
    assert planner("dynamo").plan(tunnel(), body).stream_requested is stream


@pytest.mark.parametrize(
    "value", [b'"true"', b"1", b"0", b'"1"', b'"on"', b"1.0", b'"false"', b"[]", b"{}", b'""']
)
@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
def test_a_stream_an_engine_could_read_otherwise_is_refused(value: bytes, backend: str) -> None:
    # pydantic's lax mode reads 1, "true", "on" and 1.0 as a stream; pylon would not.
    with pytest.raises(BodyFieldError) as refused:
        planner(backend).plan(tunnel(), b'{"model":"m","stream":' + value + b"}")
    assert refused.value.code is ErrorCode.BODY_FIELD_INVALID and refused.value.status == 400
    assert refused.value.extensions() == {"field": "stream"}


@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
@pytest.mark.parametrize("body", [b"{}", b'{"messages":[{"role":"user","content":"m"}]}'])
def test_a_body_without_model_is_refused(backend: str, body: bytes) -> None:
    # The engine would serve its default (base) model, not the x-model the gateway authorised.
    with pytest.raises(BodyError) as refused:
        planner(backend).plan(tunnel(), body)
    assert refused.value.code is ErrorCode.BODY_MODEL_MISSING and refused.value.status == 400


def test_plan_health() -> None:
    request = parse_request(
        b"GET",
        b"/health?x=1",
        [
            (b"x-request-id", b"h1"),
            (b"x-dynamo-dp-rank", b"1"),
            (b"x-request-id", b"h2"),
            (b"accept", b"*/*"),
        ],
    )
    assert isinstance(request, HealthRequest)
    plan = planner("dynamo").plan_health(request)
    # A repeated id is unusable: no x-request-id at all rather than the client's two.
    assert plan.headers == ((b"accept", b"*/*"),)
    assert plan.body == b"" and plan.priority.empty
    request = parse_request(b"HEAD", b"/health", [(b"X-Request-Id", b" h1 ")])
    assert isinstance(request, HealthRequest)
    plan = planner("vllm").plan_health(request)
    assert plan.headers == ((b"x-request-id", b"h1"),)
    assert (plan.method, plan.target) == ("HEAD", "/health")


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=5).filter(lambda k: k != "priority"),
        st.integers() | st.text(max_size=5),
        max_size=5,
    ),
    st.sampled_from([b"", b" ", b"\n", b"\t\r\n"]),
    st.integers(0, 2**31 - 1),
)
def test_append_member(obj: dict, ws: bytes, value: int) -> None:
    body = ws + json.dumps(obj).encode() + ws
    appended = append_member(body, "priority", value)
    assert json.loads(appended) == {**obj, "priority": value}


OURS = TraceContext("00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01", "a=1")


@pytest.mark.parametrize(
    ("incoming", "ours", "expected"),
    [
        # The client's context is replaced by pylon's (in its place, right after x-request-id).
        (
            [(b"traceparent", TRACEPARENT), (b"tracestate", b"a=1")],
            OURS,
            [(b"traceparent", OURS.traceparent.encode()), (b"tracestate", b"a=1")],
        ),
        # No context in: pylon's starts the trace (no tracestate to carry).
        (
            [],
            TraceContext(OURS.traceparent, None),
            [(b"traceparent", OURS.traceparent.encode())],
        ),
        # No trace from the tracer (tracing off): the client's context, unchanged.
        (
            [(b"traceparent", TRACEPARENT), (b"tracestate", b"a=1")],
            None,
            [(b"traceparent", TRACEPARENT), (b"tracestate", b"a=1")],
        ),
    ],
)
def test_routed_plan_carries_the_trace_context_the_engine_continues(
    incoming: list[Header], ours: TraceContext | None, expected: list[Header]
) -> None:
    plan = planner("dynamo").plan(tunnel(*incoming, (b"Accept", b"*/*")), b'{"model":"m"}')
    pin = (b"x-worker-pin", b"7")
    routed = plan.routed(Upstream("127.0.0.1", 8000, ""), (pin,), ours)
    assert routed.headers == (
        (b"x-request-id", b"req-1"),
        *expected,
        (b"x-model", b"m"),
        (b"Accept", b"*/*"),
        (b"x-dynamo-request-priority", b"0"),
        (b"x-dynamo-request-strict-priority", b"0"),
        pin,
    )
    if ours is None:
        assert routed.headers == (*plan.headers, pin)


@pytest.mark.parametrize("backend", ["dynamo", "vllm", "sglang", "passthrough"])
@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"m","lora_path":"other"}',
        b'{"model":"m","lora_path":["m","other"]}',
        b'{"model":"m","lora_path":"m","lora_path":"other"}',
        b'{"model":"m","l\\u006fra_path":"other"}',
    ],
)
def test_a_lora_path_naming_another_model_is_refused(backend: str, body: bytes) -> None:
    # SGLang serves the adapter `lora_path` names, whatever `model` (and x-model) say.
    with pytest.raises(BodyError) as refused:
        planner(backend).plan(tunnel(), body)
    assert refused.value.code is ErrorCode.MODEL_MISMATCH


@pytest.mark.parametrize("value", [b'"m"', b"null"])
def test_a_lora_path_naming_x_model_or_none_is_forwarded(value: bytes) -> None:
    body = b'{"model":"m","lora_path":' + value + b"}"
    assert json.loads(planner("sglang").plan(tunnel(), body).body)["lora_path"] == json.loads(value)

"""From a validated request and its body to a `ForwardPlan`: contract -> sanitize -> adapt.

Pure: the I/O layer hands in bytes and gets back exactly what to send to the engine.
"""

from __future__ import annotations

import json
from typing import Any

from pylon.core.body import (
    BodyView,
    append_raw_member,
    has_top_level_key,
    inspect_body,
    rewrite_body,
)
from pylon.core.contract import HealthRequest, TraceContext, TunnelRequest
from pylon.core.errors import BodyError, ErrorCode, RouteError
from pylon.core.http import Header
from pylon.core.priority import PriorityAdapter, PriorityWrite, Route
from pylon.core.sanitize import sanitize_request_headers
from pylon.core.upstream import Upstream
from pylon.core.values import static_frozen

_BODYLESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


# Two per request (the plan, then its routed copy, derived with `routed`): frozen for mypy, no
# run-time freeze (see `pylon.core.values`).
@static_frozen
class ForwardPlan:
    """Exactly what goes to the engine: where, the request line, every header, the body bytes.

    Only `host` (from `upstream`) and `content-length` (from `body`) are framed by the upstream
    client. `upstream` is None until the router has booked the request (`routed`).
    """

    method: str
    target: str  # origin-form path and query, as the client sent it
    headers: tuple[Header, ...]
    body: bytes
    request_id: str | None
    model: str | None
    stream_requested: bool
    stripped: tuple[str, ...]  # header names and body paths removed (names only, never values)
    priority: PriorityWrite
    upstream: Upstream | None = None

    def routed(
        self,
        upstream: Upstream,
        headers: tuple[Header, ...] = (),
        trace: TraceContext | None = None,
        body: bytes | None = None,
    ) -> ForwardPlan:
        """This plan bound for `upstream`, with the router's trusted headers (worker pins).

        `trace`: when pylon traces the exchange, the context the engine continues (pylon's span
        as its parent); it replaces the client's `traceparent`/`tracestate`. None keeps them.
        `body`: the router's own version of the body (with `nvext.token_data`); None keeps it.
        """
        own = self.headers if trace is None else with_trace(self.headers, trace)
        # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
        return ForwardPlan(
            self.method,
            self.target,
            own + headers if headers else own,  # headers
            self.body if body is None else body,  # body
            self.request_id,
            self.model,
            self.stream_requested,
            self.stripped,
            self.priority,
            upstream,
        )


_TRACE_FIELDS = frozenset({b"traceparent", b"tracestate"})


def trace_headers(trace: TraceContext) -> tuple[Header, ...]:
    """The W3C trace-context fields of `trace`, as they go to the engine."""
    parent = (b"traceparent", trace.traceparent.encode("ascii"))
    if trace.tracestate is None:
        return (parent,)
    return parent, (b"tracestate", trace.tracestate.encode("ascii"))


def with_trace(headers: tuple[Header, ...], trace: TraceContext) -> tuple[Header, ...]:
    """`headers` with their trace-context fields replaced by `trace`'s, in the planner's place
    for them (after `x-request-id`, the first field)."""
    kept = tuple(field for field in headers if field[0] not in _TRACE_FIELDS)
    return kept[:1] + trace_headers(trace) + kept[1:]


class Planner:
    """Contract, strip and adapter: a request and its body in, a `ForwardPlan` out.

    `consumed`: request headers pylon itself used up and never forwards (the tunnel credential
    when tunnel authentication is on); dropped silently, as they are not client controls.
    """

    def __init__(self, adapter: PriorityAdapter, consumed: frozenset[bytes] = frozenset()) -> None:
        self._adapter = adapter
        self._consumed = consumed

    def plan(self, request: TunnelRequest, body: bytes) -> ForwardPlan:
        route = self._adapter.route(request.method, request.path)
        if route is None:
            # Forwarded, it would run unsteered (vLLM schedules a request without a priority
            # at 0, the most urgent): refused instead.
            raise RouteError(
                f"{request.method} {request.path} is not a route pylon serves toward this engine"
            )
        sanitized = sanitize_request_headers(request.headers, self._consumed, request.names)
        write = self._adapter.derive(request.priority)
        new_body, body_stripped, stream = self._rewrite_body(request, body, write, route)
        headers: list[Header] = [(b"x-request-id", request.request_id.encode("ascii"))]
        if request.trace is not None:
            headers.extend(trace_headers(request.trace))
        headers.extend(sanitized.headers)
        headers.extend(write.headers)
        # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
        return ForwardPlan(
            request.method,
            request.target,
            tuple(headers),
            new_body,
            request.request_id,
            request.model,
            # stream_requested, the engine's reading: a route whose request type has no
            # `stream` (embeddings, pooling) answers one whole response, whatever the body
            # says; where the engine picks the type by the body's shape (vLLM's
            # `/invocations`), only the types that read it stream. (Inline: this runs for
            # every streaming request.)
            stream
            and route.streams
            and (not route.stream_keys or has_top_level_key(body, route.stream_keys)),
            sanitized.stripped + body_stripped,  # stripped
            write,  # priority
        )

    def plan_health(self, request: HealthRequest) -> ForwardPlan:
        sanitized = sanitize_request_headers(request.headers, self._consumed, request.names)
        headers: tuple[Header, ...] = sanitized.headers
        if request.request_id is not None:
            headers = ((b"x-request-id", request.request_id.encode("ascii")), *headers)
        return ForwardPlan(
            method=request.method,
            target=request.target,
            headers=headers,
            body=b"",
            request_id=request.request_id,
            model=None,
            stream_requested=False,
            stripped=sanitized.stripped,
            priority=PriorityWrite(),
        )

    def _rewrite_body(
        self, request: TunnelRequest, body: bytes, write: PriorityWrite, route: Route
    ) -> tuple[bytes, tuple[str, ...], bool]:
        if not body and request.method in _BODYLESS_METHODS:
            return body, (), False
        view = inspect_body(body)
        if view.model_count != 1 or view.model != request.model or view.selectors:
            # (the common body, one matching model and no other model field: no call)
            _check_model(view, request.model, route.body_model)
        priority = write.body_priority if route.schedules else None
        if not view.stripped and not view.repeated:  # `view.verbatim`, without a property call
            # The common case: forward the client's own bytes, at most with pylon's priority
            # appended, so no value is ever re-encoded.
            if priority is None:
                return body, (), view.stream
            return append_member(body, "priority", priority), (), view.stream
        return rewrite_body(body, view, priority), view.stripped, view.stream


def append_member(body: bytes, key: str, value: int) -> bytes:
    """Add `"key": value` to a JSON object the caller knows has no such key."""
    return append_raw_member(body, key, str(value).encode("ascii"))


def has_duplicate_keys(body: bytes) -> bool:
    """True when any JSON object in the (already validated) document repeats a key.

    A reference check built on the standard library (tests use it on what the engine receives);
    the planner itself only needs the top level, and counts it in `pylon.core.body`.
    """
    found = False

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        if not found and len({key for key, _ in pairs}) != len(pairs):
            found = True
        return dict(pairs)

    json.loads(body, object_pairs_hook=pairs_hook)
    return found


def _check_model(view: BodyView, model: str, required: bool) -> None:
    """The gateway routed, authorised and accounts this request by `x-model`; the engine serves
    the body's `model`. They must be the same model, or the client gets another model than the
    one it was let through for. Refused rather than rewritten: pylon never changes what the
    client asked for silently. A repeated `model` is refused too: engines differ in which copy
    they read. `required`: the route reads a body `model`, so a body without one would be
    served by the engine's default (base) model, whatever `x-model` names."""
    if view.model_count == 0 and required:
        raise BodyError(
            f'the body names no model; this route needs "model": {model!r} (x-model)',
            code=ErrorCode.BODY_MODEL_MISSING,
        )
    if view.model_count > 1:
        raise BodyError("body model is given more than once", code=ErrorCode.MODEL_MISMATCH)
    if view.model_count == 1 and view.model != model:
        raise BodyError(
            f"body model {view.model!r} differs from x-model {model!r}",
            code=ErrorCode.MODEL_MISMATCH,
        )
    for key, value in view.selectors:
        # SGLang serves the adapter `lora_path` names, whatever `model` says.
        if value != model:
            raise BodyError(
                f"body {key} {value!r} would serve another model than x-model {model!r}",
                code=ErrorCode.MODEL_MISMATCH,
            )

"""aiohttp routes of the mock engine.

Test-control API (not recorded itself; errors are OpenAI-style JSON bodies):
- `GET /test-control`: snapshot `{"requests": [record...], "last_by_endpoint_model":
  {"<path>|<model>": record}, "counters": {"total", "by_endpoint", "cancelled"},
  "knobs", "faults", "models": [names], "health": {"status", "delay_ms",
  "ready_status"}}`. The
  newest `capacity` records are kept.
- A record: `method`, `path` (percent-decoded), `model`, `headers` ([name, value]
  pairs exactly as on the wire), `body` (parsed JSON or null), `received_at`,
  `completed_at`, `cancelled_at` (epoch seconds or null), `status` (499: client
  left before headers; 0: the mock dropped the connection first), and as
  received: `raw_path` (request target, path and query, not decoded), `query_string`
  (raw, without `?`, "" when none), `body_b64` (base64 of the body bytes after
  de-chunking; never decompressed), `body_bytes` (their length), `http_version`
  ("HTTP/1.1").
- `GET /test-control/wait?request_id=ID&event=E&timeout=S`: long poll. 200 with
  the record of the latest request whose `x-request-id` (any of them, name
  case-insensitive, value exact) is ID, as soon as E happened to it (at once if
  it has): `received`, `completed`, `cancelled`, or `finished` (either of the
  last two). A newer request with the same id replaces the one waited for.
  `timeout` defaults to 5 s, at most 30. 408 `{"error": {...}, "record": latest
  record with that id or null}` on timeout; 400 on a missing, unknown, repeated
  or out-of-range parameter; 503 while the server shuts down.
- `POST /test-control/reset`: forget records, counters and faults; restore the
  configured models and a healthy `/health`. Knobs survive.
- `PUT /test-control/knobs`: partial update of `ttft_ms`, `token_delay_ms`,
  `num_tokens`, `prefill_tokens_per_s`.
- `PUT /test-control/models` `{"models": [names]}`: the served models (what
  `/v1/models` and `/health` list; other names get 404). Empty list allowed.
- `PUT /test-control/health` `{"status": 200|400-599, "delay_ms": 0,
  "ready_status": 404, "instances": null|[u64]}` (partial update; `instances`: the
  Dynamo instance ids `/health` lists, in a Dynamo 1.6.1 frontend's `instances[]`
  shape): `/health` waits `delay_ms` then answers 200 with its usual payload or
  `status` with an error body (before faults are consulted). `/v1/health/ready`
  (the NIM-style readiness path a proxy may probe; Dynamo does not serve it)
  waits `delay_ms` too, then answers `ready_status`: 404 by default (not
  served), 200 `{"status": "ready"}`, or that error status. A reset restores
  them all.
- `PUT /test-control/faults` [fault...] / `DELETE /test-control/faults`.
- `GET /test-control/kv`: the engine model (see `mock_dynamo.engine`): `{"enabled": cache on,
  "tokenizer": "hf:<dir>" | "words" | null}` plus, with a cache, `block_size`, `capacity`,
  `blocks` (held now), `requests`, `hits` / `misses` (full prompt blocks found / not found in
  the cache), `hit_rate` (hits / (hits + misses)), `prompt_tokens`, `cached_tokens`,
  `token_hit_rate`, `stored`, `evicted`, `clears`, and `events`: null, or the KV-event socket's
  `{"endpoint": "tcp://127.0.0.1:PORT", "encoding", "next_seq", "messages", "dropped",
  "subscribers"}`. `?wait_subscribers=N&timeout=S` first long-polls until N subscriptions
  reached that socket (408 after S seconds, default 5, at most 30; 400 without a socket): a
  test's SUB (or a router's) is then sure to get every event sent afterwards.
- `PUT /test-control/kv/sequence` `{"next_seq": N}` (0 <= N < 2^64): the KV-event socket's
  next message gets sequence number N. Ahead of `next_seq`: a gap, as if messages were lost;
  behind it: the sequence goes back, as after an engine restart (400 without a socket).
- `DELETE /test-control/kv`: empty the cache (one `AllBlocksCleared` event); counters stay.
  `POST /test-control/reset` empties it too and zeroes its counters.

A record's `kv` is the engine model's view of that generation request while the model is on
(else null): `{"prompt_tokens", "cached_tokens" (null without a cache), "hit_blocks",
"miss_blocks", "queue_s", "prefill_s"}`. Replies then carry
`usage.prompt_tokens_details.cached_tokens` (`/v1/responses`:
`usage.input_tokens_details.cached_tokens`) when there is a cache.

Fault semantics (`PUT /test-control/faults`, first matching fault wins):
- `path`/`model`: match filters. A fault without `path` only matches the
  inference routes (the four OpenAI ones and `SCHEDULED_ROUTES`, which answer a
  small JSON object naming the model); name `/health` or `/v1/models` explicitly
  to hit those.
- `delay_ms`: extra wait before anything is sent.
- `status`: answer with that status and an OpenAI-style error body.
- `retryable` / `retry_after`: add `x-stargate-upstream-retryable` / `Retry-After`
  headers (to error and success responses alike).
- `stall_after_events` / `drop_after_events` N: after N SSE events, hang
  forever / abort the TCP connection. For non-streaming replies N=0 acts
  before the headers and N>=1 after half of the body.
- `malformed_event`: inject `data: {not json` after `after_events` events
  (default 1); a non-streaming reply gets a body that is not JSON.
- `huge_event_bytes` N: after `after_events` events, send one N-byte event
  with no terminating blank line, then end the body (streaming only).
- `times`: apply to the next N matching requests only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn

import orjson
from aiohttp import web

from mock_dynamo import replies
from mock_dynamo.config import MockConfig
from mock_dynamo.contract import contract_violation
from mock_dynamo.state import WAIT_EVENTS, Fault, MockState, RequestRecord, parse_models
from mock_dynamo.tokens import token_data

# stdlib logging stays silent when embedded unless the host opts in; the
# CLI configures it. Only metadata is logged, never prompt text.
log = logging.getLogger("mock_dynamo")


class ChangeSignal:
    """Wakes every coroutine waiting for "something was recorded".

    Fired by the recorder's listener hook; must be fired from the loop's thread.
    The Event is created on demand, so firing costs nothing while nobody waits.
    """

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None
        self.closing = False

    def next_change(self) -> asyncio.Event:
        """An Event set at the next fire(); take it before checking the condition."""
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None


STATE_KEY = web.AppKey("mock_state", MockState)
SIGNAL_KEY = web.AppKey("mock_signal", ChangeSignal)
# Fired when the KV-event socket gains or loses a subscription.
KV_SIGNAL_KEY = web.AppKey("mock_kv_signal", ChangeSignal)
RECORD_KEY = web.RequestKey("mock_record", RequestRecord)
BODY_KEY = web.RequestKey("mock_body", object)

CONTROL_PREFIX = "/test-control"
WAIT_DEFAULT_TIMEOUT_S = 5.0
WAIT_MAX_TIMEOUT_S = 30.0
# Status recorded when the mock aborted the connection before any response.
NO_RESPONSE_STATUS = 0
# Requests whose body is larger are refused by aiohttp; prompts can be big.
MAX_BODY_BYTES = 64 * 1024 * 1024
_HUGE_CHUNK = 64 * 1024
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeoutError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
StreamFn = Callable[[replies.ReplyPlan], Iterator[replies.Event]]
BodyFn = Callable[[replies.ReplyPlan], dict[str, Any]]


def error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    error = {"message": message, "type": _ERROR_TYPES.get(status, "APIError"), "code": status}
    return web.Response(
        status=status,
        body=orjson.dumps({"error": error}),
        content_type="application/json",
        headers=headers,
    )


def json_ok(payload: object) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json")


def _parse_json(raw: bytes) -> object:
    """Parsed body, or None when absent or not JSON (both recorded as null)."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


# --- recording --------------------------------------------------------------


def _endpoint(request: web.Request) -> str:
    # Route templates rather than raw paths keep counters bounded when
    # clients probe random URLs.
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "<unmatched>"


async def _start_record(request: web.Request, state: MockState) -> RequestRecord:
    raw_body = await request.read()
    body = _parse_json(raw_body)
    request[BODY_KEY] = body
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers]
    version = request.version
    record = state.recorder.start(
        RequestRecord(
            method=request.method,
            path=request.path,
            endpoint=_endpoint(request),
            headers=headers,
            body=body,
            received_at=time.time(),
            raw_path=request.raw_path,
            raw_body=raw_body,
            http_version=f"HTTP/{version.major}.{version.minor}",
        )
    )
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str):
        state.recorder.set_model(record, model)
    request[RECORD_KEY] = record
    return record


@web.middleware
async def record_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path.startswith(CONTROL_PREFIX):
        return await handler(request)
    state = request.app[STATE_KEY]
    record = await _start_record(request, state)
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        # Routing 404/405: answer in the OpenAI error shape like real engines.
        response = error_response(exc.status, exc.reason)
    except (asyncio.CancelledError, ConnectionError):
        _finish_interrupted(state, record)
        raise
    state.recorder.finish(record, response.status)
    log.debug("%s %s model=%s status=%d", record.method, record.path, record.model, response.status)
    return response


def _finish_interrupted(state: MockState, record: RequestRecord) -> None:
    if record.server_aborted:
        state.recorder.finish(record, record.status or NO_RESPONSE_STATUS)
    else:
        state.recorder.cancel(record)
    log.debug(
        "%s %s interrupted (server_aborted=%s)", record.method, record.path, record.server_aborted
    )


# --- fault helpers ----------------------------------------------------------


def _fault_headers(fault: Fault | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if fault is not None and fault.retryable is not None:
        headers["x-stargate-upstream-retryable"] = "true" if fault.retryable else "false"
    if fault is not None and fault.retry_after is not None:
        headers["Retry-After"] = fault.retry_after
    return headers


async def _pre_fault(fault: Fault | None) -> web.Response | None:
    """Delay and/or status override that happen before any reply byte."""
    if fault is None:
        return None
    if fault.delay_ms:
        await asyncio.sleep(fault.delay_ms / 1000)
    if fault.status is not None:
        return error_response(
            fault.status, f"injected fault: status {fault.status}", _fault_headers(fault)
        )
    return None


def _interrupt_point(fault: Fault | None) -> int | None:
    if fault is None:
        return None
    points = [p for p in (fault.stall_after_events, fault.drop_after_events) if p is not None]
    return min(points) if points else None


async def _interrupt(request: web.Request, fault: Fault) -> NoReturn:
    """Stall or drop the connection; only ends via cancellation."""
    drop = fault.drop_after_events is not None and (
        fault.stall_after_events is None or fault.drop_after_events <= fault.stall_after_events
    )
    if drop and request.transport is not None:
        request[RECORD_KEY].server_aborted = True
        request.transport.abort()
    # aiohttp cancels the handler once the connection is gone (our abort or
    # the client's close); the timeout only guards against that never coming.
    await asyncio.sleep(3600)
    raise ConnectionResetError("stalled connection outlived its guard timeout")


# --- reply writers ----------------------------------------------------------


async def json_reply(
    request: web.Request, payload: object, fault: Fault | None, delay_s: float = 0.0
) -> web.StreamResponse:
    early = await _pre_fault(fault)
    if early is not None:
        return early
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    malformed = fault is not None and fault.malformed_event
    body = b"{not json" if malformed else orjson.dumps(payload)
    headers = {"Content-Type": "application/json", **_fault_headers(fault)}
    point = _interrupt_point(fault)
    if fault is None or point is None:
        return web.Response(body=body, headers=headers)
    if point == 0:
        await _interrupt(request, fault)
    # Promise the full length, deliver half: a truncated body mid-response.
    response = web.StreamResponse(headers=headers)
    response.content_length = len(body)
    await response.prepare(request)
    request[RECORD_KEY].status = response.status
    await response.write(body[: len(body) // 2])
    await _interrupt(request, fault)


class _SseWriter:
    """Writes SSE events, applying a fault's mid-stream behaviour."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, fault: Fault | None
    ) -> None:
        self.request, self.response, self.fault = request, response, fault
        self.written = 0
        self.injected = False
        self.stop_at = _interrupt_point(fault)

    async def checkpoint(self, final: bool) -> bool:
        """Run fault actions due at this position; False means end the body now."""
        fault = self.fault
        if fault is None:
            return True
        if self.stop_at is not None and (self.written == self.stop_at or final):
            await _interrupt(self.request, fault)
        due = self.written == fault.after_events or (final and self.written < fault.after_events)
        if self.injected or not due:
            return True
        self.injected = True
        if fault.malformed_event:
            await self.response.write(b"data: {not json\n\n")
        if fault.huge_event_bytes is not None:
            await self._write_huge(fault.huge_event_bytes)
            return False
        return True

    async def _write_huge(self, size: int) -> None:
        await self.response.write(b"data: ")
        remaining = max(0, size - len(b"data: "))
        while remaining > 0:
            step = min(remaining, _HUGE_CHUNK)
            await self.response.write(b"x" * step)
            remaining -= step

    async def run(self, events: Iterator[replies.Event]) -> None:
        for delay, data in events:
            if not await self.checkpoint(final=False):
                return
            # Skipping sleep(0) matters: per-token loop hops cost benchmarks.
            if delay > 0:
                await asyncio.sleep(delay)
            await self.response.write(data)
            self.written += 1
        await self.checkpoint(final=True)


async def stream_reply(
    request: web.Request, events: Iterator[replies.Event], fault: Fault | None
) -> web.StreamResponse:
    early = await _pre_fault(fault)
    if early is not None:
        return early
    headers = {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        **_fault_headers(fault),
    }
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    request[RECORD_KEY].status = response.status
    await _SseWriter(request, response, fault).run(events)
    await response.write_eof()
    return response


# --- inference routes -------------------------------------------------------


def _int_field(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer")
        return value
    return None


def make_plan(
    state: MockState, body: dict[str, Any], model: str, endpoint: str = "chat"
) -> replies.ReplyPlan:
    """The reply to a generation request; admits its prompt to the engine model (which may
    store blocks and publish KV events). `endpoint`: "chat", "completions" or "responses"."""
    knobs = state.knobs
    limit = _int_field(body, "max_completion_tokens", "max_tokens", "max_output_tokens")
    n_tokens = knobs.num_tokens if limit is None else min(limit, knobs.num_tokens)
    prompt = [body.get(k) for k in ("messages", "prompt", "input", "instructions")]
    options = body.get("stream_options")
    ttft_s = knobs.ttft_ms / 1000
    engine = state.engine
    prompt_plan = None
    if engine.active(knobs.prefill_tokens_per_s):
        prompt_plan = engine.plan(
            endpoint,
            body,
            now=time.monotonic(),
            prefill_tokens_per_s=knobs.prefill_tokens_per_s,
            word_count=lambda: replies.count_words(prompt),
        )
        prompt_tokens = prompt_plan.prompt_tokens
        ttft_s += prompt_plan.first_token_delay_s
    else:
        given = token_data(body) if engine.takes_token_data else None
        words = len(given) if given is not None else replies.count_words(prompt)
        prompt_tokens = max(1, words)
    return replies.ReplyPlan(
        model=model,
        n_tokens=n_tokens,
        finish_reason="length" if limit is not None and limit <= knobs.num_tokens else "stop",
        prompt_tokens=prompt_tokens,
        ttft_s=ttft_s,
        token_delay_s=knobs.token_delay_ms / 1000,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        cached_tokens=None if prompt_plan is None else prompt_plan.cached_tokens,
        prompt=prompt_plan,
    )


def _validate(request: web.Request) -> tuple[dict[str, Any], str] | web.Response:
    """Common checks of inference bodies: (body, model) or an error response."""
    state = request.app[STATE_KEY]
    body = request[BODY_KEY]
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    problem = contract_violation(state.config.flavor, body)
    if problem is not None:
        return error_response(400, problem)
    model = body.get("model")
    if not isinstance(model, str):
        return error_response(400, "model is required")
    if model not in state.models:
        return error_response(404, f"The model `{model}` does not exist.")
    return body, model


def _generation_route(body_fn: BodyFn, stream_fn: StreamFn, endpoint: str) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        checked = _validate(request)
        if isinstance(checked, web.Response):
            return checked
        body, model = checked
        state = request.app[STATE_KEY]
        try:
            plan = make_plan(state, body, model, endpoint)
        except ValueError as exc:
            return error_response(400, str(exc))
        if plan.prompt is not None:
            request[RECORD_KEY].kv = plan.prompt.to_json()
        fault = state.faults.take(request.path, model, inference=True)
        if body.get("stream") is True:
            events = stream_fn(plan)
            annotation = _token_ids_annotation(state, body, endpoint)
            if annotation is not None:
                events = itertools.chain(((0.0, annotation),), events)
            return await stream_reply(request, events, fault)
        return await json_reply(request, body_fn(plan), fault, plan.total_delay_s)

    return handle


def _token_ids_annotation(state: MockState, body: dict[str, Any], endpoint: str) -> bytes | None:
    """Like a Dynamo frontend asked for `nvext.annotations: ["token_ids"]` on a stream: the
    prompt's ids (its own tokenization) as an SSE comment after `event: token_ids`, first."""
    nvext = body.get("nvext")
    engine = state.engine
    if state.config.flavor != "dynamo" or engine.tokenizer is None or not isinstance(nvext, dict):
        return None
    wanted = nvext.get("annotations")
    if not isinstance(wanted, list) or "token_ids" not in wanted:
        return None
    ids = [i for prompt in engine.prompt_ids(endpoint, body) for i in prompt]
    return b"event: token_ids\n: " + orjson.dumps(orjson.dumps(ids).decode()) + b"\n\n"


async def handle_embeddings(request: web.Request) -> web.StreamResponse:
    checked = _validate(request)
    if isinstance(checked, web.Response):
        return checked
    body, model = checked
    dims, fmt = body.get("dimensions", 8), body.get("encoding_format", "float")
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= 65536:
        return error_response(400, "dimensions must be an integer in [1, 65536]")
    if fmt not in ("float", "base64"):
        return error_response(400, "encoding_format must be 'float' or 'base64'")
    try:
        payload = replies.embeddings_body(model, body.get("input"), dims, fmt)
    except ValueError as exc:
        return error_response(400, str(exc))
    fault = request.app[STATE_KEY].faults.take(request.path, model, inference=True)
    return await json_reply(request, payload, fault)


# The other routes the engines schedule (docs/api-contract.md, "Routes served"): pooling,
# scoring and reranking, SageMaker's `/invocations`, the native and token-in generate routes.
# The mock answers each with a small JSON object naming the model, after the common checks;
# a route without a model field (SGLang's `/generate`) is served by the first model.
SCHEDULED_ROUTES: tuple[str, ...] = (
    "/pooling",
    "/classify",
    "/v1/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/v2/embed",
    "/v1/messages",
    "/invocations",
    "/generate",
    "/inference/v1/generate",
)
NO_MODEL_FIELD_ROUTES = frozenset({"/generate"})


async def handle_scheduled(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    body = request[BODY_KEY]
    if request.path in NO_MODEL_FIELD_ROUTES and isinstance(body, dict) and "model" not in body:
        if not state.models:
            return error_response(404, "no model is served")
        model = state.models[0]
        problem = contract_violation(state.config.flavor, body)
        if problem is not None:
            return error_response(400, problem)
    else:
        checked = _validate(request)
        if isinstance(checked, web.Response):
            return checked
        body, model = checked
    fault = state.faults.take(request.path, model, inference=True)
    payload = {"object": "result", "model": model, "route": request.path, "data": []}
    return await json_reply(request, payload, fault)


# --- metadata routes --------------------------------------------------------


async def handle_models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    created = int(time.time())
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": state.config.flavor}
        for m in state.models
    ]
    fault = state.faults.take(request.path, None, inference=False)
    return await json_reply(request, {"object": "list", "data": data}, fault)


async def handle_health(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    status, delay_ms = state.health.status, state.health.delay_ms
    if delay_ms > 0:
        await asyncio.sleep(delay_ms / 1000)
    if status != 200:
        # Answered before faults are consulted, so none is used up.
        return error_response(status, "engine unhealthy (set by PUT /test-control/health)")
    payload: dict[str, Any] = {
        "status": "healthy",
        "flavor": state.config.flavor,
        "models": list(state.models),
    }
    if state.health.instances is not None:
        port = request.url.port or 0
        payload["instances"] = [
            {
                "component": "backend",
                "endpoint": "generate",
                "namespace": "dynamo",
                "instance_id": wid,
                "transport": {"tcp": f"127.0.0.1:{port}/{wid:x}/dynamo/backend/generate"},
            }
            for wid in state.health.instances
        ]
    fault = state.faults.take(request.path, None, inference=False)
    return await json_reply(request, payload, fault)


async def handle_health_ready(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    status, delay_ms = state.health.ready_status, state.health.delay_ms
    if delay_ms > 0:
        await asyncio.sleep(delay_ms / 1000)
    if status == 404:
        return error_response(404, "not served (set ready_status by PUT /test-control/health)")
    if status != 200:
        return error_response(status, "engine not ready (set by PUT /test-control/health)")
    return json_ok({"status": "ready"})


# --- test control -----------------------------------------------------------


async def _control_json(request: web.Request) -> object:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise web.HTTPBadRequest(text=f"invalid JSON: {exc}") from exc


async def control_snapshot(request: web.Request) -> web.StreamResponse:
    return json_ok(request.app[STATE_KEY].snapshot())


async def control_reset(request: web.Request) -> web.StreamResponse:
    request.app[STATE_KEY].reset()
    return json_ok({"status": "ok"})


async def control_knobs(request: web.Request) -> web.StreamResponse:
    knobs = request.app[STATE_KEY].knobs
    try:
        knobs.update(await _control_json(request))
    except ValueError as exc:
        return error_response(400, str(exc))
    return json_ok(knobs.to_json())


async def control_set_faults(request: web.Request) -> web.StreamResponse:
    faults = request.app[STATE_KEY].faults
    try:
        faults.replace(await _control_json(request))
    except ValueError as exc:
        return error_response(400, str(exc))
    return json_ok(faults.to_json())


async def control_clear_faults(request: web.Request) -> web.StreamResponse:
    request.app[STATE_KEY].faults.clear()
    return json_ok([])


async def control_models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        state.models = parse_models(await _control_json(request))
    except ValueError as exc:
        return error_response(400, str(exc))
    return json_ok({"models": list(state.models)})


async def control_health(request: web.Request) -> web.StreamResponse:
    health = request.app[STATE_KEY].health
    try:
        health.update(await _control_json(request))
    except ValueError as exc:
        return error_response(400, str(exc))
    return json_ok(health.to_json())


def _wait_params(request: web.Request) -> tuple[str, str, float]:
    """(request_id, event, timeout_s) of a `/test-control/wait` query, or ValueError."""
    query = request.query
    unknown = set(query) - {"request_id", "event", "timeout"}
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    for name in query:
        if len(query.getall(name)) > 1:
            raise ValueError(f"{name} given more than once")
    request_id = query.get("request_id", "")
    if not request_id:
        raise ValueError("request_id is required")
    event = query.get("event", "")
    if event not in WAIT_EVENTS:
        raise ValueError(f"event must be one of {', '.join(WAIT_EVENTS)}")
    raw_timeout = query.get("timeout")
    if raw_timeout is None:
        return request_id, event, WAIT_DEFAULT_TIMEOUT_S
    try:
        timeout = float(raw_timeout)
    except ValueError:
        raise ValueError("timeout must be a number of seconds") from None
    if not (math.isfinite(timeout) and 0 <= timeout <= WAIT_MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be between 0 and {WAIT_MAX_TIMEOUT_S:g} seconds")
    return request_id, event, timeout


async def control_wait(request: web.Request) -> web.StreamResponse:
    """Long poll: the latest record with that x-request-id once `event` happened to it."""
    try:
        request_id, event, timeout = _wait_params(request)
    except ValueError as exc:
        return error_response(400, str(exc))
    recorder = request.app[STATE_KEY].recorder
    signal = request.app[SIGNAL_KEY]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        # Taken before the check: a change after the check still wakes us.
        changed = signal.next_change()
        record = recorder.latest_with_request_id(request_id)
        if record is not None and record.has_happened(event):
            return json_ok(record.to_json())
        if signal.closing:
            return error_response(503, "mock engine is shutting down")
        remaining = deadline - loop.time()
        if remaining <= 0:
            return _wait_timeout(request_id, event, timeout, record)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), remaining)


def _wait_timeout(
    request_id: str, event: str, timeout: float, record: RequestRecord | None
) -> web.Response:
    seen = "no request with that id" if record is None else "a request with that id, but not that"
    message = f"{event} not seen for x-request-id {request_id!r} within {timeout:g} s ({seen})"
    error = {"message": message, "type": _ERROR_TYPES[408], "code": 408}
    # The latest record with that id (or null) tells the test how far the request got.
    payload = {"error": error, "record": None if record is None else record.to_json()}
    return web.Response(status=408, body=orjson.dumps(payload), content_type="application/json")


async def _wake_waiters_on_shutdown(app: web.Application) -> None:
    # Pending long polls answer 503 at once instead of holding up the shutdown.
    for key in (SIGNAL_KEY, KV_SIGNAL_KEY):
        signal = app[key]
        signal.closing = True
        signal.fire()


def _kv_wait_params(request: web.Request) -> tuple[int, float]:
    """(subscribers, timeout_s) of a `GET /test-control/kv` query, or ValueError."""
    query = request.query
    unknown = set(query) - {"wait_subscribers", "timeout"}
    if unknown:
        raise ValueError(f"unknown parameter(s): {', '.join(sorted(unknown))}")
    try:
        wanted = int(query.get("wait_subscribers", "0"))
        timeout = float(query.get("timeout", str(WAIT_DEFAULT_TIMEOUT_S)))
    except ValueError:
        raise ValueError("wait_subscribers must be an integer, timeout a number") from None
    if wanted < 0:
        raise ValueError("wait_subscribers must be >= 0")
    if not (math.isfinite(timeout) and 0 <= timeout <= WAIT_MAX_TIMEOUT_S):
        raise ValueError(f"timeout must be between 0 and {WAIT_MAX_TIMEOUT_S:g} seconds")
    return wanted, timeout


async def control_kv(request: web.Request) -> web.StreamResponse:
    """The engine model's cache view; with `wait_subscribers=N`, first wait (up to `timeout`
    seconds) until N subscriptions reached the KV-event socket."""
    try:
        wanted, timeout = _kv_wait_params(request)
    except ValueError as exc:
        return error_response(400, str(exc))
    engine = request.app[STATE_KEY].engine
    if wanted and engine.events is None:
        return error_response(400, "wait_subscribers needs --kv-events-port")
    signal = request.app[KV_SIGNAL_KEY]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while wanted:
        changed = signal.next_change()
        view = engine.view()
        if view["events"]["subscribers"] >= wanted:
            break
        if signal.closing:
            return error_response(503, "mock engine is shutting down")
        remaining = deadline - loop.time()
        if remaining <= 0:
            return error_response(408, f"{wanted} KV-event subscriber(s) not seen in {timeout:g} s")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), remaining)
    return json_ok(engine.view())


async def control_kv_sequence(request: web.Request) -> web.StreamResponse:
    """Set the KV-event socket's next sequence number (a gap ahead, a restart behind)."""
    engine = request.app[STATE_KEY].engine
    if engine.events is None:
        return error_response(400, "the KV-event sequence needs --kv-events-port")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return error_response(400, "body must be JSON")
    value = body.get("next_seq") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"next_seq"}:
        return error_response(400, 'body must be {"next_seq": <integer>}')
    if not isinstance(value, int) or isinstance(value, bool):
        return error_response(400, 'body must be {"next_seq": <integer>}')
    if not 0 <= value < 1 << 64:
        return error_response(400, "next_seq must be in 0..2^64-1")
    engine.events.next_seq = value
    return json_ok(engine.view())


async def control_kv_clear(request: web.Request) -> web.StreamResponse:
    engine = request.app[STATE_KEY].engine
    engine.clear_cache()
    return json_ok(engine.view())


async def _start_kv_events(app: web.Application) -> None:
    config = app[STATE_KEY].config
    if config.kv_events_port is None:
        return
    from mock_dynamo.kv_publisher import KvEventPublisher  # only with --kv-events-port

    publisher = KvEventPublisher(
        config.kv_events_port, config.kv_events_encoding, app[KV_SIGNAL_KEY].fire
    )
    await publisher.start()
    app[STATE_KEY].engine.events = publisher


async def _stop_kv_events(app: web.Application) -> None:
    engine = app[STATE_KEY].engine
    publisher, engine.events = engine.events, None
    if publisher is not None:
        await publisher.close()


def build_app(config: MockConfig) -> web.Application:
    """The mock as an aiohttp app. Run it with `handler_cancellation=True`
    (as `start_mock` does): otherwise a disconnect is only noticed on the
    next write, so `cancelled_at` comes late and stalls never end. And with
    `auto_decompress=False`, or recorded bodies are the decompressed bytes."""
    app = web.Application(middlewares=[record_requests], client_max_size=MAX_BODY_BYTES)
    state = MockState.from_config(config)
    signal = ChangeSignal()
    state.recorder.add_listener(signal.fire)
    app[STATE_KEY] = state
    app[SIGNAL_KEY] = signal
    app[KV_SIGNAL_KEY] = ChangeSignal()
    app.on_startup.append(_start_kv_events)
    app.on_shutdown.append(_wake_waiters_on_shutdown)
    app.on_cleanup.append(_stop_kv_events)
    app.router.add_post(
        "/v1/chat/completions", _generation_route(replies.chat_body, replies.chat_stream, "chat")
    )
    app.router.add_post(
        "/v1/completions",
        _generation_route(replies.completion_body, replies.completion_stream, "completions"),
    )
    app.router.add_post(
        "/v1/responses",
        _generation_route(replies.responses_body, replies.responses_stream, "responses"),
    )
    app.router.add_post("/v1/embeddings", handle_embeddings)
    for path in SCHEDULED_ROUTES:
        app.router.add_post(path, handle_scheduled)
    app.router.add_put("/generate", handle_scheduled)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/health/ready", handle_health_ready)
    app.router.add_get(CONTROL_PREFIX, control_snapshot)
    app.router.add_get(f"{CONTROL_PREFIX}/wait", control_wait)
    app.router.add_post(f"{CONTROL_PREFIX}/reset", control_reset)
    app.router.add_put(f"{CONTROL_PREFIX}/knobs", control_knobs)
    app.router.add_put(f"{CONTROL_PREFIX}/faults", control_set_faults)
    app.router.add_delete(f"{CONTROL_PREFIX}/faults", control_clear_faults)
    app.router.add_put(f"{CONTROL_PREFIX}/models", control_models)
    app.router.add_put(f"{CONTROL_PREFIX}/health", control_health)
    app.router.add_get(f"{CONTROL_PREFIX}/kv", control_kv)
    app.router.add_delete(f"{CONTROL_PREFIX}/kv", control_kv_clear)
    app.router.add_put(f"{CONTROL_PREFIX}/kv/sequence", control_kv_sequence)
    return app

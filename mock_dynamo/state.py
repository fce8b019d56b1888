"""Mutable run-time state: request recorder, timing knobs and injected faults.

Kept free of aiohttp so the bookkeeping rules can be tested in isolation.
"""

from __future__ import annotations

import base64
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from mock_dynamo.config import MockConfig
from mock_dynamo.engine import EngineModel

# Status recorded when the client went away before response headers were sent
# (nginx's convention; no real HTTP status exists for it).
CLIENT_CLOSED_STATUS = 499
# What `/test-control/wait` can wait for; "finished" is completed or cancelled.
WAIT_EVENTS = ("received", "completed", "cancelled", "finished")


@dataclass(slots=True)
class RequestRecord:
    method: str
    path: str
    endpoint: str
    headers: list[tuple[str, str]]
    body: Any
    received_at: float
    model: str | None = None
    status: int | None = None
    completed_at: float | None = None
    cancelled_at: float | None = None
    # Set when the mock itself aborted the connection (drop fault), so the
    # resulting handler cancellation is not mistaken for a client disconnect.
    server_aborted: bool = False
    # The request target exactly as on the request line (path and query, not
    # percent-decoded) and the body bytes exactly as they arrived (after
    # de-chunking; the mock does not decompress). `path` above is decoded.
    raw_path: str = ""
    raw_body: bytes = b""
    http_version: str = "HTTP/1.1"
    # What the engine model made of the prompt (mock_dynamo.engine.PromptPlan.to_json()), for
    # generation requests while it is on; None otherwise.
    kv: dict[str, Any] | None = None

    @property
    def query_string(self) -> str:
        """The raw query of the request target, without `?`; "" when none."""
        _, _, query = self.raw_path.partition("?")
        return query

    def has_request_id(self, request_id: str) -> bool:
        """Whether any `x-request-id` header (name case-insensitive) equals `request_id`."""
        return any(
            name.lower() == "x-request-id" and value == request_id for name, value in self.headers
        )

    def has_happened(self, event: str) -> bool:
        """Whether `event` (one of WAIT_EVENTS) has happened to this request."""
        if event == "received":
            return True
        if event == "completed":
            return self.completed_at is not None
        if event == "cancelled":
            return self.cancelled_at is not None
        if event == "finished":
            return self.completed_at is not None or self.cancelled_at is not None
        raise ValueError(f"unknown event {event!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "model": self.model,
            "headers": [[name, value] for name, value in self.headers],
            "body": self.body,
            "received_at": self.received_at,
            "cancelled_at": self.cancelled_at,
            "completed_at": self.completed_at,
            "status": self.status,
            "raw_path": self.raw_path,
            "query_string": self.query_string,
            "body_b64": base64.b64encode(self.raw_body).decode("ascii"),
            "body_bytes": len(self.raw_body),
            "http_version": self.http_version,
            "kv": self.kv,
        }


class Recorder:
    """Bounded log of requests plus counters that survive deque eviction.

    Listeners are called (synchronously, with no arguments) after every change:
    a record started, got its model, finished or was cancelled, or a reset. The
    app turns that into an asyncio wake-up for `/test-control/wait`.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._records: deque[RequestRecord] = deque(maxlen=capacity)
        self._listeners: list[Callable[[], None]] = []
        # Insertion-ordered dict used as an LRU so arbitrary client-chosen
        # model names cannot grow it without bound.
        self._last: dict[str, RequestRecord] = {}
        self.total = 0
        self.cancelled = 0
        self.by_endpoint: dict[str, int] = {}

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.remove(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def start(self, record: RequestRecord) -> RequestRecord:
        self._records.append(record)
        self.total += 1
        self.by_endpoint[record.endpoint] = self.by_endpoint.get(record.endpoint, 0) + 1
        self._changed()
        return record

    def set_model(self, record: RequestRecord, model: str) -> None:
        record.model = model
        self._remember_last(record)
        self._changed()

    def finish(self, record: RequestRecord, status: int) -> None:
        record.status = status
        record.completed_at = time.time()
        self._remember_last(record)
        self._changed()

    def cancel(self, record: RequestRecord) -> None:
        if record.cancelled_at is not None or record.completed_at is not None:
            return
        record.cancelled_at = time.time()
        if record.status is None:
            record.status = CLIENT_CLOSED_STATUS
        self.cancelled += 1
        self._remember_last(record)
        self._changed()

    def reset(self) -> None:
        self._records.clear()
        self._last.clear()
        self.by_endpoint.clear()
        self.total = 0
        self.cancelled = 0
        self._changed()

    def latest_with_request_id(self, request_id: str) -> RequestRecord | None:
        """The newest kept record carrying `x-request-id: request_id`, if any."""
        for record in reversed(self._records):
            if record.has_request_id(request_id):
                return record
        return None

    def _remember_last(self, record: RequestRecord) -> None:
        key = f"{record.path}|{record.model or ''}"
        self._last.pop(key, None)
        self._last[key] = record
        if len(self._last) > self._capacity:
            del self._last[next(iter(self._last))]

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": [r.to_json() for r in self._records],
            "last_by_endpoint_model": {k: r.to_json() for k, r in self._last.items()},
            "counters": {
                "total": self.total,
                "by_endpoint": dict(self.by_endpoint),
                "cancelled": self.cancelled,
            },
        }


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `true` is never a valid count.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


_KNOBS = ("ttft_ms", "token_delay_ms", "num_tokens", "prefill_tokens_per_s")


@dataclass(slots=True)
class Knobs:
    ttft_ms: float
    token_delay_ms: float
    num_tokens: int
    # Uncached prompt tokens prefilled per second (see mock_dynamo.engine); 0: prefill is free.
    prefill_tokens_per_s: float = 0.0

    def update(self, patch: object) -> None:
        """Apply a partial update atomically: validate everything first."""
        if not isinstance(patch, dict):
            raise ValueError("knobs must be a JSON object")
        unknown = set(patch) - set(_KNOBS)
        if unknown:
            raise ValueError(f"unknown knob(s): {', '.join(sorted(unknown))}")
        for name in ("ttft_ms", "token_delay_ms", "prefill_tokens_per_s"):
            if name in patch and not (
                _is_number(patch[name]) and math.isfinite(patch[name]) and patch[name] >= 0
            ):
                raise ValueError(f"{name} must be a number >= 0")
        count = patch.get("num_tokens", 0)
        if not (_is_int(count) and count >= 0):
            raise ValueError("num_tokens must be an integer >= 0")
        for name, value in patch.items():
            setattr(self, name, value)

    def to_json(self) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft_ms,
            "token_delay_ms": self.token_delay_ms,
            "num_tokens": self.num_tokens,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
        }


_FAULT_INT_FIELDS = (
    "status",
    "delay_ms",
    "stall_after_events",
    "drop_after_events",
    "huge_event_bytes",
    "after_events",
    "times",
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected misbehaviour. See the package README/docstring of
    `mock_dynamo.app` for what each field does."""

    path: str | None = None
    model: str | None = None
    status: int | None = None
    retryable: bool | None = None
    retry_after: str | None = None
    delay_ms: int = 0
    stall_after_events: int | None = None
    drop_after_events: int | None = None
    malformed_event: bool = False
    huge_event_bytes: int | None = None
    # Position (in events) at which malformed/huge events are injected.
    after_events: int = 1
    times: int | None = None

    @classmethod
    def parse(cls, raw: object) -> Fault:
        if not isinstance(raw, dict):
            raise ValueError("each fault must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(sorted(unknown))}")
        _check_fault_types(raw)
        return cls(**raw)

    def matches(self, path: str, model: str | None, inference: bool) -> bool:
        # A fault without an explicit path only hits inference routes, so a
        # proxy's health probes cannot silently consume a `times`-limited fault.
        if self.path is None and not inference:
            return False
        if self.path is not None and self.path != path:
            return False
        return self.model is None or self.model == model

    def to_json(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }


def _check_fault_types(raw: dict[str, Any]) -> None:
    for name in ("path", "model", "retry_after"):
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise ValueError(f"fault.{name} must be a string")
    for name in ("retryable", "malformed_event"):
        if raw.get(name) is not None and not isinstance(raw[name], bool):
            raise ValueError(f"fault.{name} must be a boolean")
    for name in _FAULT_INT_FIELDS:
        if raw.get(name) is not None and not (_is_int(raw[name]) and raw[name] >= 0):
            raise ValueError(f"fault.{name} must be an integer >= 0")
    status = raw.get("status")
    if status is not None and not 100 <= status <= 599:
        raise ValueError("fault.status must be an HTTP status code")


@dataclass(slots=True)
class _ArmedFault:
    fault: Fault
    remaining: int | None


class FaultTable:
    """Ordered list of faults; the first match wins and uses up one `times`."""

    def __init__(self) -> None:
        self._armed: list[_ArmedFault] = []

    def replace(self, raw: object) -> None:
        if not isinstance(raw, list):
            raise ValueError("faults must be a JSON list")
        parsed = [Fault.parse(item) for item in raw]
        # `times: 0` means "never": dropping it here keeps take() simple.
        self._armed = [_ArmedFault(f, f.times) for f in parsed if f.times != 0]

    def clear(self) -> None:
        self._armed = []

    def take(self, path: str, model: str | None, inference: bool) -> Fault | None:
        for armed in self._armed:
            if not armed.fault.matches(path, model, inference):
                continue
            if armed.remaining is not None:
                armed.remaining -= 1
                if armed.remaining <= 0:
                    self._armed.remove(armed)
            return armed.fault
        return None

    def to_json(self) -> list[dict[str, Any]]:
        return [{**a.fault.to_json(), "remaining": a.remaining} for a in self._armed]


def parse_models(raw: object) -> tuple[str, ...]:
    """The model list of a `PUT /test-control/models` body: `{"models": [names]}`.

    An empty list is allowed (an engine up with nothing loaded); names must be
    non-empty strings and distinct.
    """
    if not isinstance(raw, dict) or set(raw) != {"models"}:
        raise ValueError('models must be a JSON object {"models": [names]}')
    models = raw["models"]
    if not isinstance(models, list) or any(not isinstance(m, str) or not m for m in models):
        raise ValueError("models must be a list of non-empty strings")
    if len(set(models)) != len(models):
        raise ValueError("models must not repeat a name")
    return tuple(models)


# Longest /health delay accepted; bounded so no event loop is asked to sleep for ages.
MAX_HEALTH_DELAY_MS = 3_600_000


@dataclass(slots=True)
class Health:
    """What `/health` answers: 200 with the healthy payload, or `status` with an
    error body; either after `delay_ms`. `/v1/health/ready` (a NIM-style
    readiness path, which Dynamo does not serve) answers `ready_status`: 404 by
    default, 200 with `{"status": "ready"}`, or that error status."""

    status: int = 200
    delay_ms: float = 0
    ready_status: int = 404
    # Dynamo instance ids `/health` lists as `instances[]` of endpoint `generate` (a Dynamo
    # 1.6.1 frontend's shape); None: no `instances` field.
    instances: list[int] | None = None

    def update(self, patch: object) -> None:
        """Apply a partial update atomically: validate everything first."""
        if not isinstance(patch, dict):
            raise ValueError("health must be a JSON object")
        unknown = set(patch) - {"status", "delay_ms", "ready_status", "instances"}
        if unknown:
            raise ValueError(f"unknown health field(s): {', '.join(sorted(unknown))}")
        status = patch.get("status", 200)
        if not (_is_int(status) and (status == 200 or 400 <= status <= 599)):
            raise ValueError("health.status must be 200 or an error status (400-599)")
        ready = patch.get("ready_status", 404)
        if not (_is_int(ready) and (ready == 200 or 400 <= ready <= 599)):
            raise ValueError("health.ready_status must be 200 or an error status (400-599)")
        delay = patch.get("delay_ms", 0)
        if not (_is_number(delay) and 0 <= delay <= MAX_HEALTH_DELAY_MS):
            raise ValueError(f"health.delay_ms must be a number in [0, {MAX_HEALTH_DELAY_MS}]")
        instances = patch.get("instances")
        if instances is not None and not (
            isinstance(instances, list)
            and len(instances) <= 4096
            and all(_is_int(i) and 0 <= i < 1 << 64 for i in instances)
        ):
            raise ValueError("health.instances must be null or a list of u64 instance ids")
        for name, value in patch.items():
            setattr(self, name, value)

    def to_json(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "status": self.status,
            "delay_ms": self.delay_ms,
            "ready_status": self.ready_status,
        }
        if self.instances is not None:
            shown["instances"] = self.instances
        return shown


@dataclass(slots=True)
class MockState:
    config: MockConfig
    recorder: Recorder
    knobs: Knobs
    faults: FaultTable = field(default_factory=FaultTable)
    health: Health = field(default_factory=Health)
    # Served models; starts as (and a reset restores) config.models.
    models: tuple[str, ...] = field(init=False)
    engine: EngineModel = field(init=False)

    def __post_init__(self) -> None:
        self.models = self.config.models
        self.engine = EngineModel(self.config)

    @classmethod
    def from_config(cls, config: MockConfig) -> MockState:
        return cls(
            config=config,
            recorder=Recorder(config.capacity),
            knobs=Knobs(
                config.ttft_ms,
                config.token_delay_ms,
                config.num_tokens,
                config.prefill_tokens_per_s,
            ),
        )

    def reset(self) -> None:
        """Forget records and faults, restore the configured models and a healthy
        `/health`, empty the prefix cache (AllBlocksCleared) and zero its counters; knobs
        deliberately survive a reset."""
        self.recorder.reset()
        self.faults.clear()
        self.models = self.config.models
        self.health = Health()
        self.engine.reset()

    def snapshot(self) -> dict[str, Any]:
        return {
            **self.recorder.snapshot(),
            "knobs": self.knobs.to_json(),
            "faults": self.faults.to_json(),
            "models": list(self.models),
            "health": self.health.to_json(),
            "kv": self.engine.view(),
        }

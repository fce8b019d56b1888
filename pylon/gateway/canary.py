"""The active canary: per published model, a small non-streaming chat completion to the engine
on an interval, whose verdict the registration advertises (a failing model is INACTIVE) and
`/ready` follows (`canary_failed` while any published model's canary fails).

One task per published model (`Canaries.sync` starts the new ones and stops the retired, whose
health is forgotten). Each task runs a canary every `interval` seconds:

    POST /v1/chat/completions
    {"model": M, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": MAX,
     "seed": 33, "temperature": 0.7, "stream": false}

It fails on a transport error (`connect`, `closed`, `protocol`, `too_large`), no complete answer
within `timeout` (`timeout`), a non-2xx status (`status`), a body that is not a chat completion
JSON object (`invalid`), or `usage.completion_tokens` reaching `max_tokens` (`runaway`: a model
that babbles to the cap instead of answering). A failure advertises the model unhealthy
(`GatewayBoard.set_model_health(model, ModelHealth(False, reason))`) and switches that model to
recovery: a canary every `recovery_interval` seconds until one passes (the canary itself is the
probe: a health path answering 200 says nothing about a model), then healthy again.

Where it goes: `target()`, called per canary, names the engine the requests go to: the one
`--upstream` (`single_target`), or with a fleet a worker in rotation, rotating across them
(`fleet_target`, with the worker's trusted pin headers). None (no worker in rotation): that round
is skipped and health is left as it is (no worker in rotation is already `/ready`'s
`no_worker_in_rotation`; a canary verdict would only blame the model for it).

The canary is pylon's own request, sent with `pylon.upstream.probe.post_json` on a connection of
its own: it never passes the proxy, so it is in no queue table, no booking, no request metric and
no access log line, and it takes no slot of the upstream pool. Its `x-request-id` is
`canary-<process id>-<counter>` (the reference's prefix: an engine's logs tell it apart). The
priority it carries is the injected `priority` write (default none; `adapter.derive(0)` makes it
the most urgent, so that a loaded engine is not mistaken for a broken model).

`/ready`: `on_fault` (e.g. `Lifecycle.set_canary`) is called after each change of the set of
failing models with `("canary_failed", detail naming them)`, or None when none fails. Any, not
all: a node with one broken model is not fully serving what it advertises; the gateway routes
per model anyway (it reads the advertised status), `/ready` is for the orchestrator.

Events (`observer.process_event`):
- `canary_failed` (warning): the model's canary failed while it was healthy: `model`, `reason`,
  `detail`, `duration_ms`, `upstream`;
- `canary_still_failing` (debug): a recovery canary failed: the same fields, `failed_s`;
- `canary_recovered` (info): a canary passed after failures: `model`, `failed_s`, `attempts`;
- `canary_passed` (debug): `model`, `duration_ms`, `completion_tokens`, `upstream`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import orjson

from pylon.core.http import Header
from pylon.core.priority import NO_WRITE, PriorityWrite
from pylon.core.upstream import Upstream
from pylon.gateway.board import GatewayBoard, ModelHealth
from pylon.lifecycle import NOT_READY_CANARY
from pylon.upstream.probe import Fetched, FetchError, post_json

if TYPE_CHECKING:
    from pylon.observe import Observer
    from pylon.routing.fleet import Fleet

CHAT_PATH = "/v1/chat/completions"
PROMPT = "1+1="
SEED = 33
TEMPERATURE = 0.7
MAX_CANARY_BODY = 256 * 1024  # a canary's answer is a few hundred tokens at most
DETAIL_MODELS = 8  # failing models the /ready detail names (then only the count says more)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
FaultCallback = Callable[[tuple[str, str] | None], None]


class Post(Protocol):
    """`pylon.upstream.probe.post_json`, or a test's scripted engine."""

    async def __call__(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        *,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        timeout: float,
        max_body: int,
    ) -> Fetched: ...


@dataclass(frozen=True, slots=True)
class CanaryOptions:
    """`--canary-interval`, `--canary-timeout`, `--canary-max-tokens`,
    `--canary-recovery-interval`."""

    interval: float = 5.0  # seconds between canaries of a healthy model; 0: no canary
    timeout: float = 5.0  # seconds one canary may take
    max_tokens: int = 237  # its max_tokens; this many completion tokens is a runaway
    recovery_interval: float = 1.0  # seconds between canaries of a failing model

    def __post_init__(self) -> None:
        if not self.interval >= 0:
            raise ValueError(f"interval must be >= 0, got {self.interval}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {self.max_tokens}")
        if not self.recovery_interval > 0:
            raise ValueError(f"recovery_interval must be > 0, got {self.recovery_interval}")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


@dataclass(frozen=True, slots=True)
class CanaryTarget:
    """Where one canary goes: the engine and pylon's own trusted headers for it (a worker pin)."""

    upstream: Upstream
    headers: tuple[Header, ...] = ()


Target = Callable[[], "CanaryTarget | Upstream | None"]


def single_target(upstream: Upstream) -> Target:
    """`--routing off`: every canary to the one engine."""
    target = CanaryTarget(upstream)
    return lambda: target


def fleet_target(fleet: Fleet) -> Target:
    """A fleet: each canary to the next worker in rotation (None while none is)."""
    turn = itertools.count()

    def pick() -> CanaryTarget | None:
        in_rotation = fleet.in_rotation
        if not in_rotation:
            return None
        worker = in_rotation[next(turn) % len(in_rotation)]
        return CanaryTarget(worker.upstream, worker.headers)

    return pick


@dataclass(frozen=True, slots=True)
class CanaryResult:
    """One canary: passed (`reason` None) or failed (`reason` a label, `detail` one line)."""

    reason: str | None
    detail: str
    duration_ms: float
    completion_tokens: int | None = None
    upstream: str | None = None

    @property
    def passed(self) -> bool:
        return self.reason is None

    @property
    def health_reason(self) -> str:
        """What `ModelHealth.reason` says: the label, with the status for a status."""
        return self.detail if self.reason == "status" else (self.reason or "")


def judge(status: int, body: bytes, max_tokens: int) -> tuple[str | None, str, int | None]:
    """(reason or None, detail, completion tokens) of a canary's answer. Pure."""
    if not 200 <= status < 300:
        return "status", f"status {status}", None
    try:
        reply = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "invalid", "the answer is not JSON", None
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list):
        return "invalid", "the answer is not a chat completion (no choices)", None
    usage = reply.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if tokens is None:
        return None, "passed (no usage reported)", None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        return "invalid", "usage.completion_tokens is not a count", None
    if tokens >= max_tokens:
        return (
            "runaway",
            f"runaway generation: {tokens} completion tokens (max {max_tokens})",
            tokens,
        )
    return None, "passed", tokens


class Canaries:
    """One canary task per published model (see the module docstring)."""

    def __init__(
        self,
        options: CanaryOptions,
        board: GatewayBoard,
        target: Target,
        observer: Observer,
        *,
        on_fault: FaultCallback | None = None,
        priority: PriorityWrite = NO_WRITE,
        post: Post = post_json,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._options = options
        self._board = board
        self._target = target
        self._observer = observer
        self._on_fault = on_fault
        self._post = post
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failing: dict[str, str] = {}  # model -> health reason, while its canary fails
        self._last_fault: tuple[str, str] | None = None
        self._ids = itertools.count(1)
        self._process = f"{os.getpid()}{uuid.uuid4().hex[:8]}"
        self._extra = tuple(priority.headers)
        self._body_priority = priority.body_priority

    @property
    def models(self) -> tuple[str, ...]:
        """The models a canary runs for now."""
        return tuple(self._tasks)

    def failing(self) -> dict[str, str]:
        """The models whose canary fails now, with the reason."""
        return dict(self._failing)

    def sync(self, models: Iterable[str]) -> None:
        """Follow the published set: start a canary for each new model, stop (and forget the
        health of) each one no longer in it. Call it inside the event loop."""
        wanted = dict.fromkeys(models)
        for model in [m for m in self._tasks if m not in wanted]:
            self._tasks.pop(model).cancel()
            self._forget(model)
        if not self._options.enabled:
            return
        for model in wanted:
            if model not in self._tasks:
                self._tasks[model] = asyncio.get_running_loop().create_task(
                    self._run(model), name=f"canary {model}"
                )

    async def aclose(self) -> None:
        """Stop every canary (health as last advertised stays on the board)."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- one model ---

    async def _run(self, model: str) -> None:
        options = self._options
        failed_at: float | None = None
        attempts = 0
        while True:
            result = await self.probe(model)
            if result is None:  # nothing in rotation to ask: health stays as it is
                await self._sleep(options.recovery_interval if failed_at else options.interval)
                continue
            now = self._now()
            if result.passed:
                if failed_at is not None:
                    self._observer.process_event(
                        "canary_recovered",
                        model=model,
                        failed_s=round(now - failed_at, 3),
                        attempts=attempts,
                    )
                    failed_at = None
                    attempts = 0
                    self._set(model, None)
                else:
                    self._observer.process_event(
                        "canary_passed",
                        model=model,
                        duration_ms=result.duration_ms,
                        completion_tokens=result.completion_tokens,
                        upstream=result.upstream,
                    )
                await self._sleep(options.interval)
                continue
            attempts += 1
            fields = {
                "model": model,
                "reason": result.reason,
                "detail": result.detail,
                "duration_ms": result.duration_ms,
                "upstream": result.upstream,
            }
            if failed_at is None:
                failed_at = now - result.duration_ms / 1000
                self._observer.process_event("canary_failed", **fields)
            else:
                self._observer.process_event(
                    "canary_still_failing", **fields, failed_s=round(now - failed_at, 3)
                )
            self._set(model, result.health_reason)
            await self._sleep(options.recovery_interval)

    async def probe(self, model: str) -> CanaryResult | None:
        """One canary of `model` now; None when `target()` names no engine."""
        chosen = self._target()
        if chosen is None:
            return None
        target = chosen if isinstance(chosen, CanaryTarget) else CanaryTarget(chosen)
        options = self._options
        request = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": options.max_tokens,
            "seed": SEED,
            "temperature": TEMPERATURE,
            "stream": False,
        }
        if self._body_priority is not None:
            request["priority"] = self._body_priority
        request_id = f"canary-{self._process}-{next(self._ids)}".encode("ascii")
        headers = ((b"x-request-id", request_id), *self._extra, *target.headers)
        started = self._now()
        label = target.upstream.label
        try:
            reply = await self._post(
                target.upstream,
                CHAT_PATH,
                orjson.dumps(request),
                headers=headers,
                timeout=options.timeout,
                max_body=MAX_CANARY_BODY,
            )
        except FetchError as exc:
            return CanaryResult(exc.reason, exc.detail, self._elapsed(started), upstream=label)
        except Exception as exc:  # a bug: the canary fails loudly, the loop goes on
            detail = f"{exc.__class__.__name__}: {exc}"
            return CanaryResult("error", detail, self._elapsed(started), upstream=label)
        reason, detail, tokens = judge(reply.status, reply.body, options.max_tokens)
        return CanaryResult(reason, detail, self._elapsed(started), tokens, label)

    # --- health ---

    def _set(self, model: str, reason: str | None) -> None:
        if model not in self._tasks:
            return  # retired meanwhile: its health is forgotten
        if reason is None:
            self._failing.pop(model, None)
            self._board.set_model_health(model, ModelHealth(True))
        else:
            self._failing[model] = reason
            self._board.set_model_health(model, ModelHealth(False, reason))
        self._tell()

    def _forget(self, model: str) -> None:
        self._failing.pop(model, None)
        self._board.set_model_health(model, None)
        self._tell()

    def _tell(self) -> None:
        fault = None
        if self._failing:
            names = sorted(self._failing)
            shown = ", ".join(f"{m} ({self._failing[m]})" for m in names[:DETAIL_MODELS])
            more = f" and {len(names) - DETAIL_MODELS} more" if len(names) > DETAIL_MODELS else ""
            fault = (NOT_READY_CANARY, f"the canary of {len(names)} model(s) fails: {shown}{more}")
        if fault != self._last_fault:
            self._last_fault = fault
            if self._on_fault is not None:
                self._on_fault(fault)

    def _now(self) -> float:
        return (self._clock or asyncio.get_running_loop().time)()

    def _elapsed(self, started: float) -> float:
        return round((self._now() - started) * 1000, 3)

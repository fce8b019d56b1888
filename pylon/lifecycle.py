"""The process lifecycle: starting, ready, draining, and the models published. One per process.

Listeners, admission (the `not_ready`, `shutting_down` and `model_generation_unavailable` 503s)
and the admin `/ready` (`readiness`) read it; nothing else keeps a drain flag or a model set of
its own. `readiness()` is the one answer to "may traffic come here?". Connections subscribe to be
told when the drain starts (HTTP/2 and HTTP/3 send GOAWAY, idle HTTP/1.1 keep-alives close).

`STARTING` lasts until the engine passed its health gate (and, with discovery, the first poll
ran: `pylon.bringup`); `mark_ready` then moves to `READY`. Whether pylon is *ready for traffic*
also needs a published model and, after start-up, an engine that still answers: `set_engine`
records an engine fault (the single engine failing its health checks: `pylon.bringup.EngineWatch`;
no routing worker in rotation: the fleet's in-rotation view, so every ejection, active or
passive, counts), and `set_canary` a failing active canary (`pylon.gateway.canary`: any published
model whose canary fails makes the node not fully serving). `readiness` says all of it, with
the reason; `on_readiness` subscribers hear each change of it (the `readiness_changed` line,
the `pylon_ready` gauge).
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from pylon.models import ModelCatalog


class Phase(enum.Enum):
    STARTING = "starting"  # listeners may be up; the engine is not known to be usable yet
    READY = "ready"  # the engine passed its health gate
    DRAINING = "draining"  # SIGTERM: finish what is in flight, admit nothing new


# `readiness` reasons (the JSON reason of `/ready`; `Phase` names the phases themselves).
NOT_READY_DRAINING = "draining"
NOT_READY_ENGINE = "engine_not_ready"
NOT_READY_NO_MODELS = "no_models"
NOT_READY_ENGINE_UNHEALTHY = "engine_unhealthy"  # the engine fails its health checks
NOT_READY_NO_WORKER = "no_worker_in_rotation"  # every routing worker is out of rotation
NOT_READY_CANARY = "canary_failed"  # a published model's active canary fails (--gateway)
READY_REASON = "ready"

ReadinessListener = Callable[[bool, str, str | None], None]


class Lifecycle:
    __slots__ = (
        "_canary_fault",
        "_engine_fault",
        "_last",
        "_listeners",
        "_readiness_listeners",
        "models",
        "phase",
    )

    def __init__(self, phase: Phase = Phase.STARTING, models: ModelCatalog | None = None) -> None:
        self.phase = phase
        self.models = models if models is not None else ModelCatalog()
        # A dict as an ordered set: connections come and go, so removal must be O(1).
        self._listeners: dict[Callable[[], None], None] = {}
        self._engine_fault: tuple[str, str] | None = None  # (reason, detail) after start-up
        self._canary_fault: tuple[str, str] | None = None  # (reason, detail): a canary fails
        self._readiness_listeners: list[ReadinessListener] = []
        self._last = self.readiness()
        self.models.on_change(self._recheck)

    def readiness(self) -> tuple[bool, str]:
        """May an orchestrator send traffic here? (ready, reason): `draining` as soon as the
        drain starts, `engine_not_ready` before the health gate passed, then the engine fault
        (`engine_unhealthy`, `no_worker_in_rotation`) while there is one, then a failing
        canary (`canary_failed`), `no_models` while no model is published, else `ready`."""
        if self.phase is Phase.DRAINING:
            return False, NOT_READY_DRAINING
        if self.phase is Phase.STARTING:
            return False, NOT_READY_ENGINE
        if self._engine_fault is not None:
            return False, self._engine_fault[0]
        if self._canary_fault is not None:
            return False, self._canary_fault[0]
        if not self.models.published:
            return False, NOT_READY_NO_MODELS
        return True, READY_REASON

    def readiness_detail(self) -> str | None:
        """What the engine (or canary) fault that makes pylon not ready is (None when there is
        none)."""
        ready, reason = self.readiness()
        if ready:
            return None
        for fault in (self._engine_fault, self._canary_fault):
            if fault is not None and fault[0] == reason:
                return fault[1]
        return None

    def set_engine(self, fault: tuple[str, str] | None) -> None:
        """The engine's state after start-up: None while it serves, else (reason, detail)."""
        self._engine_fault = fault
        self._recheck()

    def set_canary(self, fault: tuple[str, str] | None) -> None:
        """The active canaries' verdict: None while every published model's passes, else
        (reason, detail) naming the models whose canary fails."""
        self._canary_fault = fault
        self._recheck()

    def on_readiness(self, listener: ReadinessListener) -> None:
        """Call `listener(ready, reason, detail)` after each change of `readiness()`."""
        self._readiness_listeners.append(listener)

    def _recheck(self) -> None:
        now = self.readiness()
        if now == self._last:
            return
        self._last = now
        detail = self.readiness_detail()
        for listener in self._readiness_listeners:
            listener(now[0], now[1], detail)

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def mark_ready(self) -> None:
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY
            self._recheck()

    def drain(self) -> None:
        """Start the drain (once): every subscriber is told, in subscription order."""
        if self.phase is Phase.DRAINING:
            return
        self.phase = Phase.DRAINING
        self._recheck()
        for listener in list(self._listeners):
            listener()

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Call `listener` when the drain starts (at once if it already has)."""
        if self.phase is Phase.DRAINING:
            listener()
        else:
            self._listeners[listener] = None

    def forget(self, listener: Callable[[], None]) -> None:
        """A connection that closed before the drain need not be told."""
        self._listeners.pop(listener, None)

"""The process lifecycle: starting, ready, draining, and the models published. One per process.

Listeners, admission (the `not_ready`, `shutting_down` and `model_generation_unavailable` 503s)
and the admin `/ready` (`readiness`) read it; nothing else keeps a drain flag or a model set of
its own. `readiness()` is the one answer to "may traffic come here?". Connections subscribe to be
told when the drain starts (HTTP/2 and HTTP/3 send GOAWAY, idle HTTP/1.1 keep-alives close).

`STARTING` lasts until the engine passed its health gate (and, with discovery, the first poll
ran: `pylon.bringup`); `mark_ready` then moves to `READY`. Whether pylon is *ready for traffic*
also needs a published model: `readiness` says both, with the reason.
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
READY_REASON = "ready"


class Lifecycle:
    __slots__ = ("_listeners", "models", "phase")

    def __init__(self, phase: Phase = Phase.STARTING, models: ModelCatalog | None = None) -> None:
        self.phase = phase
        self.models = models if models is not None else ModelCatalog()
        # A dict as an ordered set: connections come and go, so removal must be O(1).
        self._listeners: dict[Callable[[], None], None] = {}

    def readiness(self) -> tuple[bool, str]:
        """May an orchestrator send traffic here? (ready, reason): `draining` as soon as the
        drain starts, `engine_not_ready` before the health gate passed, `no_models` while no
        model is published, else `ready`."""
        if self.phase is Phase.DRAINING:
            return False, NOT_READY_DRAINING
        if self.phase is Phase.STARTING:
            return False, NOT_READY_ENGINE
        if not self.models.published:
            return False, NOT_READY_NO_MODELS
        return True, READY_REASON

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def mark_ready(self) -> None:
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY

    def drain(self) -> None:
        """Start the drain (once): every subscriber is told, in subscription order."""
        if self.phase is Phase.DRAINING:
            return
        self.phase = Phase.DRAINING
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

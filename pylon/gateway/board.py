"""`GatewayBoard`: what the registration streams, the reverse tunnels and the canaries tell
each other, in one process. Sans-I/O: plain state and synchronous change callbacks.

- Registration writes each gateway's latest ack (`set_target`: where that gateway wants the
  reverse tunnel, or None when its stream ended) and reads the tunnel state and model health.
- The tunnel manager reads the targets (dials, redials on a change) and writes how many of a
  gateway's tunnel connections are up (`set_tunnels`).
- The canaries write each model's health (`set_model_health`); `/ready` and the registration
  snapshot read it.
- Drain (`start_drain`): everything advertised INACTIVE before anything closes.

Each change that alters what a gateway should be told bumps `version` and calls the
subscribers (`subscribe`), which wake their own loops (e.g. a registration stream sends its
snapshot at once). Keys: a gateway is named by its authority (`StargateInfo.advertise_addr`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class ModelStatus(Enum):
    ACTIVE = "active"
    INACTIVE = "inactive"


@dataclass(frozen=True, slots=True)
class TunnelTarget:
    """One gateway's ack: the routing identity (SNI) and the address to dial."""

    target: str
    dial_addr: str


@dataclass(frozen=True, slots=True)
class ModelHealth:
    healthy: bool
    reason: str = ""  # why not, for the log line and /ready (e.g. "timeout", "status 500")


Change = Callable[[str], None]  # called with what changed: "target", "tunnel", "health", "drain"


class GatewayBoard:
    def __init__(self, *, reverse: bool) -> None:
        self.reverse = reverse
        self.version = 0
        self._targets: dict[str, TunnelTarget] = {}
        self._tunnels: dict[str, int] = {}
        self._health: dict[str, ModelHealth] = {}
        self._draining = False
        self._subscribers: list[Change] = []

    # -- subscriptions ---------------------------------------------------------------------

    def subscribe(self, callback: Change) -> Callable[[], None]:
        """Call `callback(kind)` after each change; returns the unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def _changed(self, kind: str) -> None:
        self.version += 1
        for callback in tuple(self._subscribers):
            callback(kind)

    # -- reverse-tunnel targets (registration -> tunnel) -----------------------------------

    def set_target(self, gateway: str, target: TunnelTarget | None) -> None:
        if target is None:
            if self._targets.pop(gateway, None) is not None:
                self._changed("target")
        elif self._targets.get(gateway) != target:
            self._targets[gateway] = target
            self._changed("target")

    def target(self, gateway: str) -> TunnelTarget | None:
        return self._targets.get(gateway)

    def targets(self) -> dict[str, TunnelTarget]:
        return dict(self._targets)

    # -- tunnel state (tunnel -> registration) ---------------------------------------------

    def set_tunnels(self, gateway: str, connected: int) -> None:
        before = self._tunnels.get(gateway, 0)
        if connected:
            self._tunnels[gateway] = connected
        else:
            self._tunnels.pop(gateway, None)
        if (before > 0) != (connected > 0):
            self._changed("tunnel")

    def tunnels(self, gateway: str) -> int:
        return self._tunnels.get(gateway, 0)

    def tunnel_connected(self, gateway: str) -> bool:
        return self._tunnels.get(gateway, 0) > 0

    # -- model health (canary -> registration, /ready) -------------------------------------

    def set_model_health(self, model: str, health: ModelHealth | None) -> None:
        """A model's canary verdict; None when the model is retired (forgotten)."""
        if health is None:
            if self._health.pop(model, None) is not None:
                self._changed("health")
        elif self._health.get(model) != health:
            flipped = self._health.get(model, ModelHealth(True)).healthy != health.healthy
            self._health[model] = health
            if flipped:
                self._changed("health")

    def model_health(self, model: str) -> ModelHealth:
        """Healthy until a canary says otherwise."""
        return self._health.get(model, ModelHealth(True))

    def unhealthy_models(self) -> dict[str, ModelHealth]:
        return {m: h for m, h in self._health.items() if not h.healthy}

    # -- what a gateway is told ------------------------------------------------------------

    def status(self, gateway: str, model: str) -> ModelStatus:
        """ACTIVE unless draining, the model's canary fails, or (reverse) that gateway's
        tunnel is down."""
        if self._draining or not self.model_health(model).healthy:
            return ModelStatus.INACTIVE
        if self.reverse and not self.tunnel_connected(gateway):
            return ModelStatus.INACTIVE
        return ModelStatus.ACTIVE

    @property
    def draining(self) -> bool:
        return self._draining

    def start_drain(self) -> None:
        if not self._draining:
            self._draining = True
            self._changed("drain")

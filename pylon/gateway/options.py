"""`GatewayOptions`: what `pylon.assemble.gateway_options` makes of the `Gateway` settings, for
`pylon.gateway.side.GatewaySide` (apart, so the assembly layer need not import the side)."""

from __future__ import annotations

from dataclasses import dataclass

from pylon.gateway.canary import CanaryOptions
from pylon.gateway.registration import RegistrationOptions
from pylon.gateway.tunnel import TunnelOptions


@dataclass(frozen=True, slots=True)
class GatewayOptions:
    registration: RegistrationOptions | None  # None: no --gateway (the canaries alone)
    canary: CanaryOptions | None  # None: no canary (interval 0, or no --gateway)
    tunnel: TunnelOptions | None  # None: direct mode

"""`GatewaySide`: the gateway parts of one pylon process, built from their options and run in
the order the gateway must see them.

- Start (`start`, once bring-up passed: the reference makes no gateway call before every initial
  model is ready): the canaries follow the published models, the registration streams open, and
  in reverse mode the tunnels follow the registration acks.
- Drain (`drain`, on SIGTERM, before the listeners drain): every model is advertised INACTIVE and
  each gateway's ack of it awaited (bounded), the tunnels stop taking new streams (GOAWAY); the
  caller then gives requests in flight their grace, and `close` ends the tunnels and the streams.

The parts only meet through the `GatewayBoard`; this module wires them to the running core (its
published models, queue table and intake) and to each other, and reads no settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from pylon.gateway.board import GatewayBoard
from pylon.gateway.canary import Canaries, fleet_target, single_target
from pylon.gateway.model_stats import ModelStatsCollector, OutputMeter, build_collector
from pylon.gateway.options import GatewayOptions
from pylon.gateway.raw_link import LINKS
from pylon.gateway.registration import GatewayReport, Registration
from pylon.gateway.stats import ModelStatsValue
from pylon.gateway.tunnel import ReverseTunnels

if TYPE_CHECKING:
    from pylon.assemble import Core
    from pylon.core.upstream import Upstream
    from pylon.observe import Observer
    from pylon.routing.build import Routing


class GatewaySide:
    """One process's registration, canaries and reverse tunnels (see the module docstring)."""

    def __init__(
        self,
        options: GatewayOptions,
        core: Core,
        meter: OutputMeter,
        *,
        upstream: Upstream | None,
        routing: Routing | None,
        observer: Observer,
    ) -> None:
        self.options = options
        self.board = GatewayBoard(reverse=options.tunnel is not None)
        self._core = core
        self._observer = observer
        self.collector: ModelStatsCollector = build_collector(core, routing, meter)
        self.canaries: Canaries | None = None
        if options.canary is not None:
            target = (
                fleet_target(routing.fleet)
                if routing is not None
                else single_target(upstream)
                if upstream is not None
                else None
            )
            if target is None:
                raise ValueError("a canary needs the engine's upstream or a fleet")
            self.canaries = Canaries(
                options.canary,
                self.board,
                target,
                observer,
                on_fault=core.lifecycle.set_canary,
                # The most urgent priority: a loaded engine must not make a model look broken.
                priority=core.queue.adapter.derive(0),
            )
        self.registration: Registration | None = None
        self.tunnels: ReverseTunnels | None = None
        if options.tunnel is not None:
            self.tunnels = ReverseTunnels(
                options.tunnel, self.board, core.ingress, observer, links=LINKS
            )
        self._started = False

    def _published(self) -> frozenset[str]:
        return self._core.lifecycle.models.published

    def _stats(self) -> Mapping[str, ModelStatsValue]:
        return self.collector.collect(self._published())

    def _follow_models(self, canaries: Canaries) -> Callable[[], None]:
        def changed() -> None:
            canaries.sync(self._published())

        return changed

    async def start(self, inference_server_url: str) -> None:
        """Start every part; `inference_server_url` is what direct mode registers (the bound
        UDP listener's quic:// URL, known only once it is up)."""
        if self._started:
            return
        self._started = True
        if self.canaries is not None:
            self._core.lifecycle.models.on_change(self._follow_models(self.canaries))
            self.canaries.sync(self._published())
        if self.tunnels is not None:
            self.tunnels.start()
        options = self.options.registration
        if options is None:
            return
        if not options.inference_server_url and inference_server_url:
            options = replace(options, inference_server_url=inference_server_url)
        self.registration = Registration(
            options,
            self.board,
            models=self._published,
            stats=self._stats,
            observer=self._observer,
        )
        if self._core.metrics is not None:  # per-gateway figures, read at scrape time
            self._core.metrics.gateway_report = self.report
        await self.registration.start()

    def report(self) -> dict[str, GatewayReport]:
        """Per registered gateway: the registration's figures, and in reverse mode the
        tunnel's (connections up, refusals by reason)."""
        if self.registration is None:
            return {}
        reports = self.registration.report()
        if self.tunnels is None:
            return reports
        return {
            key: replace(
                report,
                tunnels=self.board.tunnels(key),
                tunnel_refusals=self.tunnels.refusals_of(key),
            )
            for key, report in reports.items()
        }

    @property
    def in_progress(self) -> int:
        """Requests in flight on the reverse tunnels (the listeners count their own)."""
        return self.tunnels.in_progress if self.tunnels is not None else 0

    async def advertise_drain(self) -> None:
        """Advertise every model INACTIVE on every registration stream and await each
        gateway's ack of it (bounded by the registration's drain timeout), so the gateways
        stop choosing this node before it stops taking requests."""
        self.board.start_drain()
        if self.registration is not None:
            await self.registration.drain()

    async def drain_tunnels(self, grace: float) -> None:
        """The tunnels stop taking streams (GOAWAY) and finish what they carry, within
        `grace` s (run beside the listeners' own drain)."""
        if self.tunnels is not None:
            await self.tunnels.drain(grace)

    async def close(self) -> None:
        """End the tunnels (their requests are cancelled), the canaries and the streams."""
        closing = []
        if self.tunnels is not None:
            closing.append(self.tunnels.close())
        if self.canaries is not None:
            closing.append(self.canaries.aclose())
        if self.registration is not None:
            closing.append(self.registration.close())
        await asyncio.gather(*closing, return_exceptions=True)

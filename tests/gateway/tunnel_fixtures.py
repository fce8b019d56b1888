"""A pylon (the real core, `tests/stack.py`) whose reverse tunnels dial the stand-in gateway."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pylon.gateway.board import GatewayBoard, TunnelTarget
from pylon.gateway.raw_link import LINKS
from pylon.gateway.tunnel import ReverseTunnels, TunnelOptions, TunnelProtocol
from tests.gateway.stand_in_quic import StandInGateway
from tests.observers import EventObserver
from tests.stack import MODEL, Stack, StackFactory

GATEWAY = "gw-1:50051"  # the gateway's name on the board (its advertise address)
NODE = "node-1"
# The tunnel's stream layers, for `@pytest.mark.parametrize("protocol", PROTOCOLS)`.
PROTOCOLS: tuple[TunnelProtocol, ...] = ("http3", "raw-quic")


@dataclass
class Tunnel:
    stack: Stack
    gateway: StandInGateway
    board: GatewayBoard
    tunnels: ReverseTunnels
    events: EventObserver

    async def up(self, count: int = 1) -> None:
        """Until `count` connections are up on both sides (the gateway accepted them, and
        pylon read the acks)."""
        await self.gateway.wait_live(count)
        while self.tunnels.connected(GATEWAY) < count:
            # (no await between the check and the mark: no event can slip in between)
            await self.events.wait_for("tunnel_connected", after=self.events.mark())

    async def down(self) -> None:
        """Until pylon counts no connection up (each loss is a `tunnel_lost`)."""
        while self.tunnels.connected(GATEWAY) > 0:
            await self.events.wait_for("tunnel_lost", after=self.events.mark())

    def target(self, gateway: StandInGateway | None = None) -> TunnelTarget:
        address = (gateway or self.gateway).address
        return TunnelTarget(target=address, dial_addr=address)


TunnelFactory = Callable[..., Awaitable[Tunnel]]


def headers(request_id: str = "req-1", model: str = MODEL, **extra: str) -> list[tuple[str, str]]:
    return [("x-request-id", request_id), ("x-model", model), *extra.items()]


@pytest.fixture
async def make_tunnel(make_stack: StackFactory, tmp_path: Path) -> AsyncIterator[TunnelFactory]:
    """`await make_tunnel(stack_settings=..., gateway=..., protocol=..., **tunnel_options)`: a
    started pylon, a started stand-in, and `ReverseTunnels` (with both stream layers' links)
    following a board that names the stand-in. `protocol` is the tunnel's stream layer, for
    both sides: a stand-in made here speaks it, a given one must already (default: the given
    stand-in's, else http3)."""
    async with contextlib.AsyncExitStack() as exits:

        async def factory(
            stack_settings: dict[str, Any] | None = None,
            gateway: StandInGateway | None = None,
            start: bool = True,
            protocol: TunnelProtocol | None = None,
            **options: Any,
        ) -> Tunnel:
            stack = await make_stack(**{"quic_listen": None, **(stack_settings or {})})
            if gateway is None:
                folder = tmp_path / f"gw{len(list(tmp_path.iterdir()))}"
                folder.mkdir()
                gateway = StandInGateway(folder, protocol=protocol or "http3")
            elif protocol is not None and protocol != gateway.protocol:
                raise ValueError(f"the stand-in speaks {gateway.protocol}, not {protocol}")
            if gateway.port == 0:
                await gateway.start()
                exits.callback(gateway.close)
            defaults: dict[str, Any] = {
                "inference_server_id": NODE,
                "ca": gateway.ca_path,
                "connections": 1,
                "backoff_initial": 0.05,
                "backoff_max": 0.2,
                "keepalive": 0.5,
                "idle_timeout": 5.0,
                "retire_grace": 2.0,
                "protocol": gateway.protocol,
            }
            if options.get("insecure"):
                defaults.pop("ca")
            board = GatewayBoard(reverse=True)
            events = EventObserver()
            tunnels = ReverseTunnels(
                TunnelOptions(**{**defaults, **options}),
                board,
                stack.running.core.ingress,
                events,
                links=LINKS,
            )
            exits.push_async_callback(tunnels.close)
            tunnel = Tunnel(stack, gateway, board, tunnels, events)
            board.set_target(GATEWAY, tunnel.target())
            if start:
                tunnels.start()
            return tunnel

        yield factory

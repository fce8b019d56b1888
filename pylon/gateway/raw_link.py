"""The raw-QUIC stream layer as a reverse-tunnel link: `pylon.server.rawquic`'s connection
protocol under `pylon.gateway.tunnel.TunnelLinkBase` (the handshake stream, the QUIC-handshake
wait, the keepalive), so `ReverseTunnels` dials, handshakes and redials it exactly as the HTTP/3
link. `LINKS` is the table `ReverseTunnels(links=...)` takes: both protocols."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioquic.quic.connection import QuicConnection

from pylon.gateway.tunnel import (
    LINKS as HTTP3_LINKS,
)
from pylon.gateway.tunnel import (
    LinkFactory,
    TunnelLink,
    TunnelLinkBase,
    TunnelOptions,
    TunnelOwner,
)
from pylon.server.rawquic import RawQuicTunnelProtocol


class TunnelRawQuicProtocol(TunnelLinkBase, RawQuicTunnelProtocol):
    """A reverse tunnel's connection carrying raw-QUIC request streams (one Cap'n Proto
    message sequence per gateway-opened bidirectional stream), after the handshake."""

    def __init__(
        self, quic: QuicConnection, owner: TunnelOwner, options: TunnelOptions, **kwargs: Any
    ) -> None:
        # `options` is the tunnel's (TunnelLinkBase); the raw layer takes its defaults, its
        # caps coming from the intake's limits.
        super().__init__(quic, options=options, ingress=owner.ingress, **kwargs)

    def start_streams(self) -> None:
        """Nothing to start: the raw layer serves a stream from its first packet, and the
        gateway opens none before its accepting ack."""


def raw_quic_link(
    quic: QuicConnection, owner: TunnelOwner, options: TunnelOptions, kwargs: dict[str, Any]
) -> TunnelLink:
    return TunnelRawQuicProtocol(quic, owner, options, **kwargs)


LINKS: Mapping[str, LinkFactory] = {**HTTP3_LINKS, "raw-quic": raw_quic_link}

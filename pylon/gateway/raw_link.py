"""The raw-QUIC stream layer as a reverse-tunnel link: `pylon.server.rawquic`'s connection
protocol under `pylon.gateway.tunnel.TunnelLinkBase` (the handshake stream, the QUIC-handshake
wait, the keepalive), so `ReverseTunnels` dials, handshakes and redials it exactly as the HTTP/3
link. `LINKS` is the table `ReverseTunnels(links=...)` takes: both protocols."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import QuicEvent, StreamDataReceived

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
from pylon.server.rawquic import STOP_CANCELLED, RawQuicTunnelProtocol


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
        """Nothing to start: from the accepting ack on, the raw layer serves a stream from its
        first packet."""

    def quic_event_received(self, event: QuicEvent) -> None:
        # Before the accepting ack (or after a refusal) no request of the gateway's is taken:
        # it is reset and stopped at once, as the HTTP/3 link takes none before `start_http`.
        stream_id = getattr(event, "stream_id", None)
        if (
            not self._serving
            and stream_id is not None
            and stream_id & 0x1  # opened by the gateway (the QUIC server)
            and isinstance(event, StreamDataReceived)
        ):
            with contextlib.suppress(RuntimeError, ValueError):
                self._quic.reset_stream(stream_id, STOP_CANCELLED)
                self._quic.stop_stream(stream_id, STOP_CANCELLED)
            self.transmit()
            return
        super().quic_event_received(event)


def raw_quic_link(
    quic: QuicConnection, owner: TunnelOwner, options: TunnelOptions, kwargs: dict[str, Any]
) -> TunnelLink:
    return TunnelRawQuicProtocol(quic, owner, options, **kwargs)


LINKS: Mapping[str, LinkFactory] = {**HTTP3_LINKS, "raw-quic": raw_quic_link}

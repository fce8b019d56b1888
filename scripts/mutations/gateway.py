"""The gateway side (issue 19): the gateway's certificate verified on reverse tunnels, the
node's token presented on both channels, a model advertised INACTIVE while it cannot be served,
the drain telling the gateways first, and tunnelled requests going through the same intake."""

from __future__ import annotations

from mutations.anchors import Always, Never, ReplaceExpr, ReplaceStatements
from mutations.spec import Mutation

TUNNEL = "pylon/gateway/tunnel.py"
BOARD = "pylon/gateway/board.py"
REGISTRATION = "pylon/gateway/registration.py"
SIDE = "pylon/gateway/side.py"
RAW = "pylon/server/rawquic.py"

_DIAL_T = "tests/gateway/test_reverse_tunnel_dial.py"
_REG_T = "tests/gateway/test_registration.py"
_UNIT_T = "tests/unit/test_gateway_registration.py"
_E2E_T = "tests/gateway/test_gateway_e2e.py"
_TUNNEL_T = "tests/gateway/test_reverse_tunnel.py"
_RAW_T = "tests/transport/test_raw_quic_tunnel.py"
_RAW_UNIT_T = "tests/unit/test_rawquic.py"

MUTATIONS = [
    Mutation(
        "gateway trust",
        "the gateway's certificate is never verified on a reverse tunnel",
        Always(TUNNEL, "ReverseTunnels._configuration", "cadata is None"),
        {"core": (f"{_DIAL_T}::test_a_gateway_certificate_from_another_ca_is_refused",)},
    ),
    Mutation(
        "gateway token",
        "the registration stream presents no bearer token",
        Never(REGISTRATION, "_Stream._attempt", "token is not None"),
        {"core": (f"{_REG_T}::test_token_reread_on_reconnect",)},
    ),
    Mutation(
        "gateway token",
        "the tunnel handshake carries no token",
        ReplaceExpr(
            TUNNEL,
            "ReverseTunnels._connect_and_serve",
            "wire.Handshake(options.inference_server_id, self._token())",
            "wire.Handshake(options.inference_server_id, None)",
        ),
        {"core": (f"{_DIAL_T}::test_the_token_file_is_read_at_every_dial",)},
    ),
    Mutation(
        "advertised status",
        "a model whose canary fails stays ACTIVE",
        ReplaceExpr(
            BOARD,
            "GatewayBoard.status",
            "self._draining or not self.model_health(model).healthy",
            "self._draining",
        ),
        {
            "core": (
                f"{_UNIT_T}::test_status_gating",
                f"{_E2E_T}::test_a_failing_canary_advertises_the_model_inactive_and_back",
            )
        },
    ),
    Mutation(
        "advertised status",
        "a reverse node is ACTIVE at a gateway it has no tunnel to",
        Never(BOARD, "GatewayBoard.status", "self.reverse and not self.tunnel_connected(gateway)"),
        {
            "core": (
                f"{_UNIT_T}::test_status_gating",
                f"{_REG_T}::test_reverse_status_follows_tunnel_and_acks_set_target",
            )
        },
    ),
    Mutation(
        "drain",
        "the drain does not advertise INACTIVE before the tunnels stop",
        ReplaceStatements(
            SIDE,
            "GatewaySide.advertise_drain",
            "self.board.start_drain()\n"
            "if self.registration is not None:\n    await self.registration.drain()",
            "",
        ),
        {"core": (f"{_E2E_T}::test_drain_advertises_inactive_before_the_tunnel_closes",)},
    ),
    Mutation(
        "raw-QUIC limits",
        "a headers message over the header limit is read (not refused from its segment table)",
        Never(RAW, "RawQuicLayer._check_size", "size > self._max_header"),
        {"core": (f"{_RAW_UNIT_T}::test_oversized_headers_refused_at_the_segment_table",)},
    ),
    Mutation(
        "raw-QUIC limits",
        "a body message over its cap is taken",
        Never(RAW, "RawQuicLayer._message", "len(data) > self._max_body"),
        {"core": (f"{_RAW_UNIT_T}::test_body_message_over_its_cap_refused_413",)},
    ),
    Mutation(
        "raw-QUIC limits",
        "a map of any number of entries is taken",
        Never(RAW, "RawQuicLayer._fields", "len(message.fields) > self._max_entries"),
        {"core": (f"{_RAW_UNIT_T}::test_too_many_entries_431",)},
    ),
]

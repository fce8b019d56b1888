"""HTTP/3 and QUIC only: no 0-RTT, address validation, and QPACK without a dynamic table."""

from __future__ import annotations

from mutations.anchors import AddArguments, Never, ReplaceExpr
from mutations.spec import H3L_T, H3LAYER, HTTP3, QCA_T, QUIC_T, Mutation

RESET = "pylon/server/stateless_reset.py"
RESET_T = "tests/transport/test_quic_stateless_reset.py"
RESET_U = "tests/unit/test_stateless_reset.py"

# Tickets kept on the server object, so a resumed handshake (hence 0-RTT) can find them.
_TICKET_STORE = (
    "session_ticket_fetcher=self.__dict__.setdefault('_t', {}).pop, "
    "session_ticket_handler=lambda t: self.__dict__.setdefault('_t', {}).__setitem__(t.ticket, t)"
)

QUIC = [
    Mutation(
        "QUIC connection close",
        "client's CONNECTION_CLOSE cancels only when aioquic's draining period ends",
        Never(HTTP3, "Http3Protocol.datagram_received", "not self._gone and closing(self._quic)"),
        {
            "h3": (
                "tests/transport/test_http3_forwarding.py::"
                "test_a_client_close_reaches_the_engine_before_the_draining_period_ends",
            )
        },
    ),
    Mutation(
        "QUIC 0-RTT",
        "session tickets issued (resumption, hence replayable 0-RTT)",
        AddArguments(HTTP3, "Http3Server.start", "_ResettingQuicServer", _TICKET_STORE),
        {"h3": (f"{QCA_T}::test_quic_issues_no_session_ticket",)},
    ),
    Mutation(
        "QUIC address validation",
        "Retry disabled",
        ReplaceExpr(HTTP3, "Http3Server.start", "self.options.retry", "False"),
        {"h3": (f"{QUIC_T}::test_unvalidated_source_gets_at_most_three_times_its_bytes[True]",)},
    ),
    Mutation(
        "QUIC stateless reset",
        "a runt datagram answered (a reset loop between two endpoints)",
        ReplaceExpr(
            RESET, "short_header_cid", "len(datagram) < min_trigger_size(cid_length)", "False"
        ),
        {
            "h3": (
                f"{RESET_T}::test_a_single_process_resets_what_it_does_not_know[*]",
                f"{RESET_U}::test_what_is_never_answered",
            )
        },
    ),
    Mutation(
        "QUIC stateless reset",
        "a reset as long as its trigger (no shrinking loop, amplification)",
        ReplaceExpr(RESET, "build_reset", "trigger_size - 1", "trigger_size"),
        {
            "h3": (
                f"{RESET_U}::test_a_reset_is_shorter_than_its_trigger_and_never_below_the_minimum",
            )
        },
    ),
    Mutation(
        "QUIC stateless reset",
        "no flood budget",
        ReplaceExpr(
            HTTP3,
            "Http3Server.reset",
            "not self._reset_budget.take(asyncio.get_running_loop().time())",
            "False",
        ),
        {
            "h3": (
                f"{RESET_T}::test_a_flood_of_unknown_connections_gets_a_bounded_number_of_resets",
            )
        },
    ),
    Mutation(
        "QUIC stateless reset",
        "aioquic's random tokens kept (no other process can reset a connection)",
        ReplaceExpr(
            HTTP3, "Http3Protocol.__init__", "derive_reset_tokens(quic, reset_token)", "None"
        ),
        {"h3": (f"{RESET_T}::test_a_connection_of_a_dead_process_is_reset_at_once",)},
    ),
    Mutation(
        "QUIC stateless reset",
        "the token not keyed (anyone can forge a reset)",
        ReplaceExpr(
            RESET,
            "reset_token",
            "hmac.digest(key, cid, hashlib.sha256)",
            "hashlib.sha256(cid).digest()",
        ),
        {
            "h3": (
                f"{RESET_T}::test_a_reset_under_another_key_is_not_taken",
                f"{RESET_U}::test_the_token_is_the_rfc_keyed_hash_of_the_connection_id",
            )
        },
    ),
]

QPACK = [
    Mutation(
        "QPACK dynamic table refused",
        "decoder accepts a dynamic table",
        ReplaceExpr(
            H3LAYER, "H3Layer.__init__", "pylsqpack.Decoder(0, 0)", "pylsqpack.Decoder(4096, 16)"
        ),
        {"h3": (f"{H3L_T}::test_connection_error_closes_with_the_right_code[*]",)},
    ),
    Mutation(
        "QPACK dynamic table refused",
        "a dynamic table capacity advertised",
        ReplaceExpr(
            H3LAYER,
            "H3Layer._open_control_stream",
            "(Setting.QPACK_MAX_TABLE_CAPACITY, 0)",
            "(Setting.QPACK_MAX_TABLE_CAPACITY, 4096)",
        ),
        {"h3": (f"{H3L_T}::test_layer_settings_are_static_qpack_and_field_section_size_only",)},
    ),
]

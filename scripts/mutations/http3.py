"""HTTP/3 and QUIC only: no 0-RTT, address validation, and QPACK without a dynamic table."""

from __future__ import annotations

from mutations.anchors import AddArguments, Never, ReplaceExpr
from mutations.spec import H3L_T, H3LAYER, HTTP3, QCA_T, QUIC_T, Mutation

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

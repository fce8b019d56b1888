"""Floods and concurrency: rapid reset, the per-connection rate guards on frames that cost
work and carry no request progress, and the stream caps."""

from __future__ import annotations

from mutations.anchors import Never, ReplaceExpr, ReplaceStatements
from mutations.spec import (
    FLOOD,
    FLOODS_T,
    H2L_T,
    H3ISO_T,
    HTTP2,
    HTTP3,
    STREAMS,
    Mutation,
)

_H2_RAPID_RESET = f"{FLOODS_T}::test_h2_rapid_reset_gets_enhance_your_calm"
_H3_RAPID_RESET = f"{FLOODS_T}::test_h3_rapid_reset_closes_the_connection"
_CHEAP_FRAMES = f"{FLOODS_T}::test_h2_cheap_frame_floods_get_enhance_your_calm"
_CONTROL_HIT = "self._control.hit(self.loop.time())"

RAPID_RESET = [
    Mutation(
        "rapid reset",
        "StreamTable.peer_reset never trips",
        ReplaceStatements(
            STREAMS,
            "StreamTable.peer_reset",
            "return live and self._resets.hit(self._loop.time())",
            "return False",
        ),
        {"h2": (_H2_RAPID_RESET,), "h3": (_H3_RAPID_RESET,)},
    ),
    Mutation(
        "rapid reset",
        "ignored on HTTP/2",
        Never(HTTP2, "Http2Connection._on_reset", "self._table.peer_reset(sid)"),
        {"h2": (_H2_RAPID_RESET,)},
    ),
    Mutation(
        "rapid reset",
        "ignored on HTTP/3",
        # The reset still reaches the table (`and False`): only the guard's verdict is ignored.
        ReplaceExpr(
            HTTP3,
            "Http3Protocol._on_aborted",
            "self._table.peer_reset(sid)",
            "self._table.peer_reset(sid) and False",
        ),
        {"h3": (_H3_RAPID_RESET,)},
    ),
]

FLOOD_GUARDS = [
    Mutation(
        "flood guard",
        "RateGuard never trips",
        ReplaceStatements(
            FLOOD, "RateGuard.hit", "return self._count > self.limit", "return False"
        ),
        {
            "core": (f"{FLOODS_T}::test_rate_guard_trips_past_the_limit_and_resets_per_window",),
            "h2": (f"{FLOODS_T}::test_h2_ping_flood_gets_enhance_your_calm",),
            "h3": (_H3_RAPID_RESET,),
        },
    ),
    Mutation(
        "flood guard",
        "HTTP/2 PING flood not counted",
        Never(
            HTTP2,
            "Http2Connection._handle_event",
            _CONTROL_HIT,
            under="isinstance(event, PingReceived)",
        ),
        {"h2": (f"{FLOODS_T}::test_h2_ping_flood_gets_enhance_your_calm",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 SETTINGS flood not counted",
        Never(
            HTTP2,
            "Http2Connection._handle_event",
            _CONTROL_HIT,
            under="isinstance(event, RemoteSettingsChanged)",
        ),
        {"h2": (f"{FLOODS_T}::test_h2_settings_flood_gets_enhance_your_calm",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 refused-stream flood not counted",
        Never(HTTP2, "Http2Connection._on_request", "self._refused.hit(self.loop.time())"),
        {"h2": (f"{FLOODS_T}::test_h2_refused_stream_flood_gets_enhance_your_calm",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 empty DATA flood not counted",
        Never(
            HTTP2,
            "Http2Connection._on_data",
            "not event.data and event.stream_ended is None and self._empty.hit(self.loop.time())",
        ),
        {"h2": (f"{_CHEAP_FRAMES}[empty_data]",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 PRIORITY and unknown-frame flood not counted",
        Never(
            HTTP2,
            "Http2Connection._handle_event",
            _CONTROL_HIT,
            under="isinstance(event, PriorityUpdated | UnknownFrameReceived)",
        ),
        {"h2": (f"{_CHEAP_FRAMES}[priority]",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 WINDOW_UPDATE flood not counted",
        Never(
            HTTP2,
            "Http2Connection._handle_event",
            "self._window_updates > 2 * self._data_frames_sent + _WINDOW_UPDATE_ALLOWANCE",
        ),
        {"h2": (f"{_CHEAP_FRAMES}[window_update]",)},
    ),
]

CONCURRENCY_CAPS = [
    Mutation(
        "concurrency cap",
        "HTTP/2 streams above the cap not refused",
        Never(
            HTTP2, "Http2Connection._on_request", "len(self._streams) >= self._limits.max_streams"
        ),
        {"h2": (f"{H2L_T}::test_streams_past_the_concurrency_limit_are_refused",)},
    ),
    Mutation(
        "concurrency cap",
        "QUIC stream credit not limited (limit_peer_bidi_streams)",
        ReplaceStatements(
            HTTP3,
            "Http3Protocol.__init__",
            "limit_peer_bidi_streams(quic, self._limits.max_quic_streams)",
            "",
        ),
        {"h3": (f"{H3ISO_T}::test_concurrent_streams_are_capped_by_quic_max_streams",)},
    ),
]

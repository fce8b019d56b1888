"""The HTTP/2 tests again, on the ngh2 codec (`--http2-codec ngh2`), and what differs on it.

The tests imported below run here with every stack on ngh2 (this module's `make_stack`); the
whole HTTP/2 suite can also run on it with PYLON_HTTP2_CODEC=ngh2 in the environment, where the
tests of pylon's 400 for a malformed header block fail by design (docs/ngh2-notes.md): nghttp2
resets such a stream itself, and the tests at the end of this module pin that instead.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from h2.errors import ErrorCodes

pytest.importorskip("ngh2")

from pylon.listeners import select_codec
from pylon.server.http2 import Http2Connection
from pylon.server.http2_ngh2 import Ngh2Connection
from pylon.startup import StartupError
from tests.stack import StackFactory
from tests.stack import make_stack as _plain_make_stack  # noqa: F401
from tests.transport.h2client import H2Client, request_headers
from tests.transport.test_drain import (  # noqa: F401
    test_h2_drain_sends_goaway_and_refuses_new_streams,
)
from tests.transport.test_floods import (  # noqa: F401
    test_h2_cheap_frame_floods_get_enhance_your_calm,
    test_h2_normal_cancellations_below_the_limit_keep_the_connection,
    test_h2_ping_flood_gets_enhance_your_calm,
    test_h2_rapid_reset_gets_enhance_your_calm,
    test_h2_refused_stream_flood_gets_enhance_your_calm,
    test_h2_settings_flood_gets_enhance_your_calm,
    test_h2_streams_over_the_limit_are_refused_and_the_connection_lives,
)
from tests.transport.test_http2 import (  # noqa: F401
    client,
    test_client_goaway_mid_response_ends_streams_cleanly,
    test_connection_loss_cancels_every_stream,
    test_contract_error_is_400_and_never_forwarded,
    test_health_and_head,
    test_many_streams_on_one_connection,
    test_nghttp_independent_client,
    test_response_respects_the_peer_flow_control_window,
    test_rst_stream_cancels_the_engine_request_promptly,
    test_sse_arrives_event_by_event,
    test_strip_and_derive,
)
from tests.transport.test_http2_limits import (  # noqa: F401
    BASE,
    BODY,
    MALFORMED,
    Pair,
    h2_pair,
    test_busy_stream_outlives_the_idle_timeout,
    test_connection_silent_after_its_preface_is_closed_after_the_header_timeout,
    test_contract_error_is_400_at_headers,
    test_declared_body_over_limit_is_413_at_headers,
    test_header_bytes_over_limit_is_431,
    test_idle_connection_gets_goaway,
    test_silent_connection_is_closed_after_the_header_timeout,
    test_stalled_request_body_is_408_on_that_stream_only,
    test_streamed_body_over_limit_is_413,
    test_streams_past_the_concurrency_limit_are_refused,
    test_te_trailers_is_accepted_and_not_forwarded,
    test_too_many_headers_is_431,
)
from tests.transport.test_http2_tls import (  # noqa: F401
    test_alpn_selects_the_protocol,
    test_tls_without_alpn_still_sniffs_the_preface,
)
from tests.transport.test_loop_fairness import (  # noqa: F401
    h2_reads,
    test_http2_a_body_in_one_byte_data_frames_is_parsed_a_piece_per_turn,
    test_http2_a_ping_flood_in_one_write_trips_the_guard_within_a_piece,
)
from tests.transport.test_send_timeout import (  # noqa: F401
    test_h2_client_that_never_opens_its_window,
)


@pytest.fixture
async def make_stack(
    _plain_make_stack: StackFactory,  # noqa: F811 (the imported fixture)
) -> AsyncIterator[StackFactory]:
    """Every stack of this module serves HTTP/2 with ngh2."""

    async def factory(*args: Any, **settings: Any) -> Any:
        stack = await _plain_make_stack(*args, **{"http2_codec": "ngh2", **settings})
        assert stack.running.listeners.http2_codec == "ngh2"
        return stack

    yield factory


def test_codec_choice() -> None:
    assert select_codec("h2") == (Http2Connection, None)
    assert select_codec("ngh2") == (Ngh2Connection, None)
    assert select_codec("auto") == (Ngh2Connection, None)


@pytest.mark.interpreted
def test_without_ngh2_auto_is_h2_and_an_explicit_ngh2_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "ngh2", None)  # `import ngh2` raises ImportError
    monkeypatch.delitem(sys.modules, "pylon.server.http2_ngh2")
    chosen, why = select_codec("auto")
    assert chosen is Http2Connection and why is not None and "ngh2" in why
    with pytest.raises(StartupError, match="--http2-codec ngh2"):
        select_codec("ngh2")


# --- what differs on ngh2 ---


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_header_block_is_reset_or_400_on_that_stream_only(
    h2_pair: Callable[..., Awaitable[Pair]],  # noqa: F811  (the fixture, by name)
    case: str,
) -> None:
    """nghttp2's own checks reset what they catch with PROTOCOL_ERROR before pylon sees it; what
    they let through, pylon's checks answer with its 400. Either way: that stream only, and
    nothing reaches the engine."""
    pair = await h2_pair()
    reply = await pair.client.response(pair.client.send(MALFORMED[case], BODY))
    if reply.status is None:
        assert reply.reset_code == ErrorCodes.PROTOCOL_ERROR
    else:
        assert reply.status == 400
        assert reply.json()["code"] == "malformed_request"
    await pair.check_isolated()


@pytest.mark.parametrize("declared", [b"100", b"2"])
async def test_content_length_differing_from_data_resets_that_stream_only(
    h2_pair: Callable[..., Awaitable[Pair]],  # noqa: F811  (the fixture, by name)
    declared: bytes,
) -> None:
    pair = await h2_pair()
    reply = await pair.client.response(
        pair.client.send([*BASE, (b"content-length", declared)], BODY)
    )
    assert reply.status is None and reply.reset_code == ErrorCodes.PROTOCOL_ERROR
    await pair.check_isolated()


async def test_hpack_bomb_past_the_hard_cap_is_a_connection_error(make_stack: StackFactory) -> None:
    """The connection goes, nothing is forwarded; nghttp2 may say COMPRESSION_ERROR (its decoded
    list cap) where pylon's scan of the compressed block says ENHANCE_YOUR_CALM."""
    stack = await make_stack("dynamo", max_header_bytes=2048)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        h2.send([*BASE, (b"x-huge", b"v" * 200_000)], BODY)
        async with asyncio.timeout(5):
            await h2.closed.wait()
        assert h2.terminated is not None
        assert h2.terminated.error_code in (
            ErrorCodes.ENHANCE_YOUR_CALM,
            ErrorCodes.COMPRESSION_ERROR,
        )
        assert (await stack.control())["requests"] == []
    finally:
        await h2.close()


async def test_a_response_before_the_whole_body_ends_before_its_no_error_reset(
    make_stack: StackFactory,
) -> None:
    """nghttp2 sends a RST_STREAM ahead of DATA still queued (and drops that DATA): pylon takes
    the framed response first, so a 413 at HEADERS arrives whole, then NO_ERROR (RFC 9113 8.1)."""
    stack = await make_stack("dynamo", max_body_bytes=1000)
    h2 = await H2Client.connect(stack.pylon_address)
    try:
        sid = h2.send([*request_headers(request_id="big"), (b"content-length", b"5000")], end=False)
        reply = await h2.response(sid)
        assert reply.status == 413
        assert reply.json()["code"] == "body_too_large"
        assert reply.reset_code in (None, ErrorCodes.NO_ERROR)
    finally:
        await h2.close()

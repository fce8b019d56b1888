"""Canary for what `pylon.server.http2_ngh2` relies on in ngh2 (pinned exactly in pyproject):
each check runs the real codec in memory against an h2 client, and names what changed.

An upgrade that fails here needs the adapter read again before the pin moves."""

from __future__ import annotations

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, ResponseReceived, StreamReset
from h2.settings import SettingCodes, Settings
from hyperframe.frame import PriorityFrame

ngh2 = pytest.importorskip("ngh2")

from pylon.server.http2_ngh2 import FrameScan, check_codec  # noqa: E402

HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/x"), (b":authority", b"a")]


def pair(settings: dict[int, int] | None = None) -> tuple[ngh2.Connection, H2Connection]:
    server = ngh2.Connection(ngh2.Role.SERVER)
    server.initiate_connection(settings or {})
    client = H2Connection(
        H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
    )
    client.initiate_connection()
    for _ in range(2):
        server.receive_data(client.data_to_send())
        client.receive_data(server.data_to_send())
    server.events()
    return server, client


def names(events: list[object]) -> list[str]:
    return [type(event).__name__ for event in events]


def test_the_version_is_the_pinned_one() -> None:
    assert ngh2.__version__ == "0.3.0", "read pylon/server/http2_ngh2.py again, then move the pin"


def test_the_start_check_passes() -> None:
    check_codec()  # the first SETTINGS frame is exactly pack_settings_payload of what it was told


def test_untold_it_enforces_no_stream_limit() -> None:
    """pylon refuses streams past its advertised limit itself (REFUSED_STREAM)."""
    server, client = pair()
    client.remote_settings = Settings(
        client=False, initial_values={SettingCodes.MAX_CONCURRENT_STREAMS: 2**31 - 1}
    )
    for i in range(200):
        client.send_headers(1 + 2 * i, HEADERS, end_stream=True)
    server.receive_data(client.data_to_send())
    assert names(server.events()) == ["RequestReceived"] * 200
    assert not [e for e in client.receive_data(server.data_to_send()) if isinstance(e, StreamReset)]


def test_request_data_and_trailer_events_carry_what_the_adapter_reads() -> None:
    server, client = pair()
    client.send_headers(1, [*HEADERS, (b"x-a", b"1")])
    client.send_data(1, b"body")
    client.send_headers(1, [(b"x-trailer", b"t")], end_stream=True)
    server.receive_data(client.data_to_send())
    request, data, trailers = server.events()
    assert isinstance(request, ngh2.RequestReceived) and request.stream_id == 1
    assert (b"x-a", b"1") in [tuple(field) for field in request.headers]
    assert request.end_stream is False
    assert isinstance(data, ngh2.DataReceived) and (data.data, data.end_stream) == (b"body", False)
    assert isinstance(trailers, ngh2.TrailersReceived)  # no separate end event: trailers end it
    assert [tuple(field) for field in trailers.headers] == [(b"x-trailer", b"t")]


def test_windows_count_queued_data_only_once_framed() -> None:
    """`_send_room` subtracts queued_body_size from the windows: sent, not yet framed."""
    server, client = pair()
    client.send_headers(1, HEADERS, end_stream=True)
    server.receive_data(client.data_to_send())
    server.events()
    window = server.stream_remote_window_size(1)
    server.send_response(1, [(b":status", b"200")])
    server.send_data(1, b"x" * 1000)
    assert (server.stream_remote_window_size(1), server.queued_body_size(1)) == (window, 1000)
    assert server.queued_body_size() == 1000
    server.data_to_send()
    assert (server.stream_remote_window_size(1), server.queued_body_size(1)) == (window - 1000, 0)
    assert server.remote_window_size == 65535 - 1000


def test_a_reset_goes_ahead_of_queued_data_unless_that_was_framed_first() -> None:
    """Why the adapter takes data_to_send() before reset_stream and terminate_connection."""
    server, client = pair()
    client.send_headers(1, HEADERS, end_stream=False)
    client.send_headers(3, HEADERS, end_stream=False)
    server.receive_data(client.data_to_send())
    server.events()
    for sid in (1, 3):
        server.send_response(sid, [(b":status", b"200")])
        server.send_data(sid, b"whole", end_stream=True)
    server.reset_stream(1, 0)  # not sealed: the response is lost
    sealed = server.data_to_send()
    server.reset_stream(3, 0)
    events = client.receive_data(sealed + server.data_to_send())
    by_stream = {
        sid: names([e for e in events if getattr(e, "stream_id", None) == sid]) for sid in (1, 3)
    }
    assert by_stream[1] == ["StreamReset"], by_stream
    assert by_stream[3][:2] == ["ResponseReceived", "DataReceived"], by_stream
    assert [e for e in events if isinstance(e, DataReceived)][-1].data == b"whole"
    assert any(isinstance(e, ResponseReceived) for e in events)


def test_a_malformed_header_block_is_reset_by_the_codec_with_no_request_event() -> None:
    """nghttp2 checks HTTP messaging itself and ngh2 has no switch for it. If one appears, use
    it: pylon's own checks then answer 400, as on h2."""
    assert "no_http_messaging" not in ngh2.Configuration.__dataclass_fields__
    server, client = pair()
    client.send_headers(1, [*HEADERS, (b"X-Upper", b"1")], end_stream=True)
    server.receive_data(client.data_to_send())
    assert server.events() == []
    resets = [e for e in client.receive_data(server.data_to_send()) if isinstance(e, StreamReset)]
    assert [(r.stream_id, r.error_code) for r in resets] == [(1, 1)]  # PROTOCOL_ERROR
    closed = server.events()
    assert [(type(e), e.stream_id, e.error_code) for e in closed] == [(ngh2.StreamClosed, 1, 1)]


def test_priority_and_extension_frames_carry_no_event_so_the_scan_counts_them() -> None:
    server, _ = pair()
    priority = PriorityFrame(3, depends_on=0, stream_weight=16).serialize()
    unknown = b"\x00\x00\x01\xfa\x00\x00\x00\x00\x00x"
    server.receive_data(priority * 3 + unknown * 2)
    assert server.events() == []
    scan = FrameScan()
    scan.skip = 0
    data = priority * 3 + unknown * 2
    assert scan.feed(data[:5]) + scan.feed(data[5:20]) + scan.feed(data[20:]) == 5


def test_a_codec_ended_connection_stops_wanting_to_read() -> None:
    """The adapter's signal that nghttp2 closed the connection on its own (its GOAWAY queued)."""
    server, client = pair()
    assert server.want_read
    server.receive_data(b"\x00\x00\x08\x06\x00\x00\x00\x00\x01" + bytes(8))  # PING on a stream
    out = server.data_to_send()
    assert not server.want_read and not server.want_write
    assert [type(e) for e in server.events()] == [ngh2.ConnectionClosed]
    terminated = [e for e in client.receive_data(out) if isinstance(e, ConnectionTerminated)]
    assert terminated and terminated[0].error_code == 1

"""HTTP/2 on `ngh2` (libnghttp2 through Cython), the second codec behind `Http2Connection`.

`--http2-codec ngh2` (or `auto` where `import ngh2` works): the same connection logic as
`pylon.server.http2` (its streams, limits, flood guards, shutdown), with libnghttp2 framing
and HPACK instead of the pure-Python h2, which costs most of an HTTP/2 request's CPU.

What nghttp2 does differently, and what pylon does about it (docs/ngh2-notes.md):
- It checks HTTP messaging itself and ngh2 offers no way to turn that off: a malformed header
  block (uppercase name, connection-specific field, CR/LF in a value, bad pseudo-headers) or a
  body that disagrees with its content-length is reset with PROTOCOL_ERROR before pylon sees
  it, so such a stream gets RST_STREAM, not pylon's 400 problem. Still a stream error, never
  the connection's; pylon logs it (`stream_malformed`) when the codec says so.
- It would enforce our SETTINGS_MAX_CONCURRENT_STREAMS as a connection error. nghttp2 is told
  no stream limit, and the SETTINGS frame on the wire is pylon's own with the limit in it
  (`_advertise`): pylon refuses a stream over it with REFUSED_STREAM and counts it, as on h2.
- It reports no event for PRIORITY or extension frames: pylon reads the frame headers ahead of
  the codec (`FrameScan`, nine bytes a frame) and counts those in the control-frame guard. The
  same scan bounds a header block's size (the hard HPACK cap) before nghttp2 decodes it.
- A RST_STREAM it queues goes before DATA still queued for that stream: pylon takes what the
  codec has framed before it asks for a reset (`_reset_quietly`), so a complete response is
  never cut off by the NO_ERROR reset that follows it (RFC 9113 8.1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import ClassVar

import ngh2
from ngh2 import (
    ConnectionClosed,
    DataReceived,
    GoAwayReceived,
    NGH2Error,
    PingReceived,
    RequestReceived,
    Setting,
    SettingsReceived,
    StreamClosed,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)

from pylon.server.http2 import _WINDOW_UPDATE_ALLOWANCE, PREFACE, Http2Connection, KiB

_PROTOCOL_ERROR = 0x1
_ENHANCE_YOUR_CALM = 0xB
_SETTINGS = 0x4
_PRIORITY = 0x2
_HEADERS = 0x1
_CONTINUATION = 0x9
_LAST_CORE_TYPE = 0x9  # types above are extensions (RFC 9113 5.5), PRIORITY_UPDATE included


class FrameScan:
    """The frame headers of what the client sends, read ahead of the codec.

    Counts the frames nghttp2 takes without an event (PRIORITY, extension types) and sizes the
    header block in progress (HEADERS and its CONTINUATIONs, still compressed). Keeps only its
    place in the stream between reads: the bytes of the frame it is inside and a header split
    across two reads (at most 8 bytes)."""

    __slots__ = ("block", "partial", "skip")

    def __init__(self) -> None:
        self.skip = len(PREFACE)  # payload bytes still to pass over (first, the preface)
        self.partial = b""  # a frame header cut by the end of the last read
        self.block = 0  # bytes of the latest header block

    def feed(self, data: bytes) -> int:
        """Frames in `data` that carry no event from the codec."""
        if self.partial:
            data = self.partial + data
            self.partial = b""
        end = len(data)
        at = self.skip
        cheap = 0
        while at + 9 <= end:
            length = (data[at] << 16) | (data[at + 1] << 8) | data[at + 2]
            kind = data[at + 3]
            if kind == _HEADERS:
                self.block = length
            elif kind == _CONTINUATION:
                self.block += length
            elif kind == _PRIORITY or kind > _LAST_CORE_TYPE:
                cheap += 1
            at += 9 + length
        if at >= end:
            self.skip = at - end
        else:
            self.skip = 0
            self.partial = data[at:]
        return cheap


def _settings_frame(settings: Mapping[int, int]) -> bytes:
    payload = ngh2.pack_settings_payload(settings)
    return len(payload).to_bytes(3, "big") + bytes((_SETTINGS, 0)) + bytes(4) + payload


class Ngh2Connection(Http2Connection):
    codec: ClassVar[str] = "ngh2"
    _SEND_ERRORS: ClassVar[tuple[type[Exception], ...]] = (NGH2Error,)

    def _init_codec(self) -> None:
        limits = self._limits
        # The same hard cap as on h2: above it a header block is a connection error; below it
        # pylon answers a block over --max-header-bytes with 431, on that stream.
        self._hard_headers = max(64 * KiB, 2 * (limits.max_header_bytes + 32 * limits.max_headers))
        self._ng = ngh2.Connection(
            ngh2.Role.SERVER,
            ngh2.Configuration(
                max_inbound_header_list_size=self._hard_headers,
                # Every field costs at least 32 bytes of the list size: the size cap binds first.
                max_inbound_header_count=self._hard_headers // 32 + 1,
                # A block up to the hard cap in frames of 4 KiB or more.
                max_continuations=max(8, self._hard_headers // (4 * KiB)),
            ),
        )
        self._scan = FrameScan()
        self._sealed: list[bytes] = []  # framed before a reset, written ahead of what follows
        self._highest = 0  # the highest request stream id seen
        self._max_frame = 16384  # the peer's SETTINGS_MAX_FRAME_SIZE

    # --- setup ---
    def _start_h2(self) -> None:
        limits = self._limits
        told: dict[int, int] = {
            Setting.MAX_HEADER_LIST_SIZE: limits.max_header_bytes,
            Setting.INITIAL_WINDOW_SIZE: limits.h2_stream_window,
        }
        ng = self._ng
        ng.initiate_connection(told)
        # nghttp2 would make a stream past SETTINGS_MAX_CONCURRENT_STREAMS a connection error;
        # told none, it leaves the limit to pylon, and the client reads it in our frame.
        advertised: dict[int, int] = {Setting.MAX_CONCURRENT_STREAMS: limits.max_streams, **told}
        self._sealed.append(_advertise(ng.data_to_send(), told, advertised))
        if 4 * limits.h2_stream_window > 65535:
            # Request bodies are buffered whole (bounded by max_body): a wide connection window.
            ng.set_local_window_size(4 * limits.h2_stream_window)

    # --- input ---
    def _receive(self, data: bytes) -> None:
        cheap = self._scan.feed(data)
        if cheap:
            now = self.loop.time()
            for _ in range(cheap):
                if self._control.hit(now):
                    self._enhance_your_calm("control_frame_flood")
                    return
        if self._scan.block > self._hard_headers:
            self._observer.transport_event(
                "h2_connection_error",
                "h2",
                detail=f"header block over {self._hard_headers} bytes",
            )
            self._enhance_your_calm("header_block_too_large")
            return
        try:
            self._ng.receive_data(data)
        except NGH2Error as exc:
            self._observer.transport_event("h2_connection_error", "h2", detail=str(exc)[:200])
            self._shutdown()
            return
        for event in self._ng.events():
            self._handle_ng_event(event)
            if self._closed:
                return
        self._schedule_flush()

    def _handle_ng_event(self, event: object) -> None:
        if isinstance(event, DataReceived):
            sid = event.stream_id
            ended = event.end_stream
            if not event.data and not ended and self._empty.hit(self.loop.time()):
                self._enhance_your_calm("empty_frame_flood")  # CVE-2019-9518
                return
            self._table.data(sid, event.data, ended=False)
            if ended:
                self._on_end(sid)
        elif isinstance(event, RequestReceived):
            sid = event.stream_id
            if sid > self._highest:
                self._highest = sid
            self._on_request(sid, event.headers, event.end_stream)
        elif isinstance(event, WindowUpdated):
            self._window_updates += 1
            if self._window_updates > 2 * self._data_frames_sent + _WINDOW_UPDATE_ALLOWANCE:
                self._enhance_your_calm("window_update_flood")
                return
            self._on_window(event.stream_id)
        elif isinstance(event, StreamReset):
            self._on_reset(event.stream_id)
        elif isinstance(event, StreamClosed):
            self._on_closed(event.stream_id, event.error_code)
        elif isinstance(event, TrailersReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.trailers = list(event.headers)
            self._on_end(event.stream_id)  # trailers end the stream
        elif isinstance(event, PingReceived):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("ping_flood")
        elif isinstance(event, SettingsReceived):
            if self._control.hit(self.loop.time()):
                self._enhance_your_calm("settings_flood")
                return
            self._max_frame = self._ng.remote_settings.get(Setting.MAX_FRAME_SIZE, 16384)
            self._on_window(0)
        elif isinstance(event, GoAwayReceived):
            self._shutdown()
        elif isinstance(event, ConnectionClosed):
            self._codec_closed(event.error_code)
        # SettingsAcknowledged, PingAcknowledged, PriorityUpdateReceived (counted by the scan),
        # AltSvcReceived, OriginReceived: nothing to do.

    def _on_closed(self, sid: int, error_code: int) -> None:
        """nghttp2 closed a stream. Ours to finish still: the codec reset it (a body over its
        content-length); one pylon never saw: its header block failed the codec's checks."""
        stream = self._streams.pop(sid, None)
        if stream is None and not (error_code == _PROTOCOL_ERROR and sid > self._highest):
            return  # done with, or reset by us or by the client
        self._observer.transport_event(
            "stream_malformed",
            "h2",
            stream_id=sid,
            request_id=self._table.request_id(sid),
            detail=f"reset by the HTTP/2 codec (error code {error_code})",
        )
        if stream is not None:
            self._cancel(stream)
            self._table.cancel(sid, "stream_error")
            self._maybe_idle()

    def _codec_closed(self, error_code: int | None) -> None:
        """nghttp2 ended the connection itself (it has queued its GOAWAY)."""
        if self._closed:
            return
        self._observer.transport_event(
            "h2_connection_error",
            "h2",
            detail=f"closed by the HTTP/2 codec (error code {error_code})",
        )
        self._shutdown()

    def _codec_done(self) -> None:
        code = None
        for event in self._ng.events():
            if isinstance(event, ConnectionClosed):
                code = event.error_code
        self._codec_closed(code)

    # --- output ---
    def _send_room(self, stream_id: int) -> int:
        ng = self._ng
        try:
            stream_room = ng.stream_remote_window_size(stream_id) - ng.queued_body_size(stream_id)
            connection_room = ng.remote_window_size - ng.queued_body_size()
        except NGH2Error:
            return 0  # closed at the codec's level; its event is on the way
        return min(stream_room, connection_room, self._max_frame)

    def _send_data(self, stream_id: int, chunk: bytes, end: bool) -> None:
        self._ng.send_data(stream_id, chunk, end_stream=end)

    def _send_end(self, stream_id: int) -> None:
        self._ng.end_stream(stream_id)

    def _submit_head(self, stream_id: int, fields: list[tuple[bytes, bytes]]) -> None:
        self._ng.send_response(stream_id, fields)

    def _reset_quietly(self, stream_id: int, code: int) -> None:
        if self._closed:
            return
        self._seal()  # nghttp2 would send the RST_STREAM ahead of these, and drop the rest
        with contextlib.suppress(NGH2Error):
            self._ng.reset_stream(stream_id, code)

    def _terminate(self, error_code: int = 0, last_stream_id: int | None = None) -> None:
        self._seal()  # nghttp2 sends nothing queued after its final GOAWAY
        with contextlib.suppress(NGH2Error):  # already ended by the codec: its GOAWAY is out
            self._ng.terminate_connection(error_code, last_stream_id=last_stream_id)

    def _seal(self) -> None:
        """Take what the codec has framed so far: written ahead of what it frames next."""
        framed = self._ng.data_to_send()
        if framed:
            self._sealed.append(framed)

    def _highest_inbound(self) -> int:
        return self._highest

    def _output(self) -> bytes:
        ng = self._ng
        data = ng.data_to_send()
        if self._sealed:
            self._sealed.append(data)
            data = b"".join(self._sealed)
            self._sealed.clear()
        if not self._closed and not ng.want_read and not ng.want_write:
            self.loop.call_soon(self._codec_done)
        return data


def _advertise(frame: bytes, told: Mapping[int, int], advertised: Mapping[int, int]) -> bytes:
    """nghttp2's first SETTINGS frame, rewritten to carry the `advertised` settings."""
    if frame != _settings_frame(told):
        raise RuntimeError(
            f"ngh2 {ngh2.__version__}: the server's first SETTINGS frame is not the one pylon"
            " expects; the HTTP/2 codec cannot be used (--http2-codec h2)"
        )
    return _settings_frame(advertised)


_USED = (
    "data_to_send",
    "end_stream",
    "events",
    "initiate_connection",
    "queued_body_size",
    "receive_data",
    "remote_settings",
    "remote_window_size",
    "reset_stream",
    "send_data",
    "send_response",
    "set_local_window_size",
    "stream_remote_window_size",
    "terminate_connection",
    "want_read",
    "want_write",
)


def check_codec() -> None:
    """What `Ngh2Connection` relies on, run once at start: raises RuntimeError if it changed."""
    missing = [name for name in _USED if not hasattr(ngh2.Connection, name)]
    if missing:
        raise RuntimeError(f"ngh2 {ngh2.__version__}: no Connection.{', '.join(missing)}")
    told: dict[int, int] = {
        Setting.MAX_HEADER_LIST_SIZE: 16384,
        Setting.INITIAL_WINDOW_SIZE: 1 << 20,
    }
    ng = ngh2.Connection(ngh2.Role.SERVER)
    ng.initiate_connection(told)
    _advertise(ng.data_to_send(), told, told)

"""HTTP/2: the streams and receive window one client connection gets."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pylon.settings.topics import HTTP2, MiB, group


class Http2Settings(BaseModel):
    """The `HTTP/2` topic."""

    h2_max_concurrent_streams: int = Field(
        128,
        ge=1,
        le=4096,
        description="concurrent request streams per HTTP/2 connection",
        json_schema_extra=group(HTTP2),
    )
    h2_stream_window: int = Field(
        1 * MiB,
        ge=65535,
        le=2**31 - 1,
        description="HTTP/2 per-stream receive window (bytes)",
        json_schema_extra=group(HTTP2, "BYTES"),
    )
    http2_codec: Literal["auto", "ngh2", "h2"] = Field(
        "h2",
        description="HTTP/2 framing and HPACK: h2 (pure Python), ngh2 (libnghttp2; refuses to"
        " start without it) or auto (ngh2 where it imports, else h2; the listening line says)",
        json_schema_extra=group(HTTP2),
    )

"""HTTP/3 / QUIC: the QUIC listener's idle timeout, receive windows, streams and Retry."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pylon.settings.topics import QUIC, KiB, MiB, group


class QuicSettings(BaseModel):
    """The `HTTP/3 / QUIC` topic (its listen address is a `Listeners` setting)."""

    quic_idle_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds without packets before a QUIC connection is closed",
        json_schema_extra=group(QUIC),
    )
    quic_max_data: int = Field(
        16 * MiB,
        ge=64 * KiB,
        description="QUIC connection receive window (bytes)",
        json_schema_extra=group(QUIC, "BYTES"),
    )
    quic_max_stream_data: int = Field(
        4 * MiB,
        ge=16 * KiB,
        description="QUIC per-stream receive window (bytes)",
        json_schema_extra=group(QUIC, "BYTES"),
    )
    quic_max_concurrent_streams: int = Field(
        128,
        ge=1,
        le=4096,
        description="concurrent request streams per QUIC connection",
        json_schema_extra=group(QUIC),
    )
    quic_retry: bool = Field(
        True,
        description="validate client addresses with a QUIC Retry before any handshake",
        json_schema_extra=group(QUIC),
    )

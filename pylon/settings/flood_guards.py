"""Flood guards: how many stream resets and control frames a client connection may send per
window (HTTP/2 and HTTP/3)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pylon.settings.topics import FLOODS, group


class FloodGuardSettings(BaseModel):
    """The `Flood guards` topic."""

    flood_window: float = Field(
        10.0, gt=0, description="seconds per flood-guard window", json_schema_extra=group(FLOODS)
    )
    max_stream_resets: int = Field(
        1000,
        ge=0,
        description="client stream resets per window per connection (0 = no limit)",
        json_schema_extra=group(FLOODS),
    )
    max_control_frames: int = Field(
        200,
        ge=0,
        description="client PING/SETTINGS frames per window per h2 connection (0 = off)",
        json_schema_extra=group(FLOODS),
    )

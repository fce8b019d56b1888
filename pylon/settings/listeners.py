"""Listeners: the addresses pylon accepts clients on (TCP, QUIC) and its admin listener."""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, Field, field_validator

from pylon.settings.topics import LISTENERS, group


def split_host_port(value: str) -> tuple[str, int]:
    """`HOST:PORT` or `[IPv6]:PORT` -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"not an IPv6 address in brackets: {value!r}") from None
    return host, port


class ListenerSettings(BaseModel):
    """The `Listeners` topic: every address is `HOST:PORT` or `[IPv6]:PORT`."""

    listen: str = Field(
        "127.0.0.1:8080",
        description="TCP listen address (HTTP/1.1 and HTTP/2)",
        json_schema_extra=group(LISTENERS, "HOST:PORT"),
    )
    quic_listen: str | None = Field(
        None,
        description="UDP listen address for HTTP/3; unset = no QUIC listener",
        json_schema_extra=group(LISTENERS, "HOST:PORT"),
    )
    admin_listen: str = Field(
        "127.0.0.1:9089",
        description="plain-HTTP admin listener: /metrics, /live, /ready (no tunnel auth); "
        "empty = no admin listener and no metrics",
        json_schema_extra=group(LISTENERS, "HOST:PORT"),
    )
    processes: int = Field(
        1,
        ge=1,
        le=64,
        description="pylon processes sharing the listeners (SO_REUSEPORT) under one "
        "supervisor that owns the admin listener; 1 = one process, no supervisor",
        json_schema_extra=group(LISTENERS),
    )

    @field_validator("listen")
    @classmethod
    def _valid_listen(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("admin_listen")
    @classmethod
    def _valid_admin_listen(cls, value: str) -> str:
        value = value.strip()
        if value:
            split_host_port(value)
        return value

    @field_validator("quic_listen")
    @classmethod
    def _valid_quic_listen(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    # Derived view, so the rest of pylon never re-parses the address.
    @property
    def listen_host_port(self) -> tuple[str, int]:
        """The TCP listener's (host, port), brackets off an IPv6 host."""
        return split_host_port(self.listen)

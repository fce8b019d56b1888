"""The gateway side: registration with the gateway over gRPC (models, live stats, canaries) and
the reverse tunnel (pylon dials the gateway and serves HTTP/3 on its own connection)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from pylon.settings.topics import GATEWAY, group

Connectivity = Literal["direct", "reverse"]
TunnelProtocol = Literal["http3", "raw-quic"]
# What an inference server id, a cluster id and a model name may be on the wire: visible ASCII.
_PRINTABLE = re.compile(r"[\x21-\x7e]+")


class GatewaySettings(BaseModel):
    """The `Gateway` topic."""

    gateway: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="a gateway's control-plane address HOST:PORT (repeatable): a seed of the "
        "watch (WatchStargates); pylon registers with every gateway the watch names. Unset = no "
        "registration (the gateway is configured by hand)",
        json_schema_extra=group(GATEWAY, "HOST:PORT", repeatable=True),
    )
    inference_server_id: str | None = Field(
        None,
        description="this node's id at the gateway (registration and the tunnel handshake); "
        "needed with --gateway",
        json_schema_extra=group(GATEWAY, "ID"),
    )
    cluster_id: str | None = Field(
        None,
        description="the cluster this node's capacity is pooled in at the gateway; unset = "
        "the inference server id",
        json_schema_extra=group(GATEWAY, "ID"),
    )
    gateway_token_file: Path | None = Field(
        None,
        description="file holding the bearer token pylon presents to the gateway (trimmed; "
        "re-read at every stream open and every tunnel dial, so a rotated token is used next)",
        json_schema_extra=group(GATEWAY),
    )
    inference_server_url: str | None = Field(
        None,
        description="the URL registered for this node in direct mode; unset = "
        "quic://HOST:PORT of the UDP listener (refused when that is a wildcard address)",
        json_schema_extra=group(GATEWAY, "URL"),
    )
    registration_interval: float = Field(
        1.0,
        ge=0.1,
        le=60.0,
        description="seconds between full snapshots on each registration stream (also sent "
        "to the gateway as the heartbeat it times the stream out by, at 3x)",
        json_schema_extra=group(GATEWAY),
    )
    gateway_connect_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds a gRPC stream open or a tunnel dial (QUIC handshake and tunnel "
        "handshake) may take",
        json_schema_extra=group(GATEWAY),
    )
    connectivity: Connectivity = Field(
        "direct",
        description="direct: the gateway dials pylon's listeners; reverse: pylon dials the "
        "gateway (behind NAT or a firewall) and serves requests on its own connections",
        json_schema_extra=group(GATEWAY),
    )
    tunnel_protocol: TunnelProtocol = Field(
        "http3",
        description="what runs on a reverse tunnel's streams: http3 (role-reversed HTTP/3) or "
        "raw-quic (Cap'n Proto messages per stream); must match the gateway's",
        json_schema_extra=group(GATEWAY),
    )
    tunnel_connections: int = Field(
        2,
        ge=1,
        le=16,
        description="reverse-tunnel connections per gateway (and per process), so one broken "
        "path does not take the node out",
        json_schema_extra=group(GATEWAY),
    )
    tunnel_keepalive: float = Field(
        2.0,
        gt=0,
        description="seconds between QUIC PINGs on an idle reverse tunnel; a path silent for "
        "--tunnel-idle-timeout is dropped and redialled",
        json_schema_extra=group(GATEWAY),
    )
    tunnel_idle_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds a reverse tunnel may hear nothing from the gateway before pylon "
        "drops it and dials again",
        json_schema_extra=group(GATEWAY),
    )
    gateway_ca: Path | None = Field(
        None,
        description="CA bundle (PEM) the gateway's certificate is verified against on reverse "
        "tunnels (checked at start, re-read when it changes)",
        json_schema_extra=group(GATEWAY),
    )
    gateway_insecure: bool = Field(
        False,
        description="dial reverse tunnels without verifying the gateway's certificate (logged "
        "as a warning at start); otherwise --gateway-ca is needed",
        json_schema_extra=group(GATEWAY),
    )
    gateway_tls: bool = Field(
        False,
        description="speak gRPC to the gateway over TLS, its certificate verified against "
        "--gateway-ca (re-read at every stream open) or, without it, the system's roots; "
        "unset = plaintext gRPC (the bearer token then crosses the network in the clear)",
        json_schema_extra=group(GATEWAY),
    )
    canary_interval: float = Field(
        5.0,
        ge=0,
        description="seconds between active canaries per published model (a small "
        "non-streaming chat completion); a failed one advertises the model INACTIVE and "
        "makes /ready 503 until a probe passes again. 0 = no canary",
        json_schema_extra=group(GATEWAY),
    )
    canary_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds one canary may take before it counts as failed",
        json_schema_extra=group(GATEWAY),
    )
    canary_max_tokens: int = Field(
        237,
        ge=2,
        le=4096,
        description="max_tokens of a canary; an answer of exactly this many completion "
        "tokens is a runaway generation and fails the canary",
        json_schema_extra=group(GATEWAY),
    )
    canary_recovery_interval: float = Field(
        1.0,
        gt=0,
        description="seconds between probes of a model whose canary failed, until one passes",
        json_schema_extra=group(GATEWAY),
    )

    @field_validator("gateway", mode="before")
    @classmethod
    def _split_gateways(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("gateway")
    @classmethod
    def _gateway_addresses(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for address in value:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{address!r} is not HOST:PORT")
        return tuple(dict.fromkeys(value))

    @field_validator("inference_server_id", "cluster_id")
    @classmethod
    def _printable_id(cls, value: str | None) -> str | None:
        if value is not None and not _PRINTABLE.fullmatch(value):
            raise ValueError("must be visible ASCII, without spaces, and not empty")
        return value

    @model_validator(mode="after")
    def _gateway_takes_effect(self) -> Self:
        """A gateway setting that could not take effect refuses the start."""
        if not self.gateway:
            for name in (
                "inference_server_id",
                "cluster_id",
                "gateway_token_file",
                "inference_server_url",
                "gateway_ca",
            ):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"{flag} needs --gateway: without it pylon registers "
                        "nowhere and the setting would be ignored"
                    )
            if self.connectivity == "reverse":
                raise ValueError(
                    "--connectivity reverse needs --gateway: there would be nobody to dial"
                )
            if self.gateway_insecure:
                raise ValueError("--gateway-insecure needs --gateway --connectivity reverse")
            if self.gateway_tls:
                raise ValueError("--gateway-tls needs --gateway")
            return self
        if self.inference_server_id is None:
            raise ValueError(
                "--gateway needs --inference-server-id: the gateway knows the node by it"
            )
        if self.connectivity == "reverse":
            if self.gateway_ca is None and not self.gateway_insecure:
                raise ValueError(
                    "--connectivity reverse needs --gateway-ca (the CA the "
                    "gateway's certificate is verified against) or an explicit "
                    "--gateway-insecure; never silently unverified"
                )
            if self.gateway_ca is not None and self.gateway_insecure:
                raise ValueError("--gateway-ca and --gateway-insecure contradict each other")
            if self.inference_server_url is not None:
                raise ValueError(
                    "--inference-server-url has no effect with --connectivity "
                    "reverse: the gateway reaches pylon over the tunnel"
                )
        else:
            if self.gateway_insecure:
                raise ValueError(
                    "--gateway-insecure needs --connectivity reverse: in direct mode pylon "
                    "dials no tunnel"
                )
            if self.gateway_ca is not None and not self.gateway_tls:
                raise ValueError(
                    "--gateway-ca needs --connectivity reverse or --gateway-tls: in direct "
                    "mode without TLS to the gateway nothing would be verified against it"
                )
        if self.tunnel_idle_timeout <= self.tunnel_keepalive:
            raise ValueError(
                "--tunnel-idle-timeout must exceed --tunnel-keepalive, or every "
                "quiet tunnel would be dropped between two PINGs"
            )
        return self

"""TLS and auth: pylon's TLS identity, the clients it accepts, and the tunnel's bearer token."""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, Field, model_validator

from pylon.settings.topics import TLS_AUTH, group


class TlsAuthSettings(BaseModel):
    """The `TLS and auth` topic: files pylon reads (and re-reads when they change)."""

    tunnel_token_file: Path | None = Field(
        None,
        description="file holding the bearer token every non-health request must carry "
        "(re-read when it changes)",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_cert: Path | None = Field(
        None,
        description="server certificate chain (PEM), with --tls-key; unset = plaintext TCP "
        "and a self-signed QUIC identity",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_key: Path | None = Field(
        None,
        description="server private key (PEM), with --tls-cert",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_client_ca: Path | None = Field(
        None,
        description="CA bundle (PEM): only clients with a certificate from it may connect "
        "(needs --tls-cert)",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_self_signed_cert_file: Path | None = Field(
        None,
        description="where pylon writes the certificate (PEM, never the key) of the "
        "self-signed QUIC identity it generates at each start, for clients to trust; unset = "
        "not written (its SHA-256 is logged either way)",
        json_schema_extra=group(TLS_AUTH),
    )
    tls_reload_interval: float = Field(
        2.0,
        gt=0,
        description="seconds between checks of the cert/key files for a new pair "
        "(needs --tls-cert)",
        json_schema_extra=group(TLS_AUTH),
    )

    @model_validator(mode="after")
    def _tls_takes_effect(self) -> Self:
        """A TLS setting that could not take effect refuses the start: never less than asked."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together (or neither)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "--tls-client-ca needs --tls-cert and --tls-key: without them the TCP listener "
                "is plaintext and accepts any client"
            )
        if "tls_reload_interval" in self.model_fields_set and self.tls_cert is None:
            raise ValueError(
                "--tls-reload-interval needs --tls-cert and --tls-key: without them there are "
                "no files to reload"
            )
        if self.tls_self_signed_cert_file is not None and self.tls_cert is not None:
            raise ValueError(
                "--tls-self-signed-cert-file has no effect with --tls-cert: pylon then uses "
                "that certificate and generates none"
            )
        return self

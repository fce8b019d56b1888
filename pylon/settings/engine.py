"""Engine: where the engine is, the dialect pylon speaks to it, the connections pylon keeps to
it, which of its answers the gateway may retry, and the tokenizer that renders prompts as it does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import AnyHttpUrl, BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from pylon.adapters import ADAPTERS, AdapterOptions
from pylon.adapters.base import I32_MAX
from pylon.core.retry import RetryPolicy
from pylon.settings.topics import ENGINE, group

Backend = Literal["dynamo", "vllm", "sglang", "passthrough"]
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP header name, lower-cased


class EngineSettings(BaseModel):
    """The `Engine` topic. `tokenizer` is listed here (it is the engine's tokenizer) but only
    `--routing kv` uses it: `Settings` checks the two together."""

    upstream: AnyHttpUrl | None = Field(
        None,
        description="engine base URL (http://, no credentials); unset = an embedded mock_dynamo",
        json_schema_extra=group(ENGINE),
    )
    backend: Backend = Field(
        "dynamo",
        description="engine dialect for priority derivation",
        json_schema_extra=group(ENGINE),
    )
    priority_ceiling: int = Field(
        3600, ge=1, le=I32_MAX, description="rank ceiling C", json_schema_extra=group(ENGINE)
    )
    derive_priority: bool = Field(
        True, description="kill switch for priority derivation", json_schema_extra=group(ENGINE)
    )
    sglang_low_priority_first: bool = Field(
        False,
        description="SGLang runs --schedule-low-priority-values-first",
        json_schema_extra=group(ENGINE),
    )
    upstream_max_idle: int = Field(
        256,
        ge=0,
        description="idle connections kept per engine target",
        json_schema_extra=group(ENGINE),
    )
    upstream_max_connections: int = Field(
        1024,
        ge=1,
        description="open connections per engine target; requests above it wait their turn",
        json_schema_extra=group(ENGINE),
    )
    retryable_status_codes: Annotated[tuple[int, ...], NoDecode] = Field(
        (429, 503),
        description="upstream statuses the gateway may retry",
        json_schema_extra=group(ENGINE, "CODES"),
    )
    require_upstream_retry_header: bool = Field(
        True,
        description="a retryable status needs the engine's retry header set to true",
        json_schema_extra=group(ENGINE),
    )
    upstream_retry_header: str = Field(
        "x-stargate-upstream-retryable",
        description="engine header that authorises a retry",
        json_schema_extra=group(ENGINE, "NAME"),
    )
    propagate_retry_after: bool = Field(
        True,
        description="Retry-After -> x-stargate-retry-after-ms",
        json_schema_extra=group(ENGINE),
    )
    local_connect_failures_retryable: bool = Field(
        False,
        description="mark engine connect failures retryable",
        json_schema_extra=group(ENGINE),
    )
    tokenizer: Path | None = Field(
        None,
        description="local Hugging Face model dir (tokenizer.json, tokenizer_config.json with "
        "its chat template) that KV-aware routing tokenizes prompts with, exactly as the "
        "--backend engine does; loaded and checked at start (needs the dynamo extra: pip "
        "install 'pylon[dynamo]')",
        json_schema_extra=group(ENGINE, "DIR"),
    )

    @field_validator("upstream")
    @classmethod
    def _plain_http(cls, value: AnyHttpUrl | None) -> AnyHttpUrl | None:
        if value is None:
            return value
        if value.scheme != "http":
            raise ValueError("only http:// engines are supported (pylon is node-local)")
        if value.username or value.password:
            raise ValueError(
                "the upstream URL may not carry credentials: pylon never sends credentials to "
                "the engine (keep the engine on loopback, or on a network only pylon reaches)"
            )
        if value.query or value.fragment:
            raise ValueError("the upstream URL may not carry a query or fragment")
        return value

    @field_validator("retryable_status_codes", mode="before")
    @classmethod
    def _status_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [part.strip() for part in value.split(",") if part.strip()]
            bad = [part for part in parts if not part.isdigit()]
            if bad:
                raise ValueError(f"not an HTTP status: {bad[0]!r}")
            return tuple(int(part) for part in parts)
        if isinstance(value, int):
            return (value,)
        return value

    @field_validator("retryable_status_codes")
    @classmethod
    def _valid_statuses(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"not an HTTP status: {status}")
        return value

    @field_validator("upstream_retry_header")
    @classmethod
    def _lower_header(cls, value: str) -> str:
        value = value.strip().lower()
        if not _TOKEN.fullmatch(value):
            raise ValueError(f"not an HTTP header name: {value!r}")
        return value

    # `Backend` and the adapter registry are two lists: a backend without an adapter never starts.
    @model_validator(mode="after")
    def _known_backend(self) -> Self:
        if self.backend not in ADAPTERS:
            raise ValueError(f"unknown backend {self.backend!r}")
        return self

    # Derived views, so the rest of pylon never re-derives them.
    @property
    def adapter_options(self) -> AdapterOptions:
        """What the `--backend` adapter needs to derive a request's priority."""
        return AdapterOptions(self.priority_ceiling, self.sglang_low_priority_first)

    @property
    def retry_policy(self) -> RetryPolicy:
        """Which engine answers the gateway may retry, and how pylon marks them."""
        return RetryPolicy(
            retryable_status_codes=frozenset(self.retryable_status_codes),
            require_upstream_retry_header=self.require_upstream_retry_header,
            upstream_retry_header=self.upstream_retry_header.encode("ascii"),
            propagate_retry_after=self.propagate_retry_after,
            local_connect_failures_retryable=self.local_connect_failures_retryable,
        )

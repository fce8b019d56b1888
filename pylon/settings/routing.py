"""Routing: how a request picks its engine worker, the workers, and their health checks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, Field, PlainSerializer, field_validator, model_validator
from pydantic_settings import NoDecode

from pylon.routing.spec import (
    MAX_WORKERS,
    WorkerSpec,
    WorkerSpecError,
    check_replica_peer,
    parse_worker_spec,
    worker_from_table,
)
from pylon.settings.topics import ORIGIN_FORM, ROUTING, group

RoutingMode = Literal["off", "round-robin", "least-loaded", "kv"]
# A worker as a setting: parsed from its SPEC (or a [[worker]] table), shown as its SPEC.
WorkerSetting = Annotated[WorkerSpec, PlainSerializer(lambda spec: spec.text(), return_type=str)]
WORKER_ENV_SEPARATOR = ";"  # a SPEC holds commas, so PYLON_WORKER separates specs with `;`


class RoutingSettings(BaseModel):
    """The `Routing` topic, each setting on its own. What a mode needs from the workers and
    from the engine settings (`--upstream`, `--backend`, `--tokenizer`) is checked by `Settings`."""

    routing: RoutingMode = Field(
        "off",
        description="how a request picks its engine worker: off (every request to --upstream), "
        "round-robin, least-loaded (fewest requests in flight) or kv (the worker that holds "
        "the prompt's KV cache and is not overloaded; needs --tokenizer and the dynamo extra)",
        json_schema_extra=group(ROUTING),
    )
    worker: Annotated[tuple[WorkerSetting, ...], NoDecode] = Field(
        (),
        description="an engine worker to route to (repeatable; needs --routing other than off): "
        "comma-separated key=value, url=http://HOST:PORT (its own URL) or instance-id=U64 (a "
        "Dynamo instance behind the --upstream frontend), plus kv-events=tcp://HOST:PORT (one "
        "per dp rank), block-size=16, dp-size=1; also [[worker]] tables in --config",
        json_schema_extra=group(ROUTING, "SPEC", repeatable=True, separator=WORKER_ENV_SEPARATOR),
    )
    workers_file: Path | None = Field(
        None,
        description="a TOML file of [[worker]] tables (the --worker keys) that is the worker "
        "catalogue while pylon runs: re-read when its content changes and on SIGHUP (a file "
        "that does not parse keeps the catalogue in use); instead of --worker",
        json_schema_extra=group(ROUTING, "PATH"),
    )
    discover_instances: bool = Field(
        False,
        description="take the worker catalogue from the --upstream Dynamo frontend: every "
        "generate instance its --worker-health-path (/health) lists is an instance-id= worker, "
        "re-read like --workers-file; not with --routing kv (the frontend does not say where "
        "an instance publishes its KV events)",
        json_schema_extra=group(ROUTING),
    )
    workers_file_interval: float = Field(
        2.0,
        gt=0,
        le=3600,
        description="seconds between two reads of --workers-file (its content decides) or of "
        "the frontend's instances (--discover-instances)",
        json_schema_extra=group(ROUTING),
    )
    worker_health_path: str = Field(
        "/health",
        description="path each worker's active health check GETs (2xx = healthy)",
        json_schema_extra=group(ROUTING, "PATH"),
    )
    worker_health_interval: float = Field(
        1.0,
        gt=0,
        description="seconds between health checks of each worker",
        json_schema_extra=group(ROUTING),
    )
    worker_health_timeout: float = Field(
        1.0,
        gt=0,
        description="seconds one worker health check may take (longer = a failure)",
        json_schema_extra=group(ROUTING),
    )
    worker_eject_after: int = Field(
        3,
        ge=1,
        le=1000,
        description="consecutive failed health checks that take a worker out of routing",
        json_schema_extra=group(ROUTING, "CHECKS"),
    )
    worker_readmit_after: int = Field(
        2,
        ge=1,
        le=1000,
        description="consecutive passed health checks that bring an ejected worker back (a "
        "worker is admitted at start after its first passed check)",
        json_schema_extra=group(ROUTING, "CHECKS"),
    )
    worker_outlier_failures: int = Field(
        5,
        ge=0,
        le=1000,
        description="passive health: failed answers in a row (5xx other than 503, no "
        "connection, a broken or timed-out exchange) that take a worker out of routing for a "
        "while, even though its health checks pass; 0 = never",
        json_schema_extra=group(ROUTING, "FAILURES"),
    )
    worker_outlier_ejection: float = Field(
        10.0,
        gt=0,
        le=86400,
        description="seconds the first passive ejection lasts; each ejection after it without "
        "a success in between lasts twice as long",
        json_schema_extra=group(ROUTING),
    )
    worker_outlier_max_ejection: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="seconds the longest passive ejection lasts (at least "
        "--worker-outlier-ejection)",
        json_schema_extra=group(ROUTING),
    )
    worker_outlier_max_percent: float = Field(
        50.0,
        gt=0,
        le=100,
        allow_inf_nan=False,
        description="the most of the workers passive health ejects at once, in percent (at "
        "least one, never the last one in rotation)",
        json_schema_extra=group(ROUTING, "PERCENT"),
    )
    kv_overlap_weight: float | None = Field(
        None,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="--routing kv: how much a worker's cached prefix counts against its load in "
        "Dynamo's selection cost (weight x blocks to prefill + active blocks); unset = Dynamo's "
        "default (1). docs/benchmarks.md 'Routing quality' measures 1 against 8",
        json_schema_extra=group(ROUTING, "WEIGHT"),
    )
    kv_token_data: bool = Field(
        False,
        description="--routing kv, --backend dynamo: send the frontend pylon's token ids "
        "(nvext.token_data) for models whose rendering pylon proved identical to its own (a "
        "mismatch at start refuses it); docs/routing.md",
        json_schema_extra=group(ROUTING),
    )

    replica_sync_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="--routing kv: share active load with the pylon replicas on other nodes "
        "(--replica-peer) through Dynamo's replica sync, publishing this pylon's bookings on "
        "0.0.0.0:PORT (all interfaces, unauthenticated: firewall it, docs/routing.md "
        "'Replicas across nodes'); unset = no sync",
        json_schema_extra=group(ROUTING, "PORT"),
    )
    replica_peer: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="--routing kv, with --replica-sync-port: another pylon replica's sync "
        "address, whose bookings this pylon counts (repeatable; every replica lists every "
        "other and holds the same workers)",
        json_schema_extra=group(ROUTING, "HOST:PORT", repeatable=True),
    )

    kv_booking_expiry: float | None = Field(
        None,
        ge=1,
        le=86400,
        allow_inf_nan=False,
        description="--routing kv: seconds after its admission Dynamo's selection core forgets "
        "a booking still open (its sweep runs about once a minute): bounds how long a crashed "
        "--replica-peer's bookings linger here (this plus up to 60 s), and drops a request "
        "that runs longer from the load view; unset = Dynamo's default (300)",
        json_schema_extra=group(ROUTING),
    )

    @field_validator("replica_peer", mode="before")
    @classmethod
    def _peers(cls, value: Any) -> Any:
        """A comma-separated string (environment) or one value -> a list of stripped values."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return [part.strip() if isinstance(part, str) else part for part in value]
        return value

    @field_validator("replica_peer")
    @classmethod
    def _valid_peers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for peer in value:
            check_replica_peer(peer)
        if len(set(value)) != len(value):
            raise ValueError("a replica peer is given twice")
        return value

    @field_validator("worker", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        """SPEC strings (flags; the environment's `;`-separated), [[worker]] tables (config
        file) or specs -> a tuple of `WorkerSpec`; the first bad one is the error."""
        if isinstance(value, str):
            value = [part for part in value.split(WORKER_ENV_SEPARATOR) if part.strip()]
        if isinstance(value, (WorkerSpec, Mapping)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected worker specs, got {value!r}")
        if len(value) > MAX_WORKERS:
            raise ValueError(f"{len(value)} workers, at most {MAX_WORKERS}")
        specs = []
        for item in value:
            try:
                if isinstance(item, str):
                    specs.append(parse_worker_spec(item))
                elif isinstance(item, Mapping):
                    specs.append(worker_from_table(item))
                elif isinstance(item, WorkerSpec):
                    specs.append(item)
                else:
                    raise WorkerSpecError(f"not a worker spec: {item!r}")
            except WorkerSpecError as exc:
                raise ValueError(str(exc)) from None
        return tuple(specs)

    @model_validator(mode="after")
    def _outlier_ejection_bounded(self) -> Self:
        if self.worker_outlier_max_ejection < self.worker_outlier_ejection:
            raise ValueError(
                "--worker-outlier-max-ejection must be at least --worker-outlier-ejection"
            )
        return self

    @field_validator("worker_health_path")
    @classmethod
    def _valid_worker_health_path(cls, value: str) -> str:
        if not value.startswith("/") or not ORIGIN_FORM.fullmatch(value):
            raise ValueError(
                f"not a request path: {value!r} (a path such as /health, visible ASCII)"
            )
        return value

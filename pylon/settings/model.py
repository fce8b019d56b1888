"""`Settings`: the one model pylon builds at start-up, composed of one part per topic.

Each part (`pylon.settings.<topic>`) owns its topic's fields and the validators that read only
them. What is left here is the source ranking (`pylon.settings.sources`) and the rules that span
topics, each saying which.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pylon.settings.bringup import BringupSettings
from pylon.settings.engine import EngineSettings
from pylon.settings.flood_guards import FloodGuardSettings
from pylon.settings.gateway import GatewaySettings
from pylon.settings.http2 import Http2Settings
from pylon.settings.limits import LimitSettings
from pylon.settings.listeners import ListenerSettings
from pylon.settings.logging import LoggingSettings
from pylon.settings.queue_gate import QueueGateSettings
from pylon.settings.quic import QuicSettings
from pylon.settings.routing import RoutingSettings
from pylon.settings.sources import ENV_PREFIX, ranked_sources
from pylon.settings.timeouts import TimeoutSettings
from pylon.settings.tls_auth import TlsAuthSettings
from pylon.settings.tracing import TracingSettings


# pydantic takes the fields of the last base first, so the parts are listed last topic first:
# the fields come out in `GROUPS` order, which `pylon config`, the order of validation errors,
# and each topic's rows in `--help` and docs/operations.md follow. The parts' own model
# validators run in the same order, before the cross-topic ones below.
class Settings(
    BaseSettings,
    GatewaySettings,
    TracingSettings,
    LoggingSettings,
    FloodGuardSettings,
    QuicSettings,
    Http2Settings,
    TlsAuthSettings,
    TimeoutSettings,
    LimitSettings,
    QueueGateSettings,
    BringupSettings,
    RoutingSettings,
    EngineSettings,
    ListenerSettings,
):
    """Every setting: flag `--<name>`, variable `PYLON_<NAME>`, config file key `<name>`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True
    )

    @model_validator(mode="after")
    def _gateway_fits_processes(self) -> Self:
        """Spans Gateway (`gateway`) and Listeners (`processes`). The gateway knows a node by
        one registration whose figures cover the whole node; several processes would each
        register the same id with their own share of the load (and each hold the acks of its
        own stream), so the gateway would see conflicting, partial snapshots."""
        if self.gateway and self.processes > 1:
            raise ValueError(
                "--gateway needs --processes 1: one registration must speak for the whole "
                "node, and a node-wide snapshot across processes is not built yet"
            )
        return self

    @model_validator(mode="after")
    def _routing_takes_effect(self) -> Self:
        """Workers and routing modes that could not do what they say refuse the start.

        Spans Routing (`routing`, `worker`, `kv_token_data`, the replica sync) and Engine
        (`upstream`, `backend`, `tokenizer`). The checks run in a fixed order: the first one
        that fails is the message.
        """
        if self.routing == "off":
            if self.worker or self.workers_file is not None or self.discover_instances:
                flag = (
                    "--worker"
                    if self.worker
                    else "--workers-file"
                    if self.workers_file is not None
                    else "--discover-instances"
                )
                raise ValueError(
                    f"{flag} needs --routing round-robin, least-loaded or kv: with --routing "
                    "off every request goes to --upstream and the workers would be ignored"
                )
            self._kv_settings_unused()
            return self
        if "upstream_health_check_interval" in self.model_fields_set:
            raise ValueError(
                "--upstream-health-check-interval checks the one engine of --routing off: with "
                f"--routing {self.routing} the workers' own checks (--worker-health-interval) "
                "decide readiness"
            )
        if self.discover_instances:
            self._discovery_can_route()
            return self
        if self.workers_file is not None:
            if self.worker:
                raise ValueError(
                    "--workers-file and --worker (or [[worker]] tables in --config) both give "
                    "the worker catalogue: give it in one place"
                )
            # The file's workers are checked when it is read (at start, and at every reload).
            if self.routing == "kv":
                self._kv_can_route()
            else:
                self._kv_settings_unused()
            return self
        self._workers_distinct()
        self._upstream_fits_workers()
        if self.routing == "kv":
            self._kv_can_route()
        else:
            self._kv_settings_unused()
        return self

    def _discovery_can_route(self) -> None:
        """--discover-instances: the only catalogue, from a Dynamo frontend, without kv."""
        if self.worker or self.workers_file is not None:
            other = "--worker" if self.worker else "--workers-file"
            raise ValueError(
                f"--discover-instances and {other} both give the worker catalogue: give it in "
                "one place"
            )
        if self.routing == "kv":
            raise ValueError(
                "--discover-instances cannot serve --routing kv: Dynamo 1.6.1's frontend does "
                "not say where an instance publishes its KV events (kv-events=); write a "
                "--workers-file instead (docs/routing.md)"
            )
        if self.backend != "dynamo" or self.upstream is None:
            raise ValueError(
                "--discover-instances needs --backend dynamo and --upstream: the Dynamo "
                "frontend whose /health lists the instances"
            )
        self._kv_settings_unused()

    def _workers_distinct(self) -> None:
        """At least one worker, and no URL or worker id twice."""
        if not self.worker:
            raise ValueError(f"--routing {self.routing} needs at least one --worker")
        ids: set[int] = set()
        urls: set[str] = set()
        for spec in self.worker:
            if spec.url is not None:
                if spec.url in urls:
                    raise ValueError(f"--worker url={spec.url} is given twice")
                urls.add(spec.url)
            if spec.worker_id in ids:
                raise ValueError(
                    f"--worker {spec.label}: worker id {spec.worker_id} is given twice"
                )
            ids.add(spec.worker_id)

    def _upstream_fits_workers(self) -> None:
        """instance-id= workers sit behind a Dynamo frontend at --upstream; url= workers alone
        leave --upstream unused."""
        pinned = [spec for spec in self.worker if spec.instance_id is not None]
        if pinned:
            if self.backend != "dynamo":
                raise ValueError(
                    f"--worker {pinned[0].label} needs --backend dynamo (a Dynamo frontend "
                    f"pins the instance by header), not {self.backend}"
                )
            if self.upstream is None:
                raise ValueError(
                    f"--worker {pinned[0].label} needs --upstream: the Dynamo frontend in "
                    "front of the instance"
                )
        elif self.upstream is not None:
            raise ValueError(
                f"--upstream is not used with --routing {self.routing} and only url= workers "
                "(requests go to the workers' own URLs): drop it, or route to instance-id= "
                "workers"
            )

    def _kv_can_route(self) -> None:
        """--routing kv: every worker's KV events, the tokenizer, and a frontend for token ids."""
        for spec in self.worker:
            if not spec.kv_events:
                raise ValueError(
                    f"--routing kv: --worker {spec.label} has no kv-events= endpoint (the "
                    "KV router follows each worker's cache through its KV events)"
                )
        if self.tokenizer is None:
            raise ValueError(
                "--routing kv needs --tokenizer DIR: prompts are tokenized as the engine "
                "does, to find the worker that holds their KV blocks"
            )
        if self.kv_token_data and self.backend != "dynamo":
            raise ValueError(
                f"--kv-token-data needs --backend dynamo: only a Dynamo frontend reads "
                f"nvext.token_data, not {self.backend}"
            )
        self._replica_sync_complete()

    def _replica_sync_complete(self) -> None:
        """Replica sync takes both halves: the port this pylon publishes on and the peers it
        hears (Dynamo refuses peers without a port; a port without peers would expose the
        bookings to replicas this pylon never counts)."""
        if self.replica_peer and self.replica_sync_port is None:
            raise ValueError(
                "--replica-peer needs --replica-sync-port: Dynamo's replica sync publishes "
                "this pylon's bookings on it, the peers subscribe to it"
            )
        if self.replica_sync_port is not None and not self.replica_peer:
            raise ValueError(
                "--replica-sync-port needs at least one --replica-peer HOST:PORT: the other "
                "replicas whose bookings this pylon counts"
            )

    def _kv_settings_unused(self) -> None:
        """Any mode but kv: the settings only kv routing reads are refused, not ignored."""
        if self.tokenizer is not None:
            raise ValueError("--tokenizer is only used by --routing kv")
        if self.kv_token_data:
            raise ValueError("--kv-token-data needs --routing kv (its tokenization)")
        for name in ("replica_sync_port", "replica_peer", "kv_booking_expiry"):
            if getattr(self, name):
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} needs --routing kv: only Dynamo's selection core shares and "
                    "expires bookings"
                )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return ranked_sources(settings_cls, init_settings, env_settings)

    def redacted(self) -> dict[str, Any]:
        """Effective settings for display. No secret is a setting (the tunnel token lives in its
        file, URL credentials are refused); kept as the one place display goes through."""
        return self.model_dump(mode="json")

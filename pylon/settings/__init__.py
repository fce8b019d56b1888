"""Pylon's settings: one model, built once at start-up, passed down. No env reads elsewhere.

Precedence: command-line flag > environment (`PYLON_<NAME>`, then for the two tracing settings
OpenTelemetry's standard `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_SERVICE_NAME`) > `--config FILE`
(TOML) > default.

Every field names its topic (`group`): `pylon serve --help` shows the flags by topic and
docs/operations.md tables them the same way. `load_settings` turns every failure into one
`SettingsError` line that names the setting and where its value came from.

Layout: `topics` (the topic names and `group`), one module per topic holding that topic's part
of the model (`listeners`, `engine`, `routing`, `bringup`, `queue_gate`, `limits`, `timeouts`,
`tls_auth`, `http2`, `quic`, `flood_guards`, `logging`, `tracing`, `gateway`), `model`
(`Settings`: the parts composed, and the rules that span topics), `sources` (the precedence)
and `load` (`load_settings` and its one-line errors). Import from `pylon.settings`.
"""

from pylon.settings.engine import Backend
from pylon.settings.listeners import split_host_port
from pylon.settings.load import (
    SettingsError,
    check_otlp_protocol,
    closest_setting,
    describe_error,
    load_settings,
    read_config_file,
    unknown_env_vars,
)
from pylon.settings.model import Settings
from pylon.settings.routing import WORKER_ENV_SEPARATOR, RoutingMode, WorkerSetting
from pylon.settings.sources import ENV_PREFIX, given_values_only
from pylon.settings.topics import (
    BRINGUP,
    ENGINE,
    FLOODS,
    GATEWAY,
    GROUPS,
    HTTP2,
    LIMITS,
    LISTENERS,
    LOGGING,
    QUEUE,
    QUIC,
    ROUTING,
    TIMEOUTS,
    TLS_AUTH,
    TRACING,
    KiB,
    MiB,
    group,
)
from pylon.settings.tracing import (
    OTLP_PROTOCOL,
    OTLP_PROTOCOL_ENV,
    OTLP_TRACES_PATH,
    STANDARD_OTEL_ENV,
    standard_otel_values,
)

__all__ = [
    "BRINGUP",
    "ENGINE",
    "ENV_PREFIX",
    "FLOODS",
    "GATEWAY",
    "GROUPS",
    "HTTP2",
    "LIMITS",
    "LISTENERS",
    "LOGGING",
    "OTLP_PROTOCOL",
    "OTLP_PROTOCOL_ENV",
    "OTLP_TRACES_PATH",
    "QUEUE",
    "QUIC",
    "ROUTING",
    "STANDARD_OTEL_ENV",
    "TIMEOUTS",
    "TLS_AUTH",
    "TRACING",
    "WORKER_ENV_SEPARATOR",
    "Backend",
    "KiB",
    "MiB",
    "RoutingMode",
    "Settings",
    "SettingsError",
    "WorkerSetting",
    "check_otlp_protocol",
    "closest_setting",
    "describe_error",
    "given_values_only",
    "group",
    "load_settings",
    "read_config_file",
    "split_host_port",
    "standard_otel_values",
    "unknown_env_vars",
]

"""Settings precedence: flag > PYLON_* env > TOML file > default."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from pylon.settings import (
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
    Settings,
    SettingsError,
    load_settings,
    split_host_port,
    unknown_env_vars,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith(("PYLON_", "OTEL_")):
            monkeypatch.delenv(name)


@pytest.fixture
def toml(tmp_path: Path):
    def write(text: str) -> Path:
        path = tmp_path / "pylon.toml"
        path.write_text(text)
        return path

    return write


def test_defaults() -> None:
    s = load_settings({})
    assert s.backend == "dynamo"
    assert s.priority_ceiling == 3600
    assert s.derive_priority is True
    assert s.retryable_status_codes == (429, 503)
    assert s.listen_host_port == ("127.0.0.1", 8080)
    assert s.adapter_options.ceiling == 3600
    policy = s.retry_policy
    assert policy.retryable_status_codes == frozenset({429, 503})
    assert policy.upstream_retry_header == b"x-stargate-upstream-retryable"


def test_precedence_flag_env_file_default(monkeypatch: pytest.MonkeyPatch, toml) -> None:
    path = toml(
        'priority_ceiling = 10\nbackend = "sglang"\nmax_headers = 50\nlog_level = "debug"\n'
    )
    monkeypatch.setenv("PYLON_PRIORITY_CEILING", "20")
    monkeypatch.setenv("PYLON_BACKEND", "vllm")
    s = load_settings({"priority_ceiling": 30}, path)
    assert s.priority_ceiling == 30  # flag beats env and file
    assert s.backend == "vllm"  # env beats file
    assert s.max_headers == 50  # file beats default
    assert s.log_level == "debug"
    assert s.listen == "127.0.0.1:8080"  # default


def test_file_only_applies_to_its_own_load(toml) -> None:
    load_settings({}, toml("priority_ceiling = 10\n"))
    assert load_settings({}).priority_ceiling == 3600


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="config file not found"):
        load_settings({}, tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("true", True), ("false", False), ("1", True), ("0", False), ("TRUE", True), ("False", False)],
)
def test_booleans_from_env(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("PYLON_DERIVE_PRIORITY", raw)
    monkeypatch.setenv("PYLON_SGLANG_LOW_PRIORITY_FIRST", raw)
    s = load_settings({})
    assert s.derive_priority is expected
    assert s.sglang_low_priority_first is expected
    assert s.adapter_options.sglang_low_priority_first is expected


def test_status_list_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYLON_RETRYABLE_STATUS_CODES", "429, 503,500")
    assert load_settings({}).retryable_status_codes == (429, 503, 500)
    monkeypatch.setenv("PYLON_RETRYABLE_STATUS_CODES", "")
    assert load_settings({}).retryable_status_codes == ()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PYLON_DERIVE_PRIORITY", "maybe"),
        ("PYLON_PRIORITY_CEILING", "0"),
        ("PYLON_PRIORITY_CEILING", "2147483648"),
        ("PYLON_PRIORITY_CEILING", "ten"),
        ("PYLON_BACKEND", "trtllm"),
        ("PYLON_LISTEN", "nope"),
        ("PYLON_LISTEN", "127.0.0.1:70000"),
        ("PYLON_RETRYABLE_STATUS_CODES", "429,abc"),
        ("PYLON_RETRYABLE_STATUS_CODES", "99"),
        ("PYLON_UPSTREAM", "https://engine:8000"),
        ("PYLON_UPSTREAM", "http://engine:8000/?q=1"),
        ("PYLON_LOG_LEVEL", "loud"),
        ("PYLON_MAX_SSE_EVENT_BYTES", "1"),
    ],
)
def test_bad_env_values_raise(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as refused:
        load_settings({})
    assert f"({name})" in str(refused.value)  # the error names where the value came from
    assert_plain(str(refused.value))


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"backend": "x"}, "invalid setting backend (--backend): "),
        ({"priority_ceiling": -1}, "invalid setting priority_ceiling (--priority-ceiling): "),
        ({"not_a_setting": 1}, "unknown setting 'not_a_setting'"),
        ({"max_headers": 1}, "invalid setting max_headers (--max-headers): "),
        ({"retryable_status_codes": "429,abc"}, "not an HTTP status: 'abc'"),
        ({"upstream_retry_header": "x retry"}, "not an HTTP header name"),
        ({"listen": "[zz]:80"}, "not an IPv6 address"),
    ],
)
def test_bad_flags_raise(overrides: dict, needle: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(overrides)
    assert needle in str(refused.value)
    assert_plain(str(refused.value))


def assert_plain(line: str) -> None:
    """One line for an operator: no pydantic internals, URLs or Python type names."""
    assert "\n" not in line
    for leak in ("pydantic", "https://", "Value error", "ValidationError", "int()", "<class"):
        assert leak not in line, line


def test_bad_file_raises(toml) -> None:
    with pytest.raises(SettingsError, match=r"invalid setting backend \(config file .*\.toml\)"):
        load_settings({}, toml('backend = "trtllm"\n'))
    with pytest.raises(SettingsError, match=r"pylon\.toml: unknown setting 'unknown_key'$"):
        load_settings({}, toml("unknown_key = 1\n"))
    with pytest.raises(SettingsError, match=r"did you mean 'listen'\?"):
        load_settings({}, toml('lisen = "127.0.0.1:1"\n'))
    with pytest.raises(SettingsError, match=r"config file .*pylon\.toml is not valid TOML: "):
        load_settings({}, toml("backend = \n"))


def test_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="is a directory"):
        load_settings({}, tmp_path)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe")
    with pytest.raises(SettingsError, match=r"binary\.toml is not UTF-8"):
        load_settings({}, binary)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"tls_client_ca": "/ca.pem"}, "--tls-client-ca needs --tls-cert and --tls-key"),
        ({"tls_cert": "/c.pem"}, "--tls-cert and --tls-key must be given together"),
        ({"tls_key": "/k.pem"}, "--tls-cert and --tls-key must be given together"),
        ({"tls_reload_interval": 5}, "--tls-reload-interval needs --tls-cert"),
        ({"upstream": "http://user:pass@engine:8000"}, "pylon never sends credentials"),
        ({"upstream": "http://user@engine:8000"}, "may not carry credentials"),
    ],
)
def test_settings_that_cannot_take_effect_are_refused(overrides: dict, needle: str) -> None:
    """A TLS or auth setting that would silently do less than asked is a refusal."""
    with pytest.raises(SettingsError) as refused:
        load_settings(overrides)
    assert needle in str(refused.value)
    assert "secret" not in str(refused.value) and "pass" not in str(refused.value)
    assert_plain(str(refused.value))


def test_tls_settings_that_take_effect_are_accepted() -> None:
    both = {"tls_cert": "/c.pem", "tls_key": "/k.pem"}
    assert load_settings({**both, "tls_client_ca": "/ca", "tls_reload_interval": 1}).tls_client_ca
    assert load_settings({"quic_listen": "127.0.0.1:0"}).tls_cert is None  # self-signed QUIC


def test_unknown_env_vars_are_found_with_the_likely_name() -> None:
    environ = {
        "PYLON_LISTEN": "x",
        "PYLON_LISTN": "x",
        "pylon_upstrem": "x",
        "PYLON_SOMETHING_ELSE": "x",
        "OTHER": "x",
    }
    assert unknown_env_vars(environ) == [
        ("PYLON_LISTN", "PYLON_LISTEN"),
        ("PYLON_SOMETHING_ELSE", None),
        ("pylon_upstrem", "PYLON_UPSTREAM"),
    ]


def test_every_setting_has_a_topic_and_a_description() -> None:
    for name, field in Settings.model_fields.items():
        extra = field.json_schema_extra
        assert isinstance(extra, dict) and extra["group"] in GROUPS, name
        assert field.description, name


# Each topic's settings in the order `pylon serve --help` and docs/operations.md list them.
TOPIC_FIELDS = {
    LISTENERS: ("listen", "quic_listen", "admin_listen", "processes"),
    ENGINE: (
        "upstream",
        "backend",
        "priority_ceiling",
        "derive_priority",
        "sglang_low_priority_first",
        "upstream_max_idle",
        "upstream_max_connections",
        "retryable_status_codes",
        "require_upstream_retry_header",
        "upstream_retry_header",
        "propagate_retry_after",
        "local_connect_failures_retryable",
        "tokenizer",
    ),
    ROUTING: (
        "routing",
        "worker",
        "workers_file",
        "discover_instances",
        "workers_file_interval",
        "worker_health_path",
        "worker_health_interval",
        "worker_health_timeout",
        "worker_eject_after",
        "worker_readmit_after",
        "worker_outlier_failures",
        "worker_outlier_ejection",
        "worker_outlier_max_ejection",
        "worker_outlier_max_percent",
        "kv_overlap_weight",
        "kv_token_data",
        "replica_sync_port",
        "replica_peer",
        "kv_booking_expiry",
    ),
    BRINGUP: (
        "upstream_health_gate",
        "upstream_health_path",
        "upstream_health_wait",
        "upstream_health_interval",
        "upstream_health_check_interval",
        "upstream_health_timeout",
        "model",
        "model_discovery_interval",
        "model_discovery_timeout",
    ),
    QUEUE: (
        "queue_admission",
        "queue_admission_min_delta_ms",
        "queue_admission_factor",
        "queue_admission_retry_after_ms",
        "initial_input_tps",
    ),
    LIMITS: (
        "max_body_bytes",
        "max_connection_body_bytes",
        "max_total_body_bytes",
        "max_header_bytes",
        "max_headers",
        "max_sse_event_bytes",
    ),
    TIMEOUTS: (
        "first_output_timeout",
        "output_gap_timeout",
        "response_head_timeout",
        "client_send_timeout",
        "upstream_connect_timeout",
        "upstream_idle_timeout",
        "upstream_queue_timeout",
        "shutdown_grace",
        "header_timeout",
        "client_idle_timeout",
    ),
    TLS_AUTH: (
        "tunnel_token_file",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "tls_self_signed_cert_file",
        "tls_reload_interval",
    ),
    HTTP2: ("h2_max_concurrent_streams", "h2_stream_window", "http2_codec"),
    QUIC: (
        "quic_idle_timeout",
        "quic_max_data",
        "quic_max_stream_data",
        "quic_max_concurrent_streams",
        "quic_retry",
    ),
    FLOODS: ("flood_window", "max_stream_resets", "max_control_frames"),
    LOGGING: ("log_format", "log_level"),
    TRACING: ("otel_endpoint", "otel_service_name"),
    GATEWAY: (
        "gateway",
        "inference_server_id",
        "cluster_id",
        "gateway_token_file",
        "inference_server_url",
        "registration_interval",
        "gateway_connect_timeout",
        "connectivity",
        "tunnel_protocol",
        "tunnel_connections",
        "tunnel_keepalive",
        "tunnel_idle_timeout",
        "gateway_ca",
        "gateway_insecure",
        "gateway_tls",
        "canary_interval",
        "canary_timeout",
        "canary_max_tokens",
        "canary_recovery_interval",
    ),
}


def test_settings_come_by_topic_in_the_pinned_order() -> None:
    """The model lists the topics in GROUPS order and each topic's settings as pinned: `--help`,
    docs/operations.md and `pylon config` follow it, so a reorder is a visible change."""
    assert tuple(TOPIC_FIELDS) == GROUPS
    assert list(Settings.model_fields) == [
        name for names in TOPIC_FIELDS.values() for name in names
    ]


def test_each_part_of_the_model_holds_one_topic() -> None:
    """`Settings` is composed of one part per topic (its bases, listed last topic first): each
    part declares exactly its topic's settings."""
    parts = [base for base in reversed(Settings.__bases__) if base is not BaseSettings]
    assert len(parts) == len(GROUPS)
    for part, (topic, names) in zip(parts, TOPIC_FIELDS.items(), strict=True):
        assert tuple(part.model_fields) == names, (part.__name__, topic)
        for name, field in part.model_fields.items():
            assert isinstance(field.json_schema_extra, dict), name
            assert field.json_schema_extra["group"] == topic, (part.__name__, name)


def test_log_level_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYLON_LOG_LEVEL", "WARNING")
    assert load_settings({}).log_level == "warning"


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.backend = "vllm"  # type: ignore[misc]


def test_upstream_shown() -> None:
    s = load_settings({"upstream": "http://127.0.0.1:8000"})
    assert s.redacted()["upstream"].startswith("http://127.0.0.1:8000")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0.0.0.0:80", ("0.0.0.0", 80)), ("[::1]:9000", ("::1", 9000)), ("host:0", ("host", 0))],
)
def test_split_host_port(value: str, expected: tuple[str, int]) -> None:
    assert split_host_port(value) == expected


@pytest.mark.parametrize("value", ["host", ":80", "host:", "host:-1", "[zz]:80", "host:65536"])
def test_split_host_port_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(value)


# --- tracing: the OTLP endpoint and service name, also from OpenTelemetry's standard env ------


def test_tracing_is_off_by_default() -> None:
    s = load_settings({})
    assert s.otel_endpoint is None and s.otel_traces_url is None
    assert s.otel_service_name == "pylon"


def test_otel_endpoint_from_flag_env_and_standard_env(
    monkeypatch: pytest.MonkeyPatch, toml
) -> None:
    path = toml('otel_endpoint = "http://file:4318"\notel_service_name = "from-file"\n')
    assert load_settings({}, path).otel_traces_url == "http://file:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://standard:4318")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "standard-name")
    s = load_settings({}, path)  # the standard variables beat the file
    assert s.otel_traces_url == "http://standard:4318/v1/traces"
    assert s.otel_service_name == "standard-name"
    monkeypatch.setenv("PYLON_OTEL_ENDPOINT", "https://pylon-env:4318/prefix")
    monkeypatch.setenv("PYLON_OTEL_SERVICE_NAME", "pylon-env-name")
    s = load_settings({}, path)  # pylon's own variables beat the standard ones
    assert s.otel_traces_url == "https://pylon-env:4318/prefix/v1/traces"
    assert s.otel_service_name == "pylon-env-name"
    s = load_settings({"otel_endpoint": "http://flag:4318/v1/traces/", "otel_service_name": "f"})
    assert s.otel_traces_url == "http://flag:4318/v1/traces"  # already the traces path: kept
    assert s.otel_service_name == "f"


def test_empty_otel_endpoint_turns_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    assert load_settings({}).otel_endpoint is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://standard:4318")
    monkeypatch.setenv("PYLON_OTEL_ENDPOINT", "")  # pylon's own, empty: off despite the standard
    assert load_settings({}).otel_endpoint is None
    assert load_settings({"otel_endpoint": "http://flag:4318"}).otel_endpoint is not None


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318", "(OTEL_EXPORTER_OTLP_ENDPOINT)"),
        ("PYLON_OTEL_ENDPOINT", "grpc://collector:4317", "(PYLON_OTEL_ENDPOINT)"),
        ("PYLON_OTEL_ENDPOINT", "http://c:4318/?a=1", "query or fragment"),
        ("OTEL_SERVICE_NAME", "", None),  # empty: unset, the default applies
    ],
)
def test_bad_otel_values_name_their_source(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, needle: str | None
) -> None:
    monkeypatch.setenv(variable, value)
    if needle is None:
        assert load_settings({}).otel_service_name == "pylon"
        return
    with pytest.raises(SettingsError, match=re.escape(needle)):
        load_settings({})


def test_an_otlp_protocol_pylon_cannot_speak_is_refused_when_tracing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    load_settings({})  # no tracing: the variable concerns someone else
    with pytest.raises(SettingsError, match="OTLP/HTTP"):
        load_settings({"otel_endpoint": "http://c:4318"})
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json"):
        load_settings({"otel_endpoint": "http://c:4318"})


# --- engine bring-up and models ---


def test_bringup_defaults() -> None:
    s = load_settings({})
    assert s.upstream_health_gate is True
    assert s.upstream_health_path == ()
    assert (s.upstream_health_wait, s.upstream_health_interval, s.upstream_health_timeout) == (
        60.0,
        0.5,
        5.0,
    )
    assert s.upstream_health_check_interval == 2.0
    assert s.model == ()  # discovery
    assert (s.model_discovery_interval, s.model_discovery_timeout) == (5.0, 5.0)


def test_repeatable_lists_from_flags_env_and_file(monkeypatch: pytest.MonkeyPatch, toml) -> None:
    s = load_settings({"model": ["a", " b ", "a"], "upstream_health_path": ["/x", "/y", "/x"]})
    assert s.model == ("a", "b")  # trimmed, duplicates collapse, order kept
    assert s.upstream_health_path == ("/x", "/y")
    monkeypatch.setenv("PYLON_MODEL", "llama 3, m2")
    monkeypatch.setenv("PYLON_UPSTREAM_HEALTH_PATH", "/ready")
    s = load_settings({})
    assert s.model == ("llama 3", "m2") and s.upstream_health_path == ("/ready",)
    s = load_settings({}, toml('model = ["from-file"]\n'))
    assert s.model == ("llama 3", "m2")  # env beats file
    monkeypatch.delenv("PYLON_MODEL")
    assert load_settings({}, toml('model = ["from-file"]\n')).model == ("from-file",)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"upstream_health_wait": -1}, "upstream_health_wait"),
        ({"upstream_health_interval": 0}, "upstream_health_interval"),
        ({"upstream_health_timeout": -0.5}, "upstream_health_timeout"),
        ({"upstream_health_check_interval": 0}, "upstream_health_check_interval"),
        ({"model_discovery_interval": -5}, "model_discovery_interval"),
        ({"model_discovery_interval": 0}, "model_discovery_interval"),
        ({"model_discovery_timeout": 0}, "model_discovery_timeout"),
        ({"model": [""]}, "may not be blank"),
        ({"model": ["caf\u00e9"]}, "not a model name"),
        ({"model": ["x" * 257]}, "not a model name"),
        ({"upstream_health_path": ["health"]}, "not a request path"),
        ({"upstream_health_path": ["/a b"]}, "not a request path"),
        ({"upstream_health_path": ["/h#frag"]}, "not a request path"),
        # A combination that would do less than asked.
        ({"model": ["m"], "model_discovery_interval": 1}, "--model-discovery-interval needs"),
        ({"model": ["m"], "model_discovery_timeout": 1}, "--model-discovery-timeout needs"),
        (
            {"upstream_health_gate": False, "upstream_health_path": ["/h"]},
            "--upstream-health-path has no effect with --no-upstream-health-gate",
        ),
        (
            {"upstream_health_gate": False, "upstream_health_wait": 5},
            "--upstream-health-wait has no effect",
        ),
        (
            {"upstream_health_gate": False, "upstream_health_check_interval": 5},
            "--upstream-health-check-interval has no effect",
        ),
    ],
)
def test_bad_bringup_settings_are_refused(overrides: dict, needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        load_settings(overrides)


def test_a_static_set_without_the_gate_is_accepted() -> None:
    s = load_settings({"model": ["m"], "upstream_health_gate": False})
    assert s.model == ("m",) and not s.upstream_health_gate

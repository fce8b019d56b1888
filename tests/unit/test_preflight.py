"""Start-up warnings: what pylon says before it serves, from the settings alone."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from pylon.preflight import (
    StartupError,
    check_files,
    check_tracing,
    config_warnings,
    insecure_listeners,
    is_loopback,
)
from pylon.settings import Settings, SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith(("PYLON_", "OTEL_")):
            monkeypatch.delenv(name)


def settings(**overrides: Any) -> Settings:
    return load_settings(overrides)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("node-7.cluster", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def open_listeners(config: Settings) -> list[str]:
    return [w.fields["listener"] for w in insecure_listeners(config)]


def test_insecure_listeners(tmp_path: Path) -> None:
    token = str(tmp_path / "token")
    ca = {"tls_cert": "/c", "tls_key": "/k", "tls_client_ca": "/ca"}
    assert open_listeners(settings()) == []
    assert open_listeners(settings(listen="0.0.0.0:80")) == ["tcp"]
    assert open_listeners(settings(listen="[::]:80", quic_listen="0.0.0.0:443")) == ["tcp", "quic"]
    assert open_listeners(settings(quic_listen="10.1.2.3:443")) == ["quic"]
    # TLS without client certificates authenticates nobody: still open.
    tls = {"tls_cert": "/c", "tls_key": "/k"}
    assert open_listeners(settings(listen="0.0.0.0:80", **tls)) == ["tcp"]
    # Either credential closes both listeners.
    both = {"listen": "0.0.0.0:80", "quic_listen": "0.0.0.0:443"}
    assert open_listeners(settings(**both, tunnel_token_file=token)) == []
    assert open_listeners(settings(**both, **ca)) == []
    warning = insecure_listeners(settings(listen="0.0.0.0:80"))[0]
    assert warning.event == "insecure_listener" and warning.fields["address"] == "0.0.0.0:80"


def events(config: Settings) -> list[tuple[str, Any]]:
    return [
        (w.event, w.fields.get("setting") or w.fields.get("upstream"))
        for w in config_warnings(config)
    ]


@pytest.mark.parametrize(
    "upstream", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "http://e/x/v1"]
)
def test_upstream_path_ending_in_v1_is_warned_about(upstream: str) -> None:
    (warning,) = config_warnings(settings(upstream=upstream))
    assert warning.event == "upstream_path_v1"
    assert "/v1/v1/" in warning.fields["detail"]


@pytest.mark.parametrize("upstream", ["http://127.0.0.1:8000", "http://e/v1x", "http://e/v2"])
def test_other_upstream_paths_are_fine(upstream: str) -> None:
    assert config_warnings(settings(upstream=upstream)) == []


def test_settings_without_effect_are_named() -> None:
    assert events(settings(quic_retry=False, quic_max_data=100_000)) == [
        ("setting_ignored", "quic_max_data"),
        ("setting_ignored", "quic_retry"),
    ]
    assert events(settings(quic_listen="127.0.0.1:0", quic_retry=False)) == []
    assert events(settings(backend="vllm", sglang_low_priority_first=True)) == [
        ("setting_ignored", "sglang_low_priority_first")
    ]
    assert events(settings(backend="sglang", sglang_low_priority_first=True)) == []
    assert events(settings(derive_priority=False, priority_ceiling=10)) == [
        ("setting_ignored", "priority_ceiling")
    ]
    assert events(settings(backend="passthrough", priority_ceiling=10)) == [
        ("setting_ignored", "priority_ceiling")
    ]
    assert events(settings(retryable_status_codes="", propagate_retry_after=False)) == [
        ("setting_ignored", "propagate_retry_after")
    ]
    assert events(
        settings(queue_admission=False, queue_admission_factor=2, initial_input_tps=100)
    ) == [("setting_ignored", "queue_admission_factor")]
    assert events(settings(queue_admission_min_delta_ms=0, queue_admission_factor=2)) == []
    # Defaults are never "ignored": only what the operator chose.
    assert events(settings(backend="passthrough")) == []


def test_check_files_passes_what_can_be_used(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    check_files(settings(tunnel_token_file=str(token)))
    token.write_text("")
    with pytest.raises(StartupError, match="the file is empty"):
        check_files(settings(tunnel_token_file=str(token)))


def test_tracing_without_the_packages_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    check_tracing(settings())  # off: nothing is imported, nothing is needed
    traced = settings(otel_endpoint="http://127.0.0.1:4318")
    check_tracing(traced)  # the packages are installed here
    # `None` in sys.modules makes an import fail, as on a pylon installed without the extra.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(StartupError, match=r"pip install 'pylon\[otel\]'") as refused:
        check_tracing(traced)
    assert "\n" not in str(refused.value)
    assert "--otel-endpoint http://127.0.0.1:4318/" in str(refused.value)


def test_service_name_without_tracing_is_named() -> None:
    assert events(settings(otel_service_name="svc")) == [("setting_ignored", "otel_service_name")]
    assert events(settings(otel_service_name="svc", otel_endpoint="http://c:4318")) == []


# --- --tokenizer ------------------------------------------------------------------------------

KV_WORKER = "url=http://127.0.0.1:9001,kv-events=tcp://127.0.0.1:5557"


def kv_settings(tokenizer: object, **overrides: Any) -> Settings:
    """--tokenizer is read by the kv router only (any other mode refuses it)."""
    return settings(routing="kv", worker=[KV_WORKER], tokenizer=str(tokenizer), **overrides)


def test_the_tokenizer_is_loaded_once_in_the_backends_dialect(
    tokenizer_models: dict[str, Path],
) -> None:
    from pylon.preflight import load_tokenizer, tokenizer_warnings

    assert load_tokenizer(settings()) is None
    model = tokenizer_models["chatml"]
    for backend in ("dynamo", "vllm", "sglang"):
        tokenizer = load_tokenizer(kv_settings(model, backend=backend))
        assert tokenizer is not None and tokenizer.dialect == backend
        assert tokenizer_warnings(tokenizer) == []
    # The passthrough backend names no engine, so nothing says how it tokenizes.
    with pytest.raises(StartupError, match="--backend passthrough") as refused:
        load_tokenizer(kv_settings(model, backend="passthrough"))
    assert str(refused.value).startswith(f"--tokenizer {model}: ")


def test_a_tokenizer_dir_that_cannot_be_used_is_refused(
    tokenizer_models: dict[str, Path], tmp_path: Path
) -> None:
    from pylon.preflight import load_tokenizer, tokenizer_warnings

    with pytest.raises(StartupError, match=r"has no tokenizer\.json") as refused:
        load_tokenizer(kv_settings(tmp_path))
    assert str(refused.value).startswith(f"--tokenizer {tmp_path}: ")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(
        (tokenizer_models["chatml"] / "tokenizer.json").read_bytes()
    )
    tokenizer = load_tokenizer(kv_settings(bare))
    [warning] = tokenizer_warnings(tokenizer)
    assert warning.event == "tokenizer_without_chat_template"


def test_a_missing_tokenization_package_says_how_to_install(
    tokenizer_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pylon.preflight import load_tokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(StartupError, match=r"'tokenizers' package.*pip install 'pylon\[dynamo\]'"):
        load_tokenizer(kv_settings(tokenizer_models["chatml"]))


def test_worker_health_flags_without_routing_are_named() -> None:
    assert events(settings(worker_eject_after=5, worker_health_path="/ready")) == [
        ("setting_ignored", "worker_health_path"),
        ("setting_ignored", "worker_eject_after"),
    ]
    routed = settings(
        routing="round-robin", worker=["url=http://127.0.0.1:9001"], worker_eject_after=5
    )
    assert events(routed) == []


def test_passive_health_flags_without_routing_and_the_connect_switch_with_it_are_named() -> None:
    assert events(settings(worker_outlier_failures=2, worker_outlier_ejection=1.0)) == [
        ("setting_ignored", "worker_outlier_failures"),
        ("setting_ignored", "worker_outlier_ejection"),
    ]
    workers = {"routing": "least-loaded", "worker": ["url=http://127.0.0.1:9001"]}
    assert events(settings(**workers, worker_outlier_failures=2)) == []
    assert events(settings(**workers, local_connect_failures_retryable=False)) == [
        ("setting_ignored", "local_connect_failures_retryable")
    ]
    assert events(settings(**workers, local_connect_failures_retryable=True)) == []
    with pytest.raises(SettingsError, match="--worker-outlier-max-ejection must be at least"):
        settings(**workers, worker_outlier_ejection=60, worker_outlier_max_ejection=30)


def test_the_kv_overlap_weight_is_for_kv_routing_only() -> None:
    assert ("setting_ignored", "kv_overlap_weight") in events(settings(kv_overlap_weight=8))
    weighted = kv_settings("/", kv_overlap_weight=8)
    assert weighted.kv_overlap_weight == 8.0
    assert ("setting_ignored", "kv_overlap_weight") not in events(weighted)
    for bad in (-1, float("inf"), 1001):
        with pytest.raises(SettingsError, match="kv_overlap_weight"):
            kv_settings("/", kv_overlap_weight=bad)

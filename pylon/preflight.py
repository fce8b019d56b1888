"""What can be checked before any listener starts, so a configuration never silently does less
than asked.

- Refusals (`StartupError`, one line; `pylon serve` exits 2): a certificate, key or client CA
  file that is missing, unreadable, not PEM, mismatched or expired, a tunnel token file that
  cannot be used, tracing asked for without the OpenTelemetry packages installed, a
  `--tokenizer` model dir that cannot be loaded (`load_tokenizer`, which also hands the loaded
  tokenizer on, so it is loaded once), and `--routing kv` without what it needs (the `dynamo`
  extra: Dynamo's native selection core and xxhash; a `--tokenizer` directory).
  (Settings that contradict each other are refused earlier, by `Settings`.)
- Warnings (process events, logged at warning): a listener off loopback that any client may use
  (`insecure_listener`), an upstream URL whose path ends in `/v1` (`upstream_path_v1`), a setting
  that has no effect with the others (`setting_ignored`).

Pure checks of files and settings: `pylon.run.start` runs them before it starts anything.
"""

from __future__ import annotations

import importlib
import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pylon.settings import Settings, split_host_port
from pylon.startup import StartupError as StartupError  # re-exported: where refusals came from

if TYPE_CHECKING:
    from pylon.tokenize import Tokenizer


@dataclass(frozen=True, slots=True)
class StartupWarning:
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


def check_files(settings: Settings) -> None:
    """Refuse what the TLS and token files cannot deliver, before any listener starts."""
    if settings.tunnel_token_file is not None:
        _check_token_file(settings.tunnel_token_file)
    if settings.tls_cert is not None and settings.tls_key is not None:
        _check_identity(settings.tls_cert, settings.tls_key)
    if settings.tls_client_ca is not None:
        _check_client_ca(settings.tls_client_ca)
    if settings.gateway_token_file is not None:
        _check_gateway_token_file(settings.gateway_token_file)
    if settings.gateway_ca is not None:
        _check_gateway_ca(settings.gateway_ca)
    _check_registered_url(settings)


# What `pylon.otel` imports: the SDK and the OTLP/HTTP exporter (the `otel` extra).
_TRACING_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


def check_tracing(settings: Settings) -> None:
    """Refuse tracing that cannot export: an OTLP endpoint without the packages to reach it."""
    if settings.otel_endpoint is None:
        return
    for module in _TRACING_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise StartupError(
                f"--otel-endpoint {settings.otel_endpoint} (or OTEL_EXPORTER_OTLP_ENDPOINT): "
                f"tracing needs the OpenTelemetry SDK and OTLP exporter, and {module} cannot be "
                f"imported ({exc}); install them with: pip install 'pylon[otel]'"
            ) from None


def load_tokenizer(settings: Settings) -> Tokenizer | None:
    """The `--tokenizer` model dir, loaded once, in the dialect of `--backend`; None without
    one. Refuses a directory that cannot be used, a missing package, and the passthrough backend
    (pylon cannot know how an unknown engine tokenizes)."""
    directory = settings.tokenizer
    if directory is None:
        return None
    flag = f"--tokenizer {directory}"
    if settings.backend == "passthrough":
        raise StartupError(
            f"{flag}: --backend passthrough does not say how the engine tokenizes; name the "
            "engine with --backend dynamo, vllm or sglang"
        )
    from pylon.tokenize import Tokenizer, TokenizerError, TokenizerUnavailable

    try:
        return Tokenizer(directory, dialect=settings.backend)
    except TokenizerUnavailable as exc:
        raise StartupError(
            f"{flag}: tokenization needs the '{exc.package}' package, which cannot be "
            "imported; install it with: pip install 'pylon[dynamo]'"
        ) from None
    except TokenizerError as exc:
        raise StartupError(f"{flag}: {exc}") from None


def tokenizer_warnings(tokenizer: Tokenizer | None) -> list[StartupWarning]:
    """What a loaded tokenizer will not do: a model dir without a chat template tokenizes
    completions only (every chat is routed without the cache view)."""
    if tokenizer is None or tokenizer.has_chat_template:
        return []
    return [
        StartupWarning(
            "tokenizer_without_chat_template",
            {
                "tokenizer": str(tokenizer.directory),
                "detail": "the model dir has no chat template (tokenizer_config.json "
                "chat_template, or chat_template.jinja): chat requests are not tokenized",
            },
        )
    ]


def check_routing(settings: Settings) -> None:
    """Refuse `--routing kv` where it cannot work: without the `dynamo` extra (Dynamo's native
    selection core, xxhash for block hashes), or with a `--tokenizer` that is not a directory
    (the tokenizer itself is then loaded by `load_tokenizer`). Every other mode needs none of
    it."""
    if settings.routing != "kv":
        return
    tokenizer = settings.tokenizer  # first: the one refusal that does not depend on the install
    if tokenizer is not None and not tokenizer.is_dir():
        why = "no such directory" if not tokenizer.exists() else "not a directory"
        raise StartupError(f"--tokenizer {tokenizer}: {why}")
    from pylon.core.blocks import HashingUnavailable, ensure_available
    from router_ffi import INSTALL_HINT, NativeUnavailable
    from router_ffi._native import load_native

    try:
        load_native()
    except NativeUnavailable as exc:
        raise StartupError(f"--routing kv: {_one_line(str(exc))}") from None
    try:
        ensure_available()
    except HashingUnavailable as exc:
        raise StartupError(
            f"--routing kv: block hashing needs xxhash ({_one_line(str(exc))}): {INSTALL_HINT}"
        ) from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StartupError(f"{flag} {path}: no such file") from None
    except IsADirectoryError:
        raise StartupError(f"{flag} {path}: is a directory, not a file") from None
    except PermissionError:
        raise StartupError(f"{flag} {path}: permission denied") from None
    except OSError as exc:
        raise StartupError(f"{flag} {path}: cannot be read ({exc.strerror or exc})") from None


def _check_token_file(path: Path) -> None:
    from pylon.auth import TokenAuth, TokenFileError

    token = _read("--tunnel-token-file", path).strip()
    if not token:
        raise StartupError(f"--tunnel-token-file {path}: the file is empty")
    if b"\n" in token or b"\r" in token:
        raise StartupError(f"--tunnel-token-file {path}: the token must be a single line")
    try:
        TokenAuth(path)  # the same reading the running daemon does
    except TokenFileError as exc:
        raise StartupError(f"--tunnel-token-file {path}: {exc}") from None


def _check_identity(cert: Path, key: Path) -> None:
    from pylon.tls import TlsMaterialError, build_server_ssl_context, parse_material

    cert_pem = _read("--tls-cert", cert)
    key_pem = _read("--tls-key", key)
    try:
        material = parse_material(cert_pem, key_pem)
    except TlsMaterialError as exc:
        raise StartupError(f"--tls-cert {cert} / --tls-key {key}: {exc}") from None
    try:
        build_server_ssl_context(material)  # what OpenSSL will serve on TCP
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc.strerror or "refused"
        raise StartupError(f"--tls-cert {cert} / --tls-key {key}: OpenSSL: {reason}") from None


def _check_client_ca(path: Path) -> None:
    from pylon.tls import TlsMaterialError, check_client_ca

    data = _read("--tls-client-ca", path)
    try:
        check_client_ca(data, path)
    except TlsMaterialError as exc:
        raise StartupError(f"--tls-client-ca {path}: {exc}") from None


def _check_gateway_token_file(path: Path) -> None:
    """The token pylon presents to the gateway: one non-empty line (re-read at every use, so
    this only refuses a start that could not register at all)."""
    token = _read("--gateway-token-file", path).strip()
    if not token:
        raise StartupError(f"--gateway-token-file {path}: the file is empty")
    if b"\n" in token or b"\r" in token:
        raise StartupError(f"--gateway-token-file {path}: the token must be a single line")
    try:
        token.decode("ascii")
    except UnicodeDecodeError:
        raise StartupError(f"--gateway-token-file {path}: the token must be ASCII") from None


def _check_gateway_ca(path: Path) -> None:
    """The bundle the gateway's certificate is verified against: the same check every dial
    makes (PEM certificates, a CA among them), and OpenSSL loads it (the reference Pylon reads
    it only at the first dial, so a bad one failed late)."""
    from pylon.gateway.tunnel import load_gateway_ca

    try:
        load_gateway_ca(path)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=str(path))
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc.strerror or "refused"
        raise StartupError(f"--gateway-ca {path}: OpenSSL refused it ({reason})") from None


def registered_url(settings: Settings, quic_address: str | None) -> str:
    """The URL registered with the gateway: `--inference-server-url`, or in direct mode
    quic://HOST:PORT of the UDP listener as bound (`quic_address`: a port 0 resolved); in
    reverse mode nothing is dialled, so none ("")."""
    if settings.inference_server_url is not None:
        return settings.inference_server_url
    if settings.connectivity == "reverse" or quic_address is None:
        return ""
    return f"quic://{quic_address}"


def _check_registered_url(settings: Settings) -> None:
    """Direct mode registers where the gateway dials: refuse to advertise what cannot be."""
    if not settings.gateway or settings.connectivity == "reverse":
        return
    if settings.inference_server_url is not None:
        return
    if settings.quic_listen is None:
        raise StartupError(
            "--gateway in direct mode needs --quic-listen (the gateway dials pylon over "
            "HTTP/3) or --inference-server-url saying where the gateway reaches this node"
        )
    host, _ = split_host_port(settings.quic_listen)
    if host in ("0.0.0.0", "::", ""):
        raise StartupError(
            f"--gateway in direct mode would register quic://{settings.quic_listen}, which the "
            "gateway cannot dial (a wildcard address): give --inference-server-url"
        )


# --- warnings -------------------------------------------------------------------------------

_QUIC_TUNING = (
    "quic_idle_timeout",
    "quic_max_data",
    "quic_max_stream_data",
    "quic_max_concurrent_streams",
    "quic_retry",
)
_RETRY_TUNING = ("require_upstream_retry_header", "upstream_retry_header", "propagate_retry_after")
_QUEUE_TUNING = (
    "queue_admission_min_delta_ms",
    "queue_admission_factor",
    "queue_admission_retry_after_ms",
)
_WORKER_HEALTH_TUNING = (
    "worker_health_path",
    "worker_health_interval",
    "worker_health_timeout",
    "worker_eject_after",
    "worker_readmit_after",
    "worker_outlier_failures",
    "worker_outlier_ejection",
    "worker_outlier_max_ejection",
    "worker_outlier_max_percent",
)


def config_warnings(settings: Settings) -> list[StartupWarning]:
    """Settings that will not do what they say, short of a refusal."""
    warnings: list[StartupWarning] = []
    if settings.gateway_insecure:
        warnings.append(
            StartupWarning(
                "gateway_insecure",
                {
                    "detail": "--gateway-insecure: the gateway's certificate is not verified on "
                    "reverse tunnels, so anyone on the path can pose as the gateway and receive "
                    "the node's token and send it requests; give --gateway-ca instead"
                },
            )
        )
    if settings.upstream is not None:
        path = (settings.upstream.path or "").rstrip("/")
        if path.endswith("/v1"):
            warnings.append(
                StartupWarning(
                    "upstream_path_v1",
                    {
                        "upstream": str(settings.upstream),
                        "detail": "pylon appends the request path to the upstream URL, so "
                        "requests would go to /v1/v1/...; give the engine's base URL without /v1",
                    },
                )
            )
    chosen = settings.model_fields_set

    def ignored(name: str, reason: str) -> None:
        if name in chosen:
            warnings.append(StartupWarning("setting_ignored", {"setting": name, "reason": reason}))

    if settings.quic_listen is None:
        for name in (*_QUIC_TUNING, "tls_self_signed_cert_file"):
            ignored(name, "no --quic-listen: there is no QUIC listener")
    if settings.backend != "sglang":
        ignored(
            "sglang_low_priority_first",
            f"only the sglang backend reads it (backend is {settings.backend})",
        )
    if not settings.derive_priority or settings.backend == "passthrough":
        for name in ("priority_ceiling", "sglang_low_priority_first"):
            ignored(name, "no priority is derived (--no-derive-priority or backend passthrough)")
    if settings.otel_endpoint is None:
        ignored(
            "otel_service_name",
            "no --otel-endpoint (nor OTEL_EXPORTER_OTLP_ENDPOINT): there is no tracing",
        )
    if not settings.retryable_status_codes:
        for name in _RETRY_TUNING:
            ignored(name, "--retryable-status-codes is empty: no engine status is retryable")
    if not settings.queue_admission:
        for name in _QUEUE_TUNING:
            ignored(name, "--no-queue-admission: no request is refused for its queue estimate")
    if settings.routing == "off":
        for name in _WORKER_HEALTH_TUNING:
            ignored(name, "--routing off: there are no workers to check")
    elif not settings.local_connect_failures_retryable:
        ignored(
            "local_connect_failures_retryable",
            f"--routing {settings.routing}: a request no worker could be reached for is always "
            "retryable (no engine saw it)",
        )
    if settings.routing != "kv":
        ignored("kv_overlap_weight", "only --routing kv weighs cached prefixes")
    if settings.workers_file is None and not settings.discover_instances:
        ignored(
            "workers_file_interval",
            "no --workers-file nor --discover-instances: the worker catalogue is not re-read",
        )
    return warnings


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host` (an unresolved name other than localhost: no)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_listeners(settings: Settings) -> list[StartupWarning]:
    """Listeners reachable from other machines that accept any client: neither mTLS nor a
    tunnel token."""
    token = settings.tunnel_token_file is not None
    mtls = settings.tls_client_ca is not None  # Settings makes it imply --tls-cert
    detail = (
        "listening beyond loopback with neither --tls-client-ca nor --tunnel-token-file: any "
        "client that reaches this address can use the engine"
    )
    warnings = []
    listeners = [("tcp", settings.listen)]
    if settings.quic_listen is not None:
        listeners.append(("quic", settings.quic_listen))
    for listener, address in listeners:
        host, _ = split_host_port(address)
        if not is_loopback(host) and not token and not mtls:
            warnings.append(
                StartupWarning(
                    "insecure_listener",
                    {"listener": listener, "address": address, "detail": detail},
                )
            )
    return warnings

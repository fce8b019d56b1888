"""The deployment files in deploy/ run what exists and mean what pylon does:

- deploy/pylon.toml: `pylon config --config` accepts it, and so do `pylon serve`'s start-up
  checks (its TLS files replaced by real ones);
- deploy/systemd/pylon.service: `systemd-analyze verify` accepts it with no warning (a broken
  copy fails the same check), and its reload, stop and restart settings match pylon's signals,
  drain and exit statuses, and `systemd-analyze security` rates it "OK";
- deploy/kubernetes/pylon-daemonset.yaml: valid against the Kubernetes schemas
  (kubernetes-validate, strict), and its probes, ports and grace period match the settings pylon
  really runs with there (the image's environment, the container's, the ConfigMap's TOML);
- deploy/grafana/pylon-dashboard.json and deploy/prometheus/pylon-alerts.yaml: every metric
  they name is one pylon exposes (pylon/metrics/catalogue.py), with the labels it has;
  `promtool check rules` parses every expression and `promtool test rules` says when each
  tested alert fires.

A tool that is not installed skips its test with the reason; `.ci/run` installs them all.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.serialization import Encoding
from prometheus_client.registry import CollectorRegistry
from typer.testing import CliRunner

from pylon import signals as pylon_signals
from pylon.admin import AdminRoutes
from pylon.cli import app as pylon_app
from pylon.lifecycle import Lifecycle
from pylon.metrics.catalogue import METRICS, STATUS_CLASS
from pylon.preflight import check_files, check_routing, config_warnings, insecure_listeners
from pylon.run import EXIT_ENGINE_NOT_READY
from pylon.settings import Settings, load_settings, split_host_port
from tests.certs import make_ca, make_leaf, write_pair
from tests.unit.test_container_files import STAGES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SAMPLE = DEPLOY / "pylon.toml"
UNIT = DEPLOY / "systemd" / "pylon.service"
MANIFEST = DEPLOY / "kubernetes" / "pylon-daemonset.yaml"
DASHBOARD = DEPLOY / "grafana" / "pylon-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "pylon-alerts.yaml"
ALERT_TESTS = DEPLOY / "prometheus" / "pylon-alerts.test.yaml"
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

# What an operator sets on a node; the sample shows each.
OPERATOR_SETTINGS = {
    "listen",
    "quic_listen",
    "admin_listen",
    "backend",
    "upstream",
    "routing",
    "worker",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "shutdown_grace",
    "log_level",
}


@pytest.fixture(autouse=True)
def _no_pylon_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are read as a node would: no PYLON_* variable of the test run's (conftest
    sets one) beats what they say."""
    for key in [k for k in os.environ if k.upper().startswith("PYLON_")]:
        monkeypatch.delenv(key)


def sample_settings() -> Settings:
    return load_settings({}, SAMPLE)


def sample_table() -> dict[str, Any]:
    return tomllib.loads(SAMPLE.read_text())


# --- deploy/pylon.toml ---


def test_sample_config_sets_what_an_operator_sets_on_a_node() -> None:
    assert set(sample_table()) >= OPERATOR_SETTINGS


def test_pylon_config_accepts_the_sample() -> None:
    result = CliRunner().invoke(pylon_app, ["config", "--config", str(SAMPLE)], env={})
    assert result.exit_code == 0, result.output


def test_pylon_serve_start_checks_accept_the_sample(tmp_path: Path) -> None:
    """What `serve` checks beyond `config`: the TLS files (real ones in place of the sample's
    paths, which exist on a node only) and the routing mode's needs; and it starts with no
    warning (a listener beyond loopback has mutual TLS)."""
    ca = make_ca()
    cert, key = write_pair(tmp_path, make_leaf(ca))
    client_ca = tmp_path / "ca.crt"
    client_ca.write_bytes(ca[0].public_bytes(Encoding.PEM))
    settings = load_settings(
        {"tls_cert": str(cert), "tls_key": str(key), "tls_client_ca": str(client_ca)}, SAMPLE
    )
    check_files(settings)
    check_routing(settings)
    assert settings.routing != "off" and len(settings.worker) >= 2
    assert config_warnings(settings) == [] and insecure_listeners(settings) == []


# --- deploy/systemd/pylon.service ---


def read_unit(text: str) -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string(text)
    return unit


SERVICE = read_unit(UNIT.read_text())["Service"]


def systemd_analyze(command: str, text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze COMMAND` on a copy of the unit whose ExecStart runs this interpreter's
    pylon (verify refuses a binary that is not there)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    binary = SERVICE["ExecStart"].split()[0]
    copy = tmp_path / UNIT.name  # the same name: systemd reads the unit's name from it
    copy.write_text(text.replace(f"ExecStart={binary}", f"ExecStart={sys.executable} -m pylon"))
    argv = [tool, *command.split(), str(copy)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def verify_unit(text: str, tmp_path: Path) -> str:
    """What `systemd-analyze verify` says about the unit, '' when it has no complaint. Every
    complaint counts: a misspelt key or a bad value is only a warning to systemd."""
    result = systemd_analyze("verify --man=no", text, tmp_path)
    complaints = (result.stdout + result.stderr).strip()
    if result.returncode != 0 and not complaints:
        complaints = f"exit status {result.returncode}"
    return complaints


def unit_exposure_fits(text: str, tmp_path: Path) -> bool:
    """Does `systemd-analyze security` rate the unit's exposure at most 2.0 of 10 ("OK")?"""
    # --threshold counts tenths of the 0-10 scale the report prints.
    command = "security --offline=yes --threshold=20 --no-pager"
    return systemd_analyze(command, text, tmp_path).returncode == 0


def test_systemd_analyze_security_rates_the_unit_ok(tmp_path: Path) -> None:
    assert unit_exposure_fits(UNIT.read_text(), tmp_path)
    weak = [line for line in UNIT.read_text().splitlines() if not line.startswith("Protect")]
    assert not unit_exposure_fits("\n".join(weak), tmp_path)


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    assert verify_unit(UNIT.read_text(), tmp_path) == ""


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("KillMode=mixed", "KillMode=mixd"),  # a bad value: systemd ignores it, with a warning
        ("TimeoutStopSec=", "TimeoutStopSecs="),  # a misspelt key
        ("Type=exec", "Type=exec\nExecStartPre=/nonexistent/pylon-check"),  # no such binary
    ],
)
def test_systemd_analyze_verify_fails_a_broken_unit(old: str, new: str, tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert old in text
    assert verify_unit(text.replace(old, new, 1), tmp_path) != ""


def test_unit_runs_pylon_serve_with_the_sample_config() -> None:
    argv = SERVICE["ExecStart"].split()
    assert Path(argv[0]).name in SCRIPTS and argv[1] == "serve"
    assert argv[2:] == ["--config", "/etc/pylon/pylon.toml"]
    result = CliRunner().invoke(pylon_app, ["config", "--config", str(SAMPLE)], env={})
    assert result.exit_code == 0, result.output
    # pylon has no sd_notify: a Type=notify unit would wait for a message that never comes.
    assert not any("NOTIFY_SOCKET" in p.read_text() for p in (ROOT / "pylon").rglob("*.py"))
    assert SERVICE["Type"] == "exec"


def test_unit_reload_and_stop_are_pylons_signals() -> None:
    assert SERVICE["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert pylon_signals.RELOAD == signal.SIGHUP
    assert signal.Signals[SERVICE["KillSignal"]] in pylon_signals.STOP
    # mixed: the stop signal to the main process only (a supervisor drains its children),
    # the final SIGKILL to every process left.
    assert SERVICE["KillMode"] == "mixed"
    assert float(SERVICE["TimeoutStopSec"]) > sample_settings().shutdown_grace


def test_unit_does_not_restart_a_refused_start() -> None:
    refused = CliRunner().invoke(pylon_app, ["serve", "--listen", "no-port"], env={})
    assert refused.exit_code == 2, refused.output  # a refused start's status
    assert SERVICE["Restart"] == "on-failure"
    prevent = {int(status) for status in SERVICE["RestartPreventExitStatus"].split()}
    assert prevent == {refused.exit_code}
    assert EXIT_ENGINE_NOT_READY not in prevent  # the engine may come up: restart


def test_unit_is_hardened() -> None:
    assert SERVICE.get("User") not in (None, "", "root", "0") or SERVICE.get("DynamicUser") == "yes"
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }.items():
        assert SERVICE.get(key) == value, key
    settings = sample_settings()
    addresses = [settings.listen, settings.quic_listen or "", settings.admin_listen]
    if all(split_host_port(a)[1] >= 1024 for a in addresses if a):
        assert SERVICE["CapabilityBoundingSet"] == "" and SERVICE["AmbientCapabilities"] == ""
    # Every engine connection and a client's each take a descriptor.
    assert int(SERVICE["LimitNOFILE"]) > 2 * settings.upstream_max_connections


# --- deploy/kubernetes/pylon-daemonset.yaml ---

MANIFEST_DOCS: list[dict[str, Any]] = list(yaml.safe_load_all(MANIFEST.read_text()))
DAEMONSET = next(d for d in MANIFEST_DOCS if d["kind"] == "DaemonSet")
CONFIGMAP = next(d for d in MANIFEST_DOCS if d["kind"] == "ConfigMap")
POD = DAEMONSET["spec"]["template"]["spec"]
CONTAINER = next(c for c in POD["containers"] if c["name"] == "pylon")
K8S_VERSIONS = ("1.28", "latest")  # the oldest release still common, and the newest bundled


def kubernetes_validate() -> Any:
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the dev extra)"
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", [d["kind"] for d in MANIFEST_DOCS])
def test_manifest_is_valid_against_the_kubernetes_schemas(kind: str, version: str) -> None:
    kv = kubernetes_validate()
    version = kv.latest_version() if version == "latest" else version
    doc = next(d for d in MANIFEST_DOCS if d["kind"] == kind)
    kv.validate(doc, version, strict=True)  # strict: an unknown field is an error


def test_kubernetes_validate_fails_a_broken_manifest() -> None:
    kv = kubernetes_validate()
    broken = yaml.safe_load(yaml.safe_dump(DAEMONSET))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.28", strict=True)


@pytest.fixture
def pod_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings pylon runs with in the pod: the image's PYLON_* environment, then the
    container's (which beats it), its arguments, and the ConfigMap's pylon.toml where the
    arguments say."""
    args = CONTAINER["args"]
    assert args[:2] == ["serve", "--config"] and len(args) == 3
    mount = next(m for m in CONTAINER["volumeMounts"] if m["mountPath"] == args[2])
    volume = next(v for v in POD["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == CONFIGMAP["metadata"]["name"]
    config = tmp_path / mount["subPath"]
    config.write_text(CONFIGMAP["data"][mount["subPath"]])
    env = {k: v for k, v in STAGES["runtime"].env.items() if k.startswith("PYLON_")}
    env |= {e["name"]: e["value"] for e in CONTAINER.get("env", [])}
    result = CliRunner().invoke(pylon_app, ["config", "--config", str(config)], env=env)
    assert result.exit_code == 0, result.output
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_settings({}, config)


def _port(name_or_number: str | int) -> dict[str, Any]:
    return next(
        p for p in CONTAINER["ports"] if name_or_number in (p.get("name"), p["containerPort"])
    )


def _routes() -> AdminRoutes:
    return AdminRoutes(Lifecycle(), CollectorRegistry())


def test_probes_ask_pylons_admin_listener(pod_settings: Settings) -> None:
    admin_host, admin_port = split_host_port(pod_settings.admin_listen)
    assert admin_host not in ("127.0.0.1", "::1", "localhost")  # the kubelet probes the pod's IP
    live, ready = CONTAINER["livenessProbe"]["httpGet"], CONTAINER["readinessProbe"]["httpGet"]
    for probe in (live, ready):
        assert _port(probe["port"])["containerPort"] == admin_port
        assert probe.get("scheme", "HTTP") == "HTTP"  # the admin listener is plain HTTP
    # A starting pylon: alive, and not ready (the probe holds traffic back).
    assert _routes().answer("GET", live["path"], "").status == 200
    assert _routes().answer("GET", ready["path"], "").status == 503
    assert (live["path"], ready["path"]) == ("/live", "/ready")


def test_pod_starts_with_no_warning(pod_settings: Settings) -> None:
    assert config_warnings(pod_settings) == [] and insecure_listeners(pod_settings) == []


def test_ports_are_pylons_listeners(pod_settings: Settings) -> None:
    _, tcp = split_host_port(pod_settings.listen)
    assert pod_settings.quic_listen is not None
    _, udp = split_host_port(pod_settings.quic_listen)
    assert _port("tunnel") == {**_port("tunnel"), "containerPort": tcp, "protocol": "TCP"}
    assert _port("tunnel-quic") == {**_port("tunnel-quic"), "containerPort": udp, "protocol": "UDP"}
    assert POD["hostNetwork"] is True
    for port in CONTAINER["ports"]:
        assert port["hostPort"] == port["containerPort"] >= 1024  # no capability needed


def test_pod_drains_before_the_kill_and_is_locked_down(pod_settings: Settings) -> None:
    assert POD["terminationGracePeriodSeconds"] > pod_settings.shutdown_grace
    uid = re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert uid is not None and POD["securityContext"]["runAsUser"] == int(uid.group(1))
    assert POD["securityContext"]["runAsNonRoot"] is True
    assert CONTAINER["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {"requests", "limits"} <= set(CONTAINER["resources"])
    tls = next(m for m in CONTAINER["volumeMounts"] if m["name"] == "tls")["mountPath"]
    for path in (pod_settings.tls_cert, pod_settings.tls_key, pod_settings.tls_client_ca):
        assert path is not None and Path(path).parent == Path(tls)


def test_configmap_is_the_sample_but_the_admin_address() -> None:
    pod = tomllib.loads(CONFIGMAP["data"]["pylon.toml"])
    sample = sample_table()
    differs = {key for key in pod if pod[key] != sample.get(key)}
    assert differs == {"admin_listen"}


# --- metric names in the dashboard and the alert rules ---


def exposed_series() -> dict[str, set[str]]:
    """Every series name pylon's /metrics can carry -> the labels it has (`le` on buckets)."""
    series: dict[str, set[str]] = {}
    for spec in METRICS:
        if spec.kind == "histogram":
            series[f"{spec.name}_bucket"] = {*spec.labels, "le"}
            series[f"{spec.name}_sum"] = set(spec.labels)
            series[f"{spec.name}_count"] = set(spec.labels)
        else:
            series[spec.name] = set(spec.labels)
    return series


def supervisor_series() -> dict[str, set[str]]:
    """The `--processes N` supervisor's own families (its exposition, parsed), name -> labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from pylon.supervisor.metrics import SupervisorCounts, supervisor_exposition

    text = supervisor_exposition(SupervisorCounts(2, (True, False), {"exit": 1, "signal": 2}))
    return {
        sample.name: set(sample.labels)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


TARGET_LABELS = {"job", "instance"}  # Prometheus adds them at scrape time
_METRIC = re.compile(r"\bpylon_[a-z0-9_]+\b")
_SELECTOR = re.compile(r"\b(pylon_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def known_series() -> dict[str, set[str]]:
    # With --processes N the supervisor's scrape labels every process's sample `process`.
    processes = {name: {*labels, "process"} for name, labels in exposed_series().items()}
    return {**processes, **supervisor_series()}


def metric_problems(text: str) -> list[str]:
    """What in `text` names a series pylon does not expose."""
    known = known_series()
    return [f"{name}: not a metric of pylon" for name in _METRIC.findall(text) if name not in known]


def expression_problems(expr: str, legend: str = "") -> list[str]:
    """What in a PromQL expression does not exist: metrics, their labels, grouping labels, the
    values of bounded labels, and the labels a legend shows."""
    problems = metric_problems(expr)
    known = known_series()
    names = [n for n in _METRIC.findall(expr) if n in known]
    union = set().union(TARGET_LABELS, *(known[n] for n in names))
    for name, matchers in _SELECTOR.findall(expr):
        for label, _op, value in _MATCHER.findall(matchers):
            if label not in known.get(name, set()) | TARGET_LABELS:
                problems.append(f"{name} has no label {label!r}")
            if label == "status_class" and value not in STATUS_CLASS.values():
                problems.append(f"status_class {value!r} is never exposed")
    for group in _GROUPING.findall(expr):
        for label in filter(None, (g.strip() for g in group.split(","))):
            if label not in union:
                problems.append(f"grouped by {label!r}, a label none of {names} has")
    for label in _LEGEND.findall(legend):
        if label not in union:
            problems.append(f"legend shows {label!r}, a label none of {names} has")
    return problems


def test_expression_check_catches_what_does_not_exist() -> None:
    assert (
        expression_problems("sum by (le) (rate(pylon_request_duration_seconds_bucket[5m]))") == []
    )
    assert expression_problems("rate(pylon_requests_totals[5m])")  # a renamed metric
    assert expression_problems('pylon_requests_total{status="500"}')  # a label it lacks
    assert expression_problems('pylon_requests_total{status_class="500"}')  # a value it lacks
    assert expression_problems("sum by (worker) (pylon_requests_total)")  # grouping
    assert expression_problems("pylon_ready", "{{worker}}")  # a legend


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


DASHBOARD_JSON: dict[str, Any] = json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in DASHBOARD_JSON["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return panels


def dashboard_targets() -> list[dict[str, Any]]:
    return [t for p in dashboard_panels() for t in p.get("targets", [])]


def test_dashboard_names_only_pylons_metrics() -> None:
    problems = [
        f"{target['expr']}: {problem}"
        for target in dashboard_targets()
        for problem in expression_problems(target["expr"], target.get("legendFormat", ""))
    ]
    problems += [p for text in _strings(DASHBOARD_JSON) for p in metric_problems(text)]
    assert problems == []


def test_dashboard_shows_each_topic() -> None:
    shown = {name for t in dashboard_targets() for name in _METRIC.findall(t["expr"])}
    for metric in (
        "pylon_requests_total",  # by status and transport
        "pylon_request_time_to_first_output_seconds_bucket",
        "pylon_request_duration_seconds_bucket",
        "pylon_queue_admission_decisions_total",
        "pylon_queue_estimate_milliseconds",
        "pylon_router_worker_healthy",  # in rotation
        "pylon_router_active_bookings",
        "pylon_transport_events_total",  # flood guards
        "pylon_ready",
        "pylon_upstream_errors_total",
    ):
        assert metric in shown, metric


def test_dashboard_layout() -> None:
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return found


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    """Each expression becomes a recording rule, Grafana's variables given values first."""
    values = {"$__rate_interval": "5m", "$job": ".*", "$instance": ".*"}
    rules = []
    for i, target in enumerate(dashboard_targets()):
        expr = target["expr"]
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"an unknown variable in {target['expr']}"
        rules.append({"record": f"pylon:dashboard_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


ALERT_RULES: dict[str, Any] = yaml.safe_load(ALERTS.read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in ALERT_RULES["groups"] for rule in group["rules"]]


def test_promtool_check_rules_accepts_the_alerts() -> None:
    result = _promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules_fails_a_broken_rule(tmp_path: Path) -> None:
    broken = tmp_path / ALERTS.name
    broken.write_text(ALERTS.read_text().replace("expr: pylon_ready == 0", "expr: pylon_ready =="))
    assert _promtool("check", "rules", str(broken)).returncode != 0


def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    result = _promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        case["alertname"]
        for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert {"PylonNotReady", "PylonNoWorkerInRotation", "PylonHigh5xxRatio"} <= tested


def test_alerts_name_only_pylons_metrics() -> None:
    problems = [f"{r['alert']}: {p}" for r in alert_rules() for p in expression_problems(r["expr"])]
    problems += [p for text in _strings(ALERT_RULES) for p in metric_problems(text)]
    assert problems == []


def test_alerts_cover_each_failure() -> None:
    assert {r["alert"] for r in alert_rules()} >= {
        "PylonScrapeDown",
        "PylonNotReady",
        "PylonReadinessFlapping",
        "PylonNoWorkerInRotation",
        "PylonHigh5xxRatio",
        "PylonAdmissionRefusals",
        "PylonProcessRestarts",
    }
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]

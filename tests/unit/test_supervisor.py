"""The pure parts of `pylon serve --processes N` (`pylon.supervisor`): the restart backoff, the
metrics merge (checked against prometheus_client's own parser), the handover's settings
(rebuilt from the handed values alone, never from the environment), the `processes` bounds."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from pylon.settings import SettingsError, load_settings
from pylon.supervisor.backoff import Backoff, halt_status
from pylon.supervisor.handover import Handover, child_command, settings_values
from pylon.supervisor.metrics import (
    SupervisorCounts,
    labelled,
    merge_expositions,
    supervisor_exposition,
)

# --- backoff --------------------------------------------------------------------------------


def test_restart_delays_double_from_half_a_second_to_thirty() -> None:
    backoff = Backoff()
    delays = [backoff.after_exit(uptime=1.0) for _ in range(10)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0, 30.0]


def test_a_process_that_stayed_up_a_minute_starts_the_sequence_afresh() -> None:
    backoff = Backoff()
    for _ in range(5):
        backoff.after_exit(uptime=0.1)
    assert backoff.after_exit(uptime=59.9) == 16.0
    assert backoff.after_exit(uptime=60.0) == 0.5
    assert backoff.after_exit(uptime=3.0) == 1.0


def test_a_backoff_that_could_not_wait_is_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(first=0.0)
    with pytest.raises(ValueError):
        Backoff(first=10.0, cap=1.0)


@given(st.lists(st.floats(min_value=0, max_value=1000), max_size=50))
def test_every_delay_stays_within_first_and_cap(uptimes: list[float]) -> None:
    backoff = Backoff()
    for uptime in uptimes:
        assert 0.5 <= backoff.after_exit(uptime) <= 30.0


def test_a_refused_start_halts_the_node_and_an_unready_engine_only_before_the_first_ready() -> None:
    assert halt_status(2, ever_ready=False) == 2
    assert halt_status(2, ever_ready=True) == 2
    assert halt_status(1, ever_ready=False) == 1
    assert halt_status(1, ever_ready=True) is None  # the engine may come back
    for status in (0, 3, 70, 137, -9, -15):  # a crash, a signal, an unasked clean exit
        assert halt_status(status, ever_ready=False) is None


# --- metrics merge --------------------------------------------------------------------------

PROCESS_0 = """\
# HELP pylon_requests_total requests answered
# TYPE pylon_requests_total counter
pylon_requests_total{model="m",status_class="2xx"} 3.0
pylon_requests_created{model="m",status_class="2xx"} 1.7e+09
# HELP pylon_ready 1 while ready
# TYPE pylon_ready gauge
pylon_ready 1.0
# HELP pylon_latency_seconds latency
# TYPE pylon_latency_seconds histogram
pylon_latency_seconds_bucket{le="0.1"} 1.0
pylon_latency_seconds_bucket{le="+Inf"} 2.0
pylon_latency_seconds_count 2.0
pylon_latency_seconds_sum 0.3
"""
PROCESS_1 = """\
# HELP pylon_ready 1 while ready
# TYPE pylon_ready gauge
pylon_ready 0.0
# HELP pylon_requests_total requests answered
# TYPE pylon_requests_total counter
pylon_requests_total{model="m",status_class="2xx"} 5.0
"""


def test_families_are_merged_with_help_and_type_once_and_every_sample_labelled() -> None:
    merged = merge_expositions([("0", PROCESS_0), ("1", PROCESS_1)])
    assert merged.count("# HELP pylon_ready ") == 1
    assert merged.count("# TYPE pylon_requests_total ") == 1
    lines = merged.splitlines()
    # A family's samples stay together, process by process.
    ready = lines.index("# TYPE pylon_ready gauge")
    assert lines[ready + 1 : ready + 3] == [
        'pylon_ready{process="0"} 1.0',
        'pylon_ready{process="1"} 0.0',
    ]
    assert 'pylon_requests_total{process="1",model="m",status_class="2xx"} 5.0' in lines
    assert 'pylon_requests_created{process="0",model="m",status_class="2xx"} 1.7e+09' in lines
    samples = {
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(merged)
        for sample in family.samples
    }
    assert ("pylon_ready", (("process", "1"),), 0.0) in samples
    assert ("pylon_latency_seconds_bucket", (("le", "+Inf"), ("process", "0")), 2.0) in samples


def test_a_sample_line_gets_the_process_label_first() -> None:
    assert labelled("m 1", "3") == 'm{process="3"} 1'
    assert labelled("m{} 1", "3") == 'm{process="3"} 1'
    assert labelled('m{a="x} y"} 1 123', "0") == 'm{process="0",a="x} y"} 1 123'


_LABEL_VALUE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
_FAMILY = st.fixed_dictionaries(
    {
        "name": st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True),
        "kind": st.sampled_from(["gauge", "counter"]),
        "samples": st.lists(
            st.tuples(
                st.dictionaries(st.sampled_from(["a", "b", "le_x"]), _LABEL_VALUE, max_size=2),
                st.integers(0, 10**6),
            ),
            max_size=3,
        ),
    }
)


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _exposition(families: list[dict[str, object]]) -> str:
    lines = []
    seen = set()
    for family in families:
        name = str(family["name"])
        if name in seen:
            continue
        seen.add(name)
        sample_name = name + "_total" if family["kind"] == "counter" else name
        lines += [f"# HELP {sample_name} help of {name}", f"# TYPE {sample_name} {family['kind']}"]
        for labels, value in family["samples"]:  # type: ignore[attr-defined]
            text = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
            lines.append(f"{sample_name}{{{text}}} {value}")
    return "\n".join(lines) + "\n"


def _parsed(text: str) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@given(st.lists(st.lists(_FAMILY, max_size=4), min_size=1, max_size=3))
def test_the_merge_holds_every_sample_of_every_process_and_nothing_else(
    processes: list[list[dict[str, object]]],
) -> None:
    texts = [_exposition(families) for families in processes]
    expected = {
        (name, tuple(sorted([*labels, ("process", str(i))])), value)
        for i, text in enumerate(texts)
        for name, labels, value in _parsed(text)
    }
    merged = merge_expositions([(str(i), text) for i, text in enumerate(texts)])
    assert _parsed(merged) == expected
    helps = [line.split()[2] for line in merged.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # one HELP per family


def test_the_supervisors_own_families_parse() -> None:
    text = supervisor_exposition(
        SupervisorCounts(
            configured=2, up=[True, False], restarts={"signal": 1}, scraped=[True, False]
        )
    )
    samples = _parsed(text)
    assert ("pylon_supervisor_processes", (), 2.0) in samples
    assert ("pylon_supervisor_processes_up", (), 1.0) in samples
    assert ("pylon_supervisor_process_up", (("process", "1"),), 0.0) in samples
    assert ("pylon_supervisor_process_scraped", (("process", "0"),), 1.0) in samples
    assert ("pylon_process_restarts_total", (("reason", "signal"),), 1.0) in samples
    assert ("pylon_process_restarts_total", (("reason", "exit"),), 0.0) in samples
    # No router (--routing off): no router sample, no router reasons.
    assert not [sample for sample in samples if "router" in str(sample)]


def test_the_router_process_has_its_own_up_sample_and_restart_reasons() -> None:
    text = supervisor_exposition(
        SupervisorCounts(configured=2, up=[True, True], restarts={"router_signal": 1}, router=False)
    )
    samples = _parsed(text)
    assert ("pylon_supervisor_process_up", (("process", "router"),), 0.0) in samples
    assert ("pylon_supervisor_processes_up", (), 2.0) in samples  # the serving processes
    assert ("pylon_process_restarts_total", (("reason", "router_signal"),), 1.0) in samples
    assert ("pylon_process_restarts_total", (("reason", "router_exit"),), 0.0) in samples
    assert ("pylon_process_restarts_total", (("reason", "signal"),), 0.0) in samples


# --- handover -------------------------------------------------------------------------------


def test_a_process_rebuilds_the_supervisors_settings_without_reading_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "processes": "2",
            "routing": "round-robin",
            "worker": ["url=http://127.0.0.1:9"],
        }
    )
    handover = Handover(
        settings=settings_values(settings),
        process=1,
        processes=2,
        tcp_fd=5,
        udp_fd=None,
        control_fd=6,
        admin_socket=str(tmp_path / "admin-1.sock"),
        tls_cert=None,
        tls_key=None,
        reset_key="00" * 32,
    )
    path = tmp_path / "process-1.json"
    handover.write(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    monkeypatch.setenv("PYLON_LISTEN", "127.0.0.1:1")
    monkeypatch.setenv("PYLON_ADMIN_LISTEN", "127.0.0.1:2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "not-read")
    rebuilt = Handover.read(path).rebuild_settings()
    assert rebuilt == settings
    assert rebuilt.model_fields_set == settings.model_fields_set
    assert rebuilt.listen == "127.0.0.1:0"  # not PYLON_LISTEN


def test_the_command_of_each_role() -> None:
    assert child_command("pylon", Path("/run/h.json"))[-4:] == [
        "pylon.supervisor.child",
        "--role",
        "pylon",
        "/run/h.json",
    ]
    assert child_command("router", Path("/run/h.json"))[-2] == "router"


@pytest.mark.parametrize("value", ["0", "65", "-1"])
def test_processes_is_bounded(value: str) -> None:
    with pytest.raises(SettingsError, match="processes"):
        load_settings({"processes": value})


def test_one_process_is_the_default() -> None:
    assert load_settings({}).processes == 1

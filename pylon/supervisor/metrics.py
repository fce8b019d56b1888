"""The node's one scrape: each process's Prometheus text exposition merged per family (HELP and
TYPE once, then every process's samples, each with a `process="i"` label), plus the
supervisor's own families. Pure: text in, text out.

Why a labelled merge and not a sum: a counter summed across processes would be right, but a
gauge would not (`pylon_ready` summed is a count of ready processes, a queue estimate summed is
meaningless), nor a histogram whose processes restarted at different times. The labels keep
every sample exact, and the sum is one PromQL away (`sum without(process) (...)`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

LABEL = "process"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info", "_gsum", "_gcount")


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def merge_expositions(parts: Sequence[tuple[str, str]]) -> str:
    """`parts`: (process index, its exposition in the text format 0.0.4), in order. A family's
    HELP and TYPE come from the first process that has it; its samples follow, process by
    process, each labelled with its process."""
    families: dict[str, _Family] = {}
    for process, text in parts:
        current: str | None = None
        # Lines end at "\n" only: `splitlines` would also cut at a "\r" (or "\x85", ...)
        # inside a label value, which the format leaves unescaped.
        for line in text.split("\n"):
            if not line.strip():
                continue
            if line.startswith("#"):
                current = _comment(line, families, current)
                continue
            name = _sample_name(line)
            if name is None:
                continue  # not a sample: dropped, never passed on garbled
            if current is None or not _belongs(name, current):
                current = name
            families.setdefault(current, _Family()).samples.append(labelled(line, process))
    return _render(families)


def _comment(line: str, families: dict[str, _Family], current: str | None) -> str | None:
    """A `# HELP` or `# TYPE` line opens (or continues) its family; any other comment is
    dropped."""
    parts = line.split(None, 3)
    if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
        return current
    name = parts[2]
    text = parts[3] if len(parts) > 3 else ""
    family = families.setdefault(name, _Family())
    if parts[1] == "HELP" and family.help is None:
        family.help = text
    elif parts[1] == "TYPE" and family.type is None:
        family.type = text
    return name


def _belongs(sample: str, family: str) -> bool:
    """A sample of `family`: its name, or its name with a histogram's or summary's suffix."""
    if sample == family:
        return True
    # A counter's family is named with `_total` in this format; its `_created` sample is not.
    base = family.removesuffix("_total")
    return sample.startswith(base) and sample[len(base) :] in _SUFFIXES


def _sample_name(line: str) -> str | None:
    match = _NAME.match(line)
    if match is None:
        return None
    end = match.end()
    if end >= len(line) or line[end] not in "{ \t":
        return None
    return match.group()


def labelled(line: str, process: str) -> str:
    """A sample line with `process="<process>"` as its first label."""
    name = _sample_name(line)
    assert name is not None
    rest = line[len(name) :]
    label = f'{LABEL}="{_escape(process)}"'
    if rest.startswith("{"):
        inner = rest[1:]
        return f"{name}{{{label}{'' if inner.startswith('}') else ','}{inner}"
    return f"{name}{{{label}}}{rest}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _render(families: Mapping[str, _Family]) -> str:
    lines: list[str] = []
    for name, family in families.items():
        if family.help is not None:
            lines.append(f"# HELP {name} {family.help}")
        if family.type is not None:
            lines.append(f"# TYPE {name} {family.type}")
        lines.extend(family.samples)
    return "\n".join(lines) + "\n" if lines else ""


@dataclass(frozen=True)
class SupervisorCounts:
    """What the supervisor exposes about itself."""

    configured: int  # --processes
    up: Sequence[bool]  # per process slot: running now
    restarts: Mapping[str, int]  # by reason: exit (a status) or signal (killed by one)
    scraped: Sequence[bool] = ()  # per process slot: its exposition is in this answer
    router: bool | None = None  # the booking authority's process runs now; None: there is none


def supervisor_exposition(counts: SupervisorCounts) -> str:
    """The supervisor's own families, in the text format. The restart counter is named as
    the deployment files' alert and dashboard read it (`pylon_process_restarts_total`)."""
    lines = [
        "# HELP pylon_supervisor_processes Pylon processes the supervisor runs (--processes).",
        "# TYPE pylon_supervisor_processes gauge",
        f"pylon_supervisor_processes {counts.configured}",
        "# HELP pylon_supervisor_processes_up Pylon processes running now.",
        "# TYPE pylon_supervisor_processes_up gauge",
        f"pylon_supervisor_processes_up {sum(counts.up)}",
        "# HELP pylon_supervisor_process_up Whether each pylon process runs now (1) or not (0).",
        "# TYPE pylon_supervisor_process_up gauge",
        *(
            f'pylon_supervisor_process_up{{process="{i}"}} {int(up)}'
            for i, up in enumerate(counts.up)
        ),
        *(
            [f'pylon_supervisor_process_up{{process="router"}} {int(counts.router)}']
            if counts.router is not None
            else []
        ),
        "# HELP pylon_supervisor_process_scraped Whether this answer holds each process's own "
        "metrics (0: not running, or it did not answer within the deadline).",
        "# TYPE pylon_supervisor_process_scraped gauge",
        *(
            f'pylon_supervisor_process_scraped{{process="{i}"}} {int(ok)}'
            for i, ok in enumerate(counts.scraped)
        ),
        "# HELP pylon_process_restarts_total Pylon processes restarted after they exited, "
        "by reason (exit: with a status; signal: killed by one; router_*: the booking "
        "authority's process).",
        "# TYPE pylon_process_restarts_total counter",
        *(
            f'pylon_process_restarts_total{{reason="{reason}"}} {counts.restarts.get(reason, 0)}'
            for reason in (
                RESTART_REASONS + (ROUTER_RESTART_REASONS if counts.router is not None else ())
            )
        ),
    ]
    return "\n".join(lines) + "\n"


RESTART_REASONS = ("exit", "signal")
ROUTER_RESTART_REASONS = ("router_exit", "router_signal")  # the booking authority's process

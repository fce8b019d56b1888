"""The handover: what the supervisor gives each process it starts, as a JSON file (0600, in the
supervisor's private runtime directory), named on the process's command line.

It carries the settings the supervisor validated (rebuilt in the process from these values
alone: no environment, no config file, `pylon.settings.given_values_only`), the process's
index, the numbers of the file descriptors it inherits (its TCP and UDP sockets, its control
socket), its admin socket's path, the node's self-signed pair and QUIC stateless-reset key,
and the booking authority's socket when there is one.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from pylon.settings import Settings, given_values_only

Role = Literal["pylon", "router"]
CHILD_MODULE = "pylon.supervisor.child"
READY_MESSAGE = b"ready\n"  # a process to its supervisor, on the control socket: bring-up passed


@dataclass(frozen=True)
class Handover:
    settings: dict[str, Any]  # `Settings.model_dump(mode="json", exclude_unset=True)`
    process: int  # the slot's index, 0 .. N-1: the `process` of its log lines and metrics
    processes: int
    tcp_fd: int | None
    udp_fd: int | None
    control_fd: int  # its end of the control socket: EOF = the supervisor is gone
    admin_socket: str | None
    tls_cert: str | None  # the supervisor's self-signed pair (no --tls-cert), else None
    tls_key: str | None
    reset_key: str | None  # hex: the node's QUIC stateless-reset key
    booking_socket: str | None = None  # the booking authority's Unix socket, when one runs

    def rebuild_settings(self) -> Settings:
        """The supervisor's settings, from the handed values only (the environment is the
        supervisor's too, but a flag given to the supervisor outranks it: reading it again
        could only differ)."""
        with given_values_only():
            return Settings(**self.settings)

    def write(self, path: Path) -> None:
        """Written 0600 (it names the private key's file and the reset key)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(orjson.dumps(dataclasses.asdict(self)))

    @classmethod
    def read(cls, path: Path) -> Handover:
        return cls(**orjson.loads(path.read_bytes()))


def settings_values(settings: Settings) -> dict[str, Any]:
    """What a handover carries of `settings`: the values that were set (a default stays a
    default, and the rules that look at what was set see the same)."""
    return settings.model_dump(mode="json", exclude_unset=True)


def child_command(role: Role, handover: Path) -> list[str]:
    """The command line of a supervised process: role "pylon" serves (`pylon.supervisor.child`);
    role "router" runs the node's booking authority (`pylon.routing.authority.run_authority`:
    the supervisor starts one when --routing is on)."""
    return [sys.executable, "-m", CHILD_MODULE, "--role", role, str(handover)]

"""The one refusal to start: `StartupError`, raised by every check before pylon takes traffic.

A leaf (it imports nothing of pylon), so a component that refuses its configuration (the `kv`
router's selection core, the admin listener's bind) need not import the preflight checks or
the settings to say so. `pylon serve` prints its message as one line and exits 2.
"""

from __future__ import annotations

import os
import socket


class StartupError(Exception):
    """Pylon cannot start as configured; the message is one line for the operator."""


def cannot_listen(flag: str, value: str, exc: OSError) -> StartupError:
    """A listener that cannot bind, as one line naming its flag and value: a host that does
    not resolve, an address in use or not on this machine, a port it may not take."""
    if isinstance(exc, socket.gaierror):
        reason = f"the host does not resolve ({exc.strerror or exc})"
    elif exc.errno:
        reason = os.strerror(exc.errno).lower()
    else:
        reason = str(exc)
    return StartupError(f"{flag} {value}: cannot listen: {reason}")

"""The one refusal to start: `StartupError`, raised by every check before pylon takes traffic.

A leaf (it imports nothing of pylon), so a component that refuses its configuration (the `kv`
router's selection core, the admin listener's bind) need not import the preflight checks or
the settings to say so. `pylon serve` prints its message as one line and exits 2.
"""

from __future__ import annotations


class StartupError(Exception):
    """Pylon cannot start as configured; the message is one line for the operator."""

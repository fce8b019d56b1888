"""The topics settings are grouped under, and what every topic's part needs to declare a field.

Each topic is one module of this package with one part (a pydantic model holding that topic's
fields and its own validators); `pylon.settings.model.Settings` composes them in `GROUPS` order.
"""

from __future__ import annotations

import re
from typing import Any

MiB = 1024 * 1024  # bytes
KiB = 1024  # bytes

# The topics of `pylon serve --help` and of docs/operations.md, in the order they are shown.
LISTENERS = "Listeners"
ENGINE = "Engine"
ROUTING = "Routing"
QUEUE = "Queue gate"
BRINGUP = "Engine bring-up and models"
LIMITS = "Limits"
TIMEOUTS = "Timeouts"
TLS_AUTH = "TLS and auth"
HTTP2 = "HTTP/2"
QUIC = "HTTP/3 / QUIC"
FLOODS = "Flood guards"
LOGGING = "Logging"
TRACING = "Tracing"
GATEWAY = "Gateway"
GROUPS = (
    LISTENERS,
    ENGINE,
    ROUTING,
    BRINGUP,
    QUEUE,
    LIMITS,
    TIMEOUTS,
    TLS_AUTH,
    HTTP2,
    QUIC,
    FLOODS,
    LOGGING,
    TRACING,
    GATEWAY,
)

# A request path a setting names (a health path): visible ASCII from a leading `/`, no `#`.
ORIGIN_FORM = re.compile(r"/[\x21\x22\x24-\x7e]*")


def group(
    topic: str,
    metavar: str | None = None,
    *,
    repeatable: bool = False,
    separator: str = ",",
) -> dict[str, Any]:
    """A field's topic (and, when the type does not say it, what its value is: BYTES, ...).

    `repeatable`: a list whose flag is given once per value (`--model a --model b`); its
    environment variable and a plain string take the values `separator`-separated (a comma,
    unless the values hold commas themselves).
    """
    extra: dict[str, Any] = {"group": topic}
    if metavar is not None:
        extra["metavar"] = metavar
    if repeatable:
        extra["repeatable"] = True
        if separator != ",":
            extra["separator"] = separator
    return extra

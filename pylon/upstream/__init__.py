"""The engine side: HTTP/1.1 keep-alive connections per upstream, capped, on httptools.

- `connection`: one upstream connection and the `Attempt`s it runs (one try of an exchange:
  the request written, the response parsed and handed to one consumer with back-pressure),
  and the attempt's failures;
- `pool`: `UpstreamPool`, which connection an attempt runs on (idle reuse, the per-upstream
  cap and its queue, idle reaping);
- `probe`: one-off GETs for health checks and model discovery (`fetch`).
"""

from pylon.upstream.connection import (
    Attempt,
    UpstreamBroken,
    UpstreamBusy,
    UpstreamConnectError,
    UpstreamTimeout,
)
from pylon.upstream.pool import UpstreamPool

__all__ = [
    "Attempt",
    "UpstreamBroken",
    "UpstreamBusy",
    "UpstreamConnectError",
    "UpstreamPool",
    "UpstreamTimeout",
]

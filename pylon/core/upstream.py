"""Where an engine request goes: one engine (or worker) base URL, parsed once."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Upstream:
    """An engine's HTTP/1.1 endpoint; the pool keeps connections per upstream."""

    host: str
    port: int
    base_path: str  # "" or "/prefix" without a trailing slash
    # Derived once: the pool looks upstreams up and frames a Host line on every request.
    host_header: bytes = field(init=False, compare=False, repr=False)
    path_prefix: bytes = field(init=False, compare=False, repr=False)  # base_path, encoded
    label: str = field(init=False, compare=False, repr=False)  # how logs name this upstream
    _hash: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        object.__setattr__(self, "host_header", f"{host}:{self.port}".encode("ascii"))
        object.__setattr__(self, "path_prefix", self.base_path.encode("ascii"))
        object.__setattr__(self, "label", f"{host}:{self.port}{self.base_path}")
        object.__setattr__(self, "_hash", hash((self.host, self.port, self.base_path)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_url(cls, url: str) -> Upstream:
        """`http://host[:port][/base]` (already validated by Settings) -> upstream."""
        _, _, rest = url.partition("://")
        authority, _, path = rest.partition("/")
        host, sep, port = authority.rpartition(":")
        if not sep or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
            host, port = authority, "80"
        return cls(host=host.strip("[]"), port=int(port), base_path=("/" + path).rstrip("/"))

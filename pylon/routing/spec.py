"""`--worker SPEC`: one engine worker, parsed once into a frozen `WorkerSpec`.

A SPEC is comma-separated `key=value` items (whitespace around items, keys and values ignored;
keys case-insensitive, `_` the same as `-`):

- `url=http://HOST[:PORT][/BASE]`: the worker's own HTTP base URL (a vLLM or SGLang server, or a
  Dynamo frontend per worker); requests go there. Or
- `instance-id=<u64>`: a Dynamo worker instance behind the one `--upstream` Dynamo frontend;
  requests go to the frontend with the trusted pin `x-dynamo-worker-instance-id: <id>`.
- `kv-events=tcp://HOST:PORT` (or `ipc://PATH`): the engine's ZMQ KV-event PUB; given once per
  data-parallel rank, in rank order (the `kv` routing mode reads them).
- `block-size=16`: the engine's KV block size (a power of two in 1..1024).
- `dp-size=1`: the engine's data-parallel size.

Exactly one of `url` and `instance-id`. The same keys make a `[[worker]]` table in the
`--config` TOML file (`worker_from_table`). Every failure is one `WorkerSpecError` line naming
the spec. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from router_ffi.errors import InvalidConfig
from router_ffi.validation import MAX_BLOCK_SIZE, U32_MAX, U64_MAX, check_kv_events_endpoint

DEFAULT_BLOCK_SIZE: Final = 16
# The most workers one pylon routes to (--worker, [[worker]], a workers file): every per-worker
# structure (rotation, metrics series, the admin listing) is bounded by it.
MAX_WORKERS: Final = 1024
KEYS: Final = ("url", "instance-id", "kv-events", "block-size", "dp-size")
_HOST_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
_PATH = re.compile(r"(?:/[A-Za-z0-9._~!$&'()*+;=:@%-]*)*")


class WorkerSpecError(ValueError):
    """A worker spec cannot be used; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One engine worker pylon routes to (see the module docstring for the keys)."""

    url: str | None = None  # normalised: no trailing slash
    instance_id: int | None = None
    kv_events: tuple[str, ...] = ()  # one ZMQ endpoint per data-parallel rank, or none
    block_size: int = DEFAULT_BLOCK_SIZE
    dp_size: int = 1

    @property
    def label(self) -> str:
        """How logs and metrics name the worker: its URL, or `instance-id=<id>`."""
        return self.url if self.url is not None else f"instance-id={self.instance_id}"

    @property
    def worker_id(self) -> int:
        """The u64 id the KV selection core knows the worker by: the Dynamo instance id, or a
        stable hash of the URL (the same URL is the same worker across restarts)."""
        if self.instance_id is not None:
            return self.instance_id
        assert self.url is not None
        return int.from_bytes(hashlib.blake2b(self.url.encode(), digest_size=8).digest(), "big")

    def text(self) -> str:
        """The canonical SPEC (what `pylon config` shows; parses back to an equal spec)."""
        items = [f"url={self.url}" if self.url is not None else f"instance-id={self.instance_id}"]
        items += [f"kv-events={endpoint}" for endpoint in self.kv_events]
        items.append(f"block-size={self.block_size}")
        items.append(f"dp-size={self.dp_size}")
        return ",".join(items)


def parse_worker_spec(text: str) -> WorkerSpec:
    """`url=...,kv-events=...,block-size=16,dp-size=1` -> `WorkerSpec`; `WorkerSpecError`."""
    if not isinstance(text, str):
        raise WorkerSpecError(f"a worker spec is a string of key=value items, got {text!r}")
    items: list[tuple[str, str]] = []
    for piece in text.split(","):
        key, eq, value = piece.partition("=")
        if not piece.strip():
            raise _error(text, "an empty item (two commas, or a comma at an end)")
        if not eq:
            raise _error(text, f"{piece.strip()!r} is not key=value")
        items.append((key, value))
    return _build(text, items)


def worker_from_table(table: Mapping[str, Any]) -> WorkerSpec:
    """A `[[worker]]` table of the config file -> `WorkerSpec` (`kv-events` may be a list)."""
    shown = ", ".join(f"{key}={value!r}" for key, value in table.items())
    items: list[tuple[str, str]] = []
    for key, value in table.items():
        values = value if isinstance(value, list) else [value]
        for one in values:
            if isinstance(one, bool) or not isinstance(one, (str, int)):
                raise _error(shown, f"{key} must be a string or an integer, got {one!r}")
            items.append((str(key), str(one)))
    return _build("{" + shown + "}", items)


def _error(spec: str, reason: str) -> WorkerSpecError:
    return WorkerSpecError(f"worker spec {spec!r}: {reason}")


def _build(spec: str, items: list[tuple[str, str]]) -> WorkerSpec:
    seen: dict[str, str] = {}
    kv_events: list[str] = []
    for raw_key, raw_value in items:
        key = raw_key.strip().lower().replace("_", "-")
        value = raw_value.strip()
        if key not in KEYS:
            raise _error(spec, f"unknown key {raw_key.strip()!r} (keys: {', '.join(KEYS)})")
        if not value:
            raise _error(spec, f"{key} has no value")
        if key == "kv-events":
            try:
                kv_events.append(check_kv_events_endpoint(value))
            except InvalidConfig as exc:
                raise _error(spec, str(exc)) from None
            continue
        if key in seen:
            raise _error(spec, f"{key} is given twice")
        seen[key] = value
    if ("url" in seen) == ("instance-id" in seen):
        raise _error(
            spec,
            "give exactly one of url= (the worker's own URL) and instance-id= "
            "(a Dynamo instance behind --upstream)",
        )
    url = _url(spec, seen["url"]) if "url" in seen else None
    instance_id = _u64(spec, seen["instance-id"]) if "instance-id" in seen else None
    block_size = _int(spec, "block-size", seen.get("block-size"), DEFAULT_BLOCK_SIZE)
    if not 1 <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise _error(
            spec, f"block-size must be a power of two in 1..{MAX_BLOCK_SIZE}, got {block_size}"
        )
    dp_size = _int(spec, "dp-size", seen.get("dp-size"), 1)
    if not 1 <= dp_size <= U32_MAX:
        raise _error(spec, f"dp-size must be at least 1, got {dp_size}")
    if kv_events and len(kv_events) != dp_size:
        raise _error(
            spec,
            f"give one kv-events= endpoint per data-parallel rank (dp-size {dp_size}), "
            f"got {len(kv_events)}",
        )
    return WorkerSpec(url, instance_id, tuple(kv_events), block_size, dp_size)


def _int(spec: str, key: str, value: str | None, default: int) -> int:
    if value is None:
        return default
    if not value.isascii() or not value.isdigit() or len(value) > 20:
        raise _error(spec, f"{key} must be a decimal integer, got {value!r}")
    return int(value)


def _u64(spec: str, value: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > 20 or int(value) > U64_MAX:
        raise _error(
            spec, f"instance-id must be a decimal integer in 0..{U64_MAX} (u64), got {value!r}"
        )
    return int(value)


def _url(spec: str, value: str) -> str:
    """`http://HOST[:PORT][/BASE]`, no credentials, query or fragment; trailing `/` dropped."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() != "http":
        raise _error(
            spec, f"url must be http://HOST[:PORT][/BASE] (pylon is node-local), got {value!r}"
        )
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise _error(
            spec, "url may not carry credentials: pylon never sends credentials to an engine"
        )
    if any(mark in rest for mark in "?#") or not value.isascii() or not value.isprintable():
        raise _error(spec, f"url may not carry a query, fragment or non-ASCII text: {value!r}")
    host, port = _authority(spec, authority)
    base = ("/" + path).rstrip("/") if slash else ""
    if not _PATH.fullmatch(base):
        raise _error(spec, f"url has an invalid path: {value!r}")
    shown_host = f"[{host}]" if ":" in host else host.lower()
    return f"http://{shown_host}:{port}{base}"


def _authority(spec: str, authority: str) -> tuple[str, int]:
    port = 80
    if authority.startswith("["):
        host, close, tail = authority[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _error(spec, f"url has an invalid IPv6 host: [{host}]") from None
        if not close or (tail and not tail.startswith(":")):
            raise _error(spec, f"url has an invalid host: {authority!r}")
        port_text = tail[1:] if tail else None
    else:
        host, colon, port_text_raw = authority.partition(":")
        port_text = port_text_raw if colon else None
        if not _HOST_NAME.fullmatch(host):
            raise _error(spec, f"url has an invalid host: {host!r}")
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise _error(spec, f"url has an invalid port: {port_text!r}")
        port = int(port_text)
    return host, port


def catalogue_digest(specs: Iterable[WorkerSpec]) -> str:
    """A short digest of a worker catalogue as the selection core's replica sync sees it: each
    worker's id, block size and data-parallel size, in id order. Replicas (local processes or
    pylons on other nodes) whose digests differ drop each other's sync events for the workers
    they do not share; the digest is what they compare. The URL and KV-event endpoints are left
    out: two nodes may reach the same worker by different addresses."""
    lines = sorted(f"{s.worker_id}:{s.block_size}:{s.dp_size}" for s in specs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def check_replica_peer(text: str) -> str:
    """`--replica-peer HOST:PORT` (or `[IPv6]:PORT`) -> the ZMQ endpoint Dynamo's replica sync
    subscribes to, `tcp://HOST:PORT`; `ValueError` (one line) for anything else. The port is
    required: the native core refuses a peer without one."""
    if not isinstance(text, str) or not text.isascii() or not text.isprintable():
        raise ValueError(f"a replica peer is HOST:PORT, got {text!r}")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"a replica peer is HOST:PORT (the port is required), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"a replica peer has an invalid IPv6 host: {text!r}") from None
    elif not _HOST_NAME.fullmatch(host):
        raise ValueError(f"a replica peer has an invalid host: {text!r}")
    if not port_text.isdigit() or len(port_text) > 5 or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"a replica peer has an invalid port (1-65535): {text!r}")
    return f"tcp://{host}:{int(port_text)}"

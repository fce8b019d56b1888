"""Start-up checks for the worker catalog: each failure is one `InvalidConfig` with one line.

pylon calls `check_workers` on the parsed `--worker` specs before any listener opens and turns
an `InvalidConfig` into exit 2 with `str(error)` as the message. The native core would accept
some of these values and leave the worker silently unschedulable (`lifecycle: incomplete`);
these checks refuse them up front instead. `SelectionCore.upsert_worker` runs `check_worker` too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeGuard

from router_ffi.errors import InvalidConfig
from router_ffi.types import CoreWorker, ReplicaSync

MAX_BLOCK_SIZE = 1024
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _prefix(worker_id: object) -> str:
    return "" if worker_id is None else f"worker {worker_id}: "


def check_block_size(value: object, *, worker_id: int | None = None) -> int:
    """A KV block size: a power of two in 1..1024."""
    if _is_int(value) and 1 <= value <= MAX_BLOCK_SIZE and not value & (value - 1):
        return value
    raise InvalidConfig(
        f"{_prefix(worker_id)}block size must be a power of two in 1..{MAX_BLOCK_SIZE}, "
        f"got {value!r}"
    )


def check_worker_id(value: object) -> int:
    """A worker id: an unsigned 64-bit integer (Dynamo instance ids often exceed 2^63)."""
    if _is_int(value) and 0 <= value <= U64_MAX:
        return value
    raise InvalidConfig(f"worker id must be an integer in 0..{U64_MAX} (u64), got {value!r}")


def check_dp_size(value: object, *, worker_id: int | None = None) -> int:
    """A data-parallel size: at least 1."""
    if _is_int(value) and 1 <= value <= U32_MAX:
        return value
    raise InvalidConfig(f"{_prefix(worker_id)}dp-size must be an integer >= 1, got {value!r}")


def check_kv_events_endpoint(value: object, *, worker_id: int | None = None) -> str:
    """A ZMQ endpoint the native core can connect a SUB to: `tcp://HOST:PORT` or `ipc://PATH`."""
    where = _prefix(worker_id)
    if not isinstance(value, str) or not value.isascii() or not value.isprintable():
        raise InvalidConfig(f"{where}KV-event endpoint must be an ASCII string, got {value!r}")
    scheme, sep, rest = value.partition("://")
    if sep and scheme == "ipc" and rest:
        return value
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if colon and host and " " not in host and port.isdigit() and 1 <= int(port) <= 65535:
            return value
    raise InvalidConfig(
        f"{where}KV-event endpoint must be tcp://HOST:PORT or ipc://PATH, got {value!r}"
    )


def check_worker(spec: CoreWorker) -> CoreWorker:
    """Every field of one worker spec; the first failure raises."""
    wid = check_worker_id(spec.worker_id)
    check_block_size(spec.block_size, worker_id=wid)
    dp = check_dp_size(spec.dp_size, worker_id=wid)
    start = spec.dp_start_rank
    if not _is_int(start) or not 0 <= start <= U32_MAX - dp + 1:
        raise InvalidConfig(f"worker {wid}: dp start rank must be an integer >= 0, got {start!r}")
    if not isinstance(spec.endpoint, str) or not spec.endpoint:
        raise InvalidConfig(f"worker {wid}: endpoint must be a non-empty string")
    if len(spec.kv_events) != dp:
        raise InvalidConfig(
            f"worker {wid}: needs one KV-event endpoint per data-parallel rank "
            f"(dp-size {dp}), got {len(spec.kv_events)}"
        )
    for endpoint in spec.kv_events:
        check_kv_events_endpoint(endpoint, worker_id=wid)
    if spec.replay_endpoint is not None:
        check_kv_events_endpoint(spec.replay_endpoint, worker_id=wid)
    for name, count in (
        ("total_kv_blocks", spec.total_kv_blocks),
        ("max_num_batched_tokens", spec.max_num_batched_tokens),
    ):
        if count is not None and (not _is_int(count) or not 1 <= count <= U64_MAX):
            raise InvalidConfig(f"worker {wid}: {name} must be a positive integer, got {count!r}")
    for name, group in (("model name", spec.model_name), ("routing group", spec.routing_group)):
        if not isinstance(group, str) or not group:
            raise InvalidConfig(f"worker {wid}: {name} must be a non-empty string")
    return spec


def check_workers(specs: Iterable[CoreWorker]) -> tuple[CoreWorker, ...]:
    """A whole catalog: each spec valid, worker ids unique."""
    seen: set[int] = set()
    out: list[CoreWorker] = []
    for spec in specs:
        check_worker(spec)
        if spec.worker_id in seen:
            raise InvalidConfig(f"worker id {spec.worker_id} is configured twice")
        seen.add(spec.worker_id)
        out.append(spec)
    return tuple(out)


def check_replica_sync(sync: ReplicaSync) -> ReplicaSync:
    """A replica sync the native core accepts: a port in 1..65535 and at least one peer, each
    `tcp://HOST:PORT` (1.6.1 refuses a peer without a port, and peers without a port of its
    own; a port without peers would publish to replicas it never hears from)."""
    port = sync.port
    if not _is_int(port) or not 1 <= port <= 65535:
        raise InvalidConfig(f"replica sync port must be an integer in 1..65535, got {port!r}")
    if not sync.peers:
        raise InvalidConfig("replica sync needs at least one peer")
    for peer in sync.peers:
        try:
            ok = isinstance(peer, str) and peer.startswith("tcp://")
            ok = ok and check_kv_events_endpoint(peer) == peer
        except InvalidConfig:
            ok = False
        if not ok:
            raise InvalidConfig(f"replica sync peer must be tcp://HOST:PORT, got {peer!r}")
    return sync

"""The only module that names `dynamo._core`: the lazy import and the shape router_ffi needs.

`NativeService` is the part of `dynamo._core.SelectionService` (ai-dynamo-runtime 1.6.1) that
router_ffi calls. In 1.6.1 the catalog, selection, prefill-complete, free and overlap calls are
`async` on the Python side: each returns an `asyncio.Future` of the calling thread's running
loop, completed from Dynamo's tokio threads; `add_output_block`, `loads`, `list_workers` and
`shutdown` are synchronous. Conversion errors (`ValueError`, `OverflowError`) are raised at call
time, selection failures as `SelectionServiceError` with `kind` and `status_code`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from router_ffi.errors import (
    InvalidRequest,
    NativeCallFailed,
    NativeUnavailable,
    NotFound,
    NoWorkerAvailable,
    RouterFfiError,
)
from router_ffi.types import ReplicaSync


class NativeService(Protocol):
    def upsert_worker(self, worker: dict[str, Any], /) -> Awaitable[Any]: ...

    def delete_worker(self, worker_id: int, /) -> Awaitable[Any]: ...

    def list_workers(self) -> Any: ...

    def select_and_reserve(self, request: dict[str, Any], /) -> Awaitable[Any]: ...

    def prefill_complete(self, selection_id: str, /) -> Awaitable[Any]: ...

    def add_output_block(
        self, selection_id: str, /, *, decay_fraction: float | None = None
    ) -> Any: ...

    def free_reservation(self, selection_id: str, /) -> Awaitable[Any]: ...

    def loads(self) -> Any: ...

    def overlap_scores(self, request: dict[str, Any], /) -> Awaitable[Any]: ...

    def shutdown(self) -> None: ...


NativeFactory = Callable[[], NativeService]


# The native core logs through its own Rust subscriber straight to stderr, which `pylon serve`
# turns into its own `dynamo_native_log` lines (pylon.native_logs): ask it for JSON lines (so its
# fields survive), warnings and worse only. An operator's
# own DYN_LOG / DYN_LOGGING_JSONL win (set before the module is first imported, as it reads them
# once).
NATIVE_LOG_DEFAULTS = {"DYN_LOGGING_JSONL": "1", "DYN_LOG": "warn"}


def load_native() -> Any:
    """`dynamo._core`, or `NativeUnavailable` saying how to install it."""
    for name, value in NATIVE_LOG_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        from dynamo import _core
    except (ImportError, OSError) as exc:  # OSError: a wheel whose shared library does not load
        raise NativeUnavailable(f"{type(exc).__name__}: {exc}") from exc
    if not hasattr(_core, "SelectionService"):
        raise NativeUnavailable(
            "dynamo._core has no SelectionService; ai-dynamo-runtime 1.6.1 is needed"
        )
    return _core


def native_factory(indexer_threads: int, replica_sync: ReplicaSync | None = None) -> NativeFactory:
    """A factory for the real SelectionService; the import is checked now (raises at once).
    `replica_sync`: the core's replica sync (its PUB port and its peers' endpoints)."""
    core = load_native()
    sync: dict[str, Any] = {}
    if replica_sync is not None:
        sync = {
            "replica_sync_port": replica_sync.port,
            "replica_sync_peers": list(replica_sync.peers),
        }

    def make() -> NativeService:
        service: NativeService = core.SelectionService(indexer_threads=indexer_threads, **sync)
        return service

    return make


# Native 503 kinds seen on 1.6.1: `not_ready` (no schedulable worker for the model/group, or the
# service is shutting down) and `scheduler` (no endpoint matches `allowed_worker_ids`).
def translate(op: str, exc: BaseException) -> RouterFfiError:
    """Any exception a native call raised, as a router_ffi error (never re-raises)."""
    if isinstance(exc, RouterFfiError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return NoWorkerAvailable(op, "cancelled", 503, "the native call was cancelled")
    kind = getattr(exc, "kind", None)
    status = getattr(exc, "status_code", None)
    if isinstance(kind, str) and isinstance(status, int):
        cls: type[NativeCallFailed] = NativeCallFailed
        if status == 503:
            cls = NoWorkerAvailable
        elif status == 404:
            cls = NotFound
        elif status == 400:
            cls = InvalidRequest
        return cls(op, kind, status, str(exc))
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return InvalidRequest(op, "invalid", 400, f"{type(exc).__name__}: {exc}")
    return NativeCallFailed(op, "internal", 500, f"{type(exc).__name__}: {exc}")

"""The worker-selection boundary around Dynamo's native selection core (ai-dynamo-runtime 1.6.1).

The only code that touches the native `SelectionService`. Importing router_ffi never needs
Dynamo: the native module is imported when a `SelectionCore` is built, and a missing
`ai-dynamo-runtime` then raises `NativeUnavailable` saying how to install it.

- `SelectionCore` (service.py): the shared, thread-safe core. Catalog (`upsert_worker`,
  `remove_worker`, `workers`), `select_and_reserve` (-> `Reservation`), `loads`, `overlap`,
  `shutdown`: the facade.
- `Reservation` (service.py): one request's booking and all its per-request state:
  `prefill_complete()`, `output_tokens(n)` / `output_block()`, `free()` (idempotent; a no-op
  after shutdown).
- owner.py: `NativeOwner`, the executor: all native calls run on its one owner thread behind a
  `CallGate` (gate.py), a reservation's calls chained in order.
- types.py: the frozen request/result values; errors.py: the one exception hierarchy.
- validation.py: start-up checks (block size, unique u64 worker ids, dp size, KV endpoints,
  the replica sync's port and peers).
- hashing.py: `hash_prompt`, a prompt as a `HashedPrompt`; the hashing itself (Dynamo's block
  and sequence hashes, bit-exact, xxhash) is `pylon.core.blocks`, shared with pylon and the mock.

The engines' KV-event wire format is not here: the native core reads the engines' ZMQ sockets
itself and takes no event bytes. pylon's one codec for it is `pylon.core.kv_events` (decode,
encode, sequence gaps), which the tests and the benchmark use to publish to the native core.

docs/routing.md ("router_ffi: the native boundary") has the measured select latency and why the
native calls run on an owner thread.
"""

from router_ffi.errors import (
    INSTALL_HINT,
    DependencyMissing,
    InvalidConfig,
    InvalidRequest,
    NativeCallFailed,
    NativeUnavailable,
    NotFound,
    NoWorkerAvailable,
    RouterFfiError,
    SelectionTimeout,
    ServiceClosed,
)
from router_ffi.service import ErrorSink, Reservation, SelectionCore
from router_ffi.types import (
    CoreWorker,
    GroupLoads,
    HashedPrompt,
    OverlapScores,
    Prompt,
    ReplicaSync,
    Selection,
    SelectRequest,
    ShutdownReport,
    TokenPrompt,
    WorkerLoad,
    WorkerOverlap,
    WorkerRecord,
)
from router_ffi.validation import (
    check_block_size,
    check_dp_size,
    check_kv_events_endpoint,
    check_replica_sync,
    check_worker,
    check_worker_id,
    check_workers,
)


def native_available() -> bool:
    """Whether Dynamo's native selection core imports (without building anything)."""
    from router_ffi._native import load_native

    try:
        load_native()
    except NativeUnavailable:
        return False
    return True


__all__ = [
    "INSTALL_HINT",
    "CoreWorker",
    "DependencyMissing",
    "ErrorSink",
    "GroupLoads",
    "HashedPrompt",
    "InvalidConfig",
    "InvalidRequest",
    "NativeCallFailed",
    "NativeUnavailable",
    "NoWorkerAvailable",
    "NotFound",
    "OverlapScores",
    "Prompt",
    "ReplicaSync",
    "Reservation",
    "RouterFfiError",
    "SelectRequest",
    "Selection",
    "SelectionCore",
    "SelectionTimeout",
    "ServiceClosed",
    "ShutdownReport",
    "TokenPrompt",
    "WorkerLoad",
    "WorkerOverlap",
    "WorkerRecord",
    "check_block_size",
    "check_dp_size",
    "check_kv_events_endpoint",
    "check_replica_sync",
    "check_worker",
    "check_worker_id",
    "check_workers",
    "native_available",
]

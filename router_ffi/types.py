"""Typed values that cross the router_ffi boundary (frozen dataclasses; no raw dicts).

Worker ids are u64 (Dynamo instance ids are random per start and often above 2^63); block and
sequence hashes in a `HashedPrompt` are Dynamo's wire form, signed i64 (`router_ffi.hashing`
converts). Every value a native call returns is parsed into one of these on the owner thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_GROUP = "default"


@dataclass(frozen=True, slots=True)
class CoreWorker:
    """One engine worker (or one Dynamo instance) in the selection catalog.

    `endpoint` is opaque to the native core (echoed back on selection, never called): pylon puts
    what it dispatches to there (the worker's base URL, or a label for an instance id).
    `kv_events` holds one ZMQ PUB endpoint per data-parallel rank, for ranks
    `dp_start_rank .. dp_start_rank + dp_size - 1` in order; the native core connects a SUB to
    each (all topics) and keeps its cache view from them.
    """

    worker_id: int
    endpoint: str
    block_size: int
    kv_events: tuple[str, ...]
    dp_size: int = 1
    dp_start_rank: int = 0
    replay_endpoint: str | None = None
    total_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    model_name: str = DEFAULT_GROUP
    routing_group: str = DEFAULT_GROUP


@dataclass(frozen=True, slots=True)
class ReplicaSync:
    """Dynamo's replica sync for one core (constructor-only in 1.6.1): the core binds a ZMQ PUB
    on `tcp://*:port` (every interface, no authentication) that publishes each booking's
    add, prefill-complete and free, and subscribes to every peer's (`tcp://HOST:PORT`). Best
    effort: no sequence numbers, no snapshot; a peer's event for a worker this core does not
    know is dropped."""

    port: int
    peers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """The native catalog's view of a worker after an upsert or removal."""

    worker_id: int
    model_name: str
    routing_group: str
    endpoint: str | None
    lifecycle: str  # incomplete | schedulable | draining | unschedulable
    not_schedulable_reasons: tuple[str, ...]

    @property
    def schedulable(self) -> bool:
        return self.lifecycle == "schedulable"


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt as token ids; the native core hashes them (same salt/LoRA rules as the engine).

    `token_ids` is passed to the native call as is (a list or tuple; not copied): do not mutate it
    after building the request. `cache_salt` must come from what pylon trusts (the tenant),
    never from the client.
    """

    token_ids: Sequence[int]
    cache_salt: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    """A prompt already hashed (`router_ffi.hashing.hash_prompt`): content hashes of its full
    blocks and their prefix chain, both as signed i64, and the prompt length in tokens."""

    block_hashes: Sequence[int]
    sequence_hashes: Sequence[int]
    isl_tokens: int


Prompt = TokenPrompt | HashedPrompt


@dataclass(frozen=True, slots=True)
class SelectRequest:
    """One request's selection input. `selection_id=None` lets the core mint a fresh one."""

    prompt: Prompt
    selection_id: str | None = None
    model_name: str = DEFAULT_GROUP
    routing_group: str = DEFAULT_GROUP
    allowed_worker_ids: tuple[int, ...] | None = None
    expected_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Selection:
    """The worker chosen and booked for one request."""

    selection_id: str
    worker_id: int
    dp_rank: int
    endpoint: str
    block_size: int
    isl_tokens: int
    overlap_tokens: int  # prompt tokens already cached on the chosen worker (device tier)
    effective_prefill_tokens: int  # what the booking charges as prefill load
    potential_decode_blocks: int


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    worker_id: int
    dp_rank: int
    potential_prefill_tokens: int
    potential_decode_blocks: int
    active_requests: int


@dataclass(frozen=True, slots=True)
class GroupLoads:
    """Active load of one model/routing-group partition."""

    model_name: str
    routing_group: str
    workers: tuple[WorkerLoad, ...]
    pending_count: int
    pending_isl_tokens: int

    @property
    def active_requests(self) -> int:
        return sum(w.active_requests for w in self.workers)


@dataclass(frozen=True, slots=True)
class WorkerOverlap:
    """How many of a prompt's full blocks a worker (rank) holds, per storage tier (cumulative)."""

    worker_id: int
    dp_rank: int
    device_blocks: int
    host_blocks: int
    disk_blocks: int


@dataclass(frozen=True, slots=True)
class OverlapScores:
    block_size: int
    num_blocks: int
    workers: tuple[WorkerOverlap, ...]

    def blocks_on(self, worker_id: int) -> int:
        """Device blocks the worker holds (the best of its ranks), 0 if it is not listed."""
        return max((w.device_blocks for w in self.workers if w.worker_id == worker_id), default=0)


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """`drained`: every in-flight call finished before the native core was stopped;
    `abandoned`: calls still in flight when the drain timed out (their callers got
    `ServiceClosed`)."""

    drained: bool
    abandoned: int

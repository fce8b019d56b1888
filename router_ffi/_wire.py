"""Typed values <-> the native core's JSON-like dicts (SelectionService 1.6.1 shapes).

Pure functions: requests are built from typed values, responses parsed into typed values. A
response that does not have the expected shape raises `NativeCallFailed(kind="bad_response")`,
so a native upgrade that changes a field fails loudly at the boundary, not deep in pylon.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router_ffi.errors import NativeCallFailed
from router_ffi.types import (
    CoreWorker,
    GroupLoads,
    HashedPrompt,
    OverlapScores,
    Prompt,
    Selection,
    SelectRequest,
    WorkerLoad,
    WorkerOverlap,
    WorkerRecord,
)


def worker_to_native(spec: CoreWorker) -> dict[str, Any]:
    out: dict[str, Any] = {
        "worker_id": spec.worker_id,
        "endpoint": spec.endpoint,
        "block_size": spec.block_size,
        "model_name": spec.model_name,
        "routing_group": spec.routing_group,
    }
    if spec.dp_size == 1 and spec.dp_start_rank == 0:
        out["kv_events_endpoint"] = spec.kv_events[0]
    else:
        # The binding wants int rank keys, absolute ranks (start .. start + size - 1).
        out["data_parallel_start_rank"] = spec.dp_start_rank
        out["data_parallel_size"] = spec.dp_size
        out["kv_events_endpoints"] = {
            spec.dp_start_rank + i: endpoint for i, endpoint in enumerate(spec.kv_events)
        }
    if spec.replay_endpoint is not None:
        out["replay_endpoint"] = spec.replay_endpoint
    if spec.total_kv_blocks is not None:
        out["total_kv_blocks"] = spec.total_kv_blocks
    if spec.max_num_batched_tokens is not None:
        out["max_num_batched_tokens"] = spec.max_num_batched_tokens
    return out


def prompt_to_native(prompt: Prompt, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(prompt, HashedPrompt):
        out["block_hashes"] = prompt.block_hashes
        out["sequence_hashes"] = prompt.sequence_hashes
        out["isl_tokens"] = prompt.isl_tokens
    else:
        out["token_ids"] = prompt.token_ids
        if prompt.cache_salt:
            out["cache_salt"] = prompt.cache_salt
        if prompt.lora_name:
            out["lora_name"] = prompt.lora_name
    return out


def select_to_native(request: SelectRequest, selection_id: str) -> dict[str, Any]:
    out: dict[str, Any] = {"selection_id": selection_id}
    if request.model_name != "default":
        out["model_name"] = request.model_name
    if request.routing_group != "default":
        out["routing_group"] = request.routing_group
    if request.allowed_worker_ids is not None:
        out["allowed_worker_ids"] = request.allowed_worker_ids
    if request.expected_output_tokens is not None:
        out["expected_output_tokens"] = request.expected_output_tokens
    return prompt_to_native(request.prompt, out)


def overlap_to_native(prompt: Prompt, model_name: str, routing_group: str) -> dict[str, Any]:
    return prompt_to_native(prompt, {"model_name": model_name, "routing_group": routing_group})


def _bad(op: str, exc: Exception, raw: object) -> NativeCallFailed:
    shape = type(raw).__name__
    return NativeCallFailed(
        op, "bad_response", 502, f"unexpected native response ({shape}): {exc!r}"
    )


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"expected an int, got {type(value).__name__}")


def _str(value: object) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"expected a str, got {type(value).__name__}")


def _map(value: object) -> Mapping[str, Any]:
    if isinstance(value, Mapping):
        return value
    raise TypeError(f"expected a mapping, got {type(value).__name__}")


def parse_record(op: str, raw: object) -> WorkerRecord:
    try:
        d = _map(raw)
        endpoint = d.get("endpoint")
        return WorkerRecord(
            worker_id=_int(d["worker_id"]),
            model_name=_str(d["model_name"]),
            routing_group=_str(d["routing_group"]),
            endpoint=None if endpoint is None else _str(endpoint),
            lifecycle=_str(d["lifecycle"]),
            not_schedulable_reasons=tuple(_str(r) for r in d.get("not_schedulable_reasons") or ()),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(op, exc, raw) from exc


def parse_records(op: str, raw: object) -> tuple[WorkerRecord, ...]:
    if not isinstance(raw, (list, tuple)):
        raise _bad(op, TypeError("expected a list"), raw)
    return tuple(parse_record(op, r) for r in raw)


def parse_selection(op: str, raw: object) -> Selection:
    try:
        d = _map(raw)
        overlap = _map(d.get("overlap") or {})
        return Selection(
            selection_id=_str(d["selection_id"]),
            worker_id=_int(d["worker_id"]),
            dp_rank=_int(d.get("dp_rank", 0)),
            endpoint=_str(d["endpoint"]),
            block_size=_int(d["block_size"]),
            isl_tokens=_int(d.get("isl_tokens", 0)),
            overlap_tokens=_int(overlap.get("gpu", 0)),
            effective_prefill_tokens=_int(d.get("effective_prefill_tokens", 0)),
            potential_decode_blocks=_int(d.get("potential_decode_blocks", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(op, exc, raw) from exc


def parse_loads(op: str, raw: object) -> tuple[GroupLoads, ...]:
    try:
        if not isinstance(raw, (list, tuple)):
            raise TypeError("expected a list")
        groups = []
        for group in raw:
            g = _map(group)
            workers = tuple(
                WorkerLoad(
                    worker_id=_int(w["worker_id"]),
                    dp_rank=_int(w.get("dp_rank", 0)),
                    potential_prefill_tokens=_int(w.get("potential_prefill_tokens", 0)),
                    potential_decode_blocks=_int(w.get("potential_decode_blocks", 0)),
                    active_requests=_int(w.get("active_requests", 0)),
                )
                for w in map(_map, g.get("loads") or ())
            )
            groups.append(
                GroupLoads(
                    model_name=_str(g["model_name"]),
                    routing_group=_str(g["routing_group"]),
                    workers=tuple(sorted(workers, key=lambda w: (w.worker_id, w.dp_rank))),
                    pending_count=_int(g.get("pending_count", 0)),
                    pending_isl_tokens=_int(g.get("pending_isl_tokens", 0)),
                )
            )
        return tuple(groups)
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(op, exc, raw) from exc


def parse_overlap(op: str, raw: object) -> OverlapScores:
    try:
        d = _map(raw)
        workers = tuple(
            WorkerOverlap(
                worker_id=_int(w["worker_id"]),
                dp_rank=_int(w.get("dp_rank", 0)),
                device_blocks=_int(w.get("device_blocks", 0)),
                host_blocks=_int(w.get("host_pinned_blocks", 0)),
                disk_blocks=_int(w.get("disk_blocks", 0)),
            )
            for w in map(_map, d.get("workers") or ())
        )
        return OverlapScores(
            block_size=_int(d["block_size"]),
            num_blocks=_int(d["num_blocks"]),
            workers=tuple(sorted(workers, key=lambda w: (w.worker_id, w.dp_rank))),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(op, exc, raw) from exc

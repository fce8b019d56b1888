"""A stand-in for dynamo._core.SelectionService with the 1.6.1 call shapes, for the pure tests.

Like the binding, its async methods return futures of the calling thread's running loop (the
owner's), completed later; it records every call with the thread it came from, flags any call
made after its own `shutdown()`, and can hold a selection or a prefill-complete in flight until
the test releases it (an Event, no sleeps).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any


class FakeSelectionError(Exception):
    def __init__(self, message: str, kind: str, status_code: int) -> None:
        super().__init__(message)
        self.kind = kind
        self.status_code = status_code


@dataclass
class Hold:
    """Keeps one kind of call in flight: `started` is set when it arrives, `release` ends it."""

    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)


class FakeNative:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.threads: set[str] = set()
        self.workers: dict[int, dict[str, Any]] = {}
        self.reservations: dict[str, dict[str, Any]] = {}
        self.shut_down = False
        self.touched_after_shutdown: list[str] = []
        self.hold_select: Hold | None = None
        self.hold_prefill: Hold | None = None
        self.fail_prefill = False
        self._lock = threading.Lock()
        self._helpers: list[threading.Thread] = []

    # -- helpers ---------------------------------------------------------------------------

    def _record(self, op: str, arg: object) -> None:
        with self._lock:
            self.calls.append((op, arg))
            self.threads.add(threading.current_thread().name)
            if self.shut_down:
                self.touched_after_shutdown.append(op)

    def _resolved(self, value: object) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        loop = fut.get_loop()
        loop.call_soon(fut.set_result, value)  # lands on a later loop turn, like the binding
        return fut

    def _held(self, hold: Hold, value: object) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        hold.started.set()

        def wait() -> None:
            hold.release.wait()
            if not loop.is_closed():
                loop.call_soon_threadsafe(fut.set_result, value)

        helper = threading.Thread(target=wait, daemon=True)
        self._helpers.append(helper)
        helper.start()
        return fut

    def ops_for(self, selection_id: str) -> list[str]:
        with self._lock:
            return [op for op, arg in self.calls if arg == selection_id]

    def active(self) -> dict[int, int]:
        out = dict.fromkeys(self.workers, 0)
        for r in self.reservations.values():
            out[r["worker_id"]] += 1
        return out

    # -- the SelectionService surface -------------------------------------------------------

    def upsert_worker(self, worker: dict[str, Any]) -> asyncio.Future[Any]:
        self._record("upsert_worker", worker["worker_id"])
        self.workers[worker["worker_id"]] = worker
        return self._resolved(self._record_of(worker))

    def _record_of(self, worker: dict[str, Any]) -> dict[str, Any]:
        return {
            "worker_id": worker["worker_id"],
            "model_name": worker.get("model_name", "default"),
            "routing_group": worker.get("routing_group", "default"),
            "endpoint": worker["endpoint"],
            "lifecycle": "schedulable",
            "block_size": worker["block_size"],
        }

    def delete_worker(self, worker_id: int) -> asyncio.Future[Any]:
        self._record("delete_worker", worker_id)
        if worker_id not in self.workers:
            raise FakeSelectionError(f"worker {worker_id} not found", "not_found", 404)
        worker = self.workers.pop(worker_id)
        # Like Dynamo 1.6.1's: the worker's reservations (its load) go with it; later calls on
        # them are "not found".
        for sid in [s for s, r in self.reservations.items() if r["worker_id"] == worker_id]:
            del self.reservations[sid]
        return self._resolved({**self._record_of(worker), "lifecycle": "unschedulable"})

    def list_workers(self) -> list[dict[str, Any]]:
        self._record("list_workers", None)
        return [self._record_of(w) for w in self.workers.values()]

    def select_and_reserve(self, request: dict[str, Any]) -> asyncio.Future[Any]:
        sid = request["selection_id"]
        self._record("select_and_reserve", sid)
        if not self.workers:
            raise FakeSelectionError("no schedulable workers are available", "not_ready", 503)
        if sid in self.reservations:
            raise FakeSelectionError(f"selection {sid} is already reserved", "conflict", 409)
        load = self.active()
        allowed = request.get("allowed_worker_ids")
        candidates = [w for w in self.workers if allowed is None or w in allowed]
        if not candidates:
            raise FakeSelectionError("no endpoints available to route work", "scheduler", 503)
        wid = min(candidates, key=lambda w: (load[w], w))
        worker = self.workers[wid]
        isl = len(request.get("token_ids", ())) or request.get("isl_tokens", 0)
        self.reservations[sid] = {"worker_id": wid, "phase": "prefill", "blocks": 0}
        response = {
            "selection_id": sid,
            "model_name": "default",
            "routing_group": "default",
            "worker_id": wid,
            "dp_rank": 0,
            "endpoint": worker["endpoint"],
            "block_size": worker["block_size"],
            "overlap": {"longest_matched": 0, "gpu": 0, "dp": {"0": 0}, "cpu": 0, "disk": 0},
            "effective_prefill_tokens": isl,
            "potential_decode_blocks": 1,
            "isl_tokens": isl,
            "sequence_hashes": [],
            "track_prefill_tokens": True,
        }
        if self.hold_select is not None:
            return self._held(self.hold_select, response)
        return self._resolved(response)

    def _reservation(self, selection_id: str) -> dict[str, Any]:
        if selection_id not in self.reservations:
            raise FakeSelectionError(f"reservation {selection_id} not found", "not_found", 404)
        return self.reservations[selection_id]

    def prefill_complete(self, selection_id: str) -> asyncio.Future[Any]:
        self._record("prefill_complete", selection_id)
        if self.fail_prefill:
            raise FakeSelectionError(f"prefill of {selection_id} failed", "internal", 500)
        self._reservation(selection_id)["phase"] = "decode"
        if self.hold_prefill is not None:
            return self._held(self.hold_prefill, None)
        return self._resolved(None)

    def add_output_block(self, selection_id: str, *, decay_fraction: float | None = None) -> None:
        self._record("add_output_block", selection_id)
        self._reservation(selection_id)["blocks"] += 1

    def free_reservation(self, selection_id: str) -> asyncio.Future[Any]:
        self._record("free_reservation", selection_id)
        self._reservation(selection_id)
        del self.reservations[selection_id]
        return self._resolved(None)

    def loads(self) -> list[dict[str, Any]]:
        self._record("loads", None)
        active = self.active()
        return [
            {
                "model_name": "default",
                "routing_group": "default",
                "loads": [
                    {
                        "worker_id": wid,
                        "dp_rank": 0,
                        "potential_prefill_tokens": 0,
                        "potential_decode_blocks": 0,
                        "active_requests": n,
                    }
                    for wid, n in active.items()
                ],
                "pending_count": 0,
                "pending_isl_tokens": 0,
            }
        ]

    def overlap_scores(self, request: dict[str, Any]) -> asyncio.Future[Any]:
        self._record("overlap_scores", None)
        return self._resolved({"block_size": 16, "num_blocks": 0, "workers": []})

    def shutdown(self) -> None:
        self._record("shutdown", None)
        self.shut_down = True

    def join_helpers(self) -> None:
        for helper in self._helpers:
            helper.join(timeout=10)

"""Backend priority adapters, registered by name. An unknown name fails at start-up."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

from pylon.adapters.base import (
    NO_WRITE,
    AdapterOptions,
    PriorityAdapter,
    PriorityWrite,
    Route,
)
from pylon.adapters.dynamo import DynamoAdapter
from pylon.adapters.passthrough import PassthroughAdapter
from pylon.adapters.sglang import SglangAdapter
from pylon.adapters.vllm import VllmAdapter

ADAPTERS: Mapping[str, Callable[[AdapterOptions], PriorityAdapter]] = {
    DynamoAdapter.name: DynamoAdapter,
    VllmAdapter.name: VllmAdapter,
    SglangAdapter.name: SglangAdapter,
    PassthroughAdapter.name: PassthroughAdapter,
}


class _DisabledAdapter:
    """`--no-derive-priority`: the kill switch. Writes nothing; the strip and the backend's
    routes still apply."""

    name: ClassVar[str] = "disabled"

    def __init__(self, backend: PriorityAdapter) -> None:
        self._backend = backend

    def route(self, method: str, path: str) -> Route | None:
        return self._backend.route(method, path)

    def derive(self, rank: int | None) -> PriorityWrite:
        return NO_WRITE

    def queue_level(self, rank: int | None) -> int:
        return 0  # the engine is told no priority: arrival order for everyone


_: type[PriorityAdapter] = _DisabledAdapter


def build_adapter(backend: str, options: AdapterOptions, *, derive: bool) -> PriorityAdapter:
    factory = ADAPTERS.get(backend)
    if factory is None:
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(ADAPTERS)}")
    adapter = factory(options)
    return adapter if derive else _DisabledAdapter(adapter)


__all__ = [
    "ADAPTERS",
    "AdapterOptions",
    "PriorityAdapter",
    "PriorityWrite",
    "build_adapter",
]

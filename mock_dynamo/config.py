"""Static configuration of a mock engine instance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Flavor = Literal["dynamo", "vllm", "sglang"]
FLAVORS: tuple[str, ...] = get_args(Flavor)
DEFAULT_MODEL = "mock-model"


@dataclass(frozen=True, slots=True)
class MockConfig:
    """Start-up settings. Timing fields are only initial values: the
    `/test-control/knobs` endpoint can change them while the server runs."""

    flavor: Flavor = "dynamo"
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    ttft_ms: float = 0.0
    token_delay_ms: float = 0.0
    num_tokens: int = 16
    capacity: int = 1000

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {self.flavor!r}")
        if not self.models or any(not isinstance(m, str) or not m for m in self.models):
            raise ValueError("models must be a non-empty tuple of non-empty names")
        if self.ttft_ms < 0 or self.token_delay_ms < 0:
            raise ValueError("ttft_ms and token_delay_ms must be >= 0")
        if self.num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")
        if self.capacity < 1:
            raise ValueError("capacity must be >= 1")

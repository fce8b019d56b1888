"""The queue gate (its flags keep their published names, `--queue-admission*`): the 429 a
request gets when pylon's local queue estimate is above what the gateway expected."""

from __future__ import annotations

from pydantic import BaseModel, Field

from pylon.core.queue import QueuePolicy
from pylon.settings.topics import QUEUE, group


class QueueGateSettings(BaseModel):
    """The `Queue gate` topic."""

    queue_admission: bool = Field(
        True,
        description="kill switch for the queue gate: answer 429 queue_estimate_mismatch "
        "(retryable) before the engine sees a request whose local queue estimate is above "
        "what the gateway expected (x-stargate-expected-queue-ms)",
        json_schema_extra=group(QUEUE),
    )
    queue_admission_min_delta_ms: int = Field(
        25,
        ge=0,
        description="additive tolerance: a request is refused only when the local estimate "
        "exceeds max(expected + this, ceil(expected * --queue-admission-factor))",
        json_schema_extra=group(QUEUE, "MS"),
    )
    queue_admission_factor: float = Field(
        1.25,
        ge=1,
        allow_inf_nan=False,
        description="multiplicative tolerance over the gateway's expected queue time (>= 1)",
        json_schema_extra=group(QUEUE, "FACTOR"),
    )
    queue_admission_retry_after_ms: int | None = Field(
        None,
        ge=0,
        description="x-stargate-retry-after-ms sent with a queue_estimate_mismatch 429; "
        "unset = none (retry elsewhere at once)",
        json_schema_extra=group(QUEUE, "MS"),
    )
    initial_input_tps: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="input tokens per second assumed for every model until pylon has measured "
        "its own (5 prefill samples); unset = unknown until then, and unknown admits",
        json_schema_extra=group(QUEUE, "TOKENS/S"),
    )

    # Derived view, so the rest of pylon never re-derives it.
    @property
    def queue_policy(self) -> QueuePolicy:
        """The queue gate's tolerances and its 429's retry hint."""
        return QueuePolicy(
            enabled=self.queue_admission,
            min_delta_ms=self.queue_admission_min_delta_ms,
            factor=self.queue_admission_factor,
            retry_after_ms=self.queue_admission_retry_after_ms,
        )

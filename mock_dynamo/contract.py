"""Request-contract checks that differ between the engines being mimicked.

Pylon must translate requests so each engine accepts them; these checks make
a mistake in that translation fail loudly instead of passing silently.
"""

from __future__ import annotations

from typing import Any

from mock_dynamo.config import Flavor

# Fields of Dynamo's `NvExt` struct; Dynamo deserializes it with
# `deny_unknown_fields`, so anything else is a 400 there.
DYNAMO_NVEXT_FIELDS = frozenset(
    {
        "backend_instance_id",
        "prefill_worker_id",
        "decode_worker_id",
        "dp_rank",
        "prefill_dp_rank",
        "token_data",
        "agent_hints",
        "cache_salt",
        "routing_constraints",
        "router",
        "annotations",
        "extra_fields",
        "request_timestamp_ms",
        "metadata_upload",
        "max_thinking_tokens",
        "greed_sampling",
        "use_raw_prompt",
        "ignore_eos",
        "top_k",
        "repetition_penalty",
        "guided_json",
        "guided_regex",
        "guided_grammar",
        "guided_choice",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
    }
)


def contract_violation(flavor: Flavor, body: dict[str, Any]) -> str | None:
    """Return the engine's rejection message, or None when the body is acceptable."""
    if flavor == "dynamo":
        return _dynamo_nvext_violation(body)
    return _priority_violation(body)


def _dynamo_nvext_violation(body: dict[str, Any]) -> str | None:
    nvext = body.get("nvext")
    if nvext is None:
        return None
    if not isinstance(nvext, dict):
        return "invalid nvext: expected an object"
    unknown = sorted(set(nvext) - DYNAMO_NVEXT_FIELDS)
    if unknown:
        return f"invalid nvext: unknown field `{unknown[0]}`"
    return None


def _priority_violation(body: dict[str, Any]) -> str | None:
    # vLLM and SGLang type `priority` as an int; JSON `true` is not one.
    if "priority" not in body:
        return None
    value = body["priority"]
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    return "invalid priority: expected an integer"

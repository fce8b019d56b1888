"""The strip: pylon is the only writer of what steers the engine.

Pure functions. Every name below is removed case-insensitively, every duplicate, whatever the
surrounding whitespace. There is deliberately no switch to turn this off. The same tables are
rendered in docs/api-contract.md; `tests/unit/test_docs.py` keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pylon.core.http import Header, field_names
from pylon.core.values import static_frozen

_OWS = b" \t"

# RFC 9110 7.6.1 hop-by-hop fields, plus the RFC 2616 ones proxies still see.
HOP_BY_HOP: frozenset[bytes] = frozenset(
    {
        b"connection",
        b"proxy-connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
    }
)

HOP_BY_HOP_REASON = "hop-by-hop"

# Written by pylon itself on the way to the engine, exactly once each (see plan.py). `expect`
# goes too: pylon reads the whole body before it forwards, so the engine never needs a 100.
PYLON_OWNED_REQUEST_HEADERS: frozenset[bytes] = frozenset(
    {b"host", b"content-length", b"expect", b"x-request-id", b"traceparent", b"tracestate"}
)

# Client routing, priority, tenant and session controls: (name, who reads it).
DENIED_REQUEST_HEADERS: Mapping[bytes, str] = {
    # Dynamo aliases of the x-dynamo-* pins (dynamo-contract 1a)
    b"x-worker-instance-id": "dynamo: decode/backend worker pin",
    b"x-prefill-instance-id": "dynamo: prefill worker pin",
    b"x-dp-rank": "dynamo: decode DP-rank pin",
    b"x-data-parallel-rank": "dynamo, vllm, sglang: DP-rank pin",
    b"x-prefill-dp-rank": "dynamo: prefill DP-rank pin",
    # Tenant / cache namespace (dynamo-contract 1b)
    b"x-tenant-id": "dynamo: becomes nvext.cache_salt (KV cache namespace)",
    # Session and agent identity (dynamo-contract 1c; vLLM X-Session-ID)
    b"x-claude-code-session-id": "dynamo: session affinity",
    b"x-claude-code-agent-id": "dynamo: session affinity",
    b"x-claude-code-parent-agent-id": "dynamo: session affinity",
    b"thread-id": "dynamo: session affinity (Codex)",
    b"x-codex-parent-thread-id": "dynamo: session affinity (Codex)",
    b"x-codex-turn-metadata": "dynamo: session affinity (Codex)",
    b"x-session-id": "dynamo, vllm: session affinity",
    b"x-parent-session-id": "dynamo: session affinity",
    b"x-deepseek-harness-session-id": "dynamo: session affinity",
    b"x-deepseek-harness-parent-session-id": "dynamo: session affinity",
    b"x-deepseek-harness-compact": "dynamo: session affinity",
    # Legacy EPP / body-transformer sidecars (dynamo-contract 1d)
    b"x-enable-local-updates": "legacy EPP sidecar",
    b"x-prefiller-host-port": "legacy EPP sidecar: prefill target",
    # vLLM
    b"x-vllm-priority": "vllm: overrides body priority",
    # SGLang
    b"x-custom-labels": "sglang: custom labels header (routing and metrics keys)",
    # llm-d / Gateway API Inference Extension
    b"x-gateway-inference-objective": "llm-d EPP: priority via InferenceObjective",
    # Raw-QUIC tunnel framing; never meaningful to an engine
    b"x-method": "tunnel framing",
    b"x-path": "tunnel framing",
    # Client address claims: pylon's peer is the gateway, so any value here is the caller's word
    b"forwarded": "client address claim (spoofable)",
    b"x-forwarded-for": "client address claim (spoofable)",
    b"x-real-ip": "client address claim (spoofable)",
}

# Whole families, matched by prefix: (prefix, who reads it).
DENIED_REQUEST_HEADER_PREFIXES: tuple[tuple[bytes, str], ...] = (
    (b"x-dynamo-", "dynamo: pins, priority, session, metadata, routing mode"),
    (b"x-stargate-", "gateway-to-pylon metadata; never forwarded to an engine"),
    (b"x-epp-", "legacy EPP sidecar injection"),
    (b"x-gateway-", "gateway API inference extension: destination, objective, fairness id"),
    (b"x-override-", "sglang: request overrides (rid, priority, bootstrap, DP rank)"),
    (b"x-smg-", "sglang model gateway: routing key, priority class"),
)

# Response headers an engine may not set toward the gateway.
DENIED_RESPONSE_HEADER_PREFIXES: tuple[bytes, ...] = (b"x-stargate-",)
# Response headers pylon writes itself (the request's id, the OpenAI SDKs' retry switch beside
# pylon's retry marking): the engine's copies are dropped, so each goes out once, pylon's own.
PYLON_OWNED_RESPONSE_HEADERS: frozenset[bytes] = frozenset({b"x-request-id", b"x-should-retry"})

# Body fields: top-level keys, then keys inside `nvext`, then nested (parent, key) pairs.
DENIED_BODY_FIELDS: Mapping[str, str] = {
    "priority": "vllm, sglang: engine priority (pylon writes its own)",
    "cache_salt": "vllm, sglang, dynamo (legacy): KV cache namespace",
    "data_parallel_rank": "vllm, sglang: DP-rank pin",
    "routed_dp_rank": "sglang: DP-rank pin",
    "disagg_prefill_dp_rank": "sglang: prefill DP-rank pin",
    "bootstrap_host": "sglang: PD bootstrap target",
    "bootstrap_port": "sglang: PD bootstrap target",
    "bootstrap_room": "sglang: PD bootstrap room (duplicates crash schedulers)",
    "rid": "sglang: request id (duplicates block other clients)",
    "routing_key": "sglang: routing-key policy",
    "extra_key": "sglang: prefix-cache namespace",
    "kv_transfer_params": "vllm: P/D connector directives",
    "ec_transfer_params": "vllm: encoder-cache transfer directives",
    "session_id": "vllm: session affinity",
    "session_params": "sglang: session continuation",
    "conversation_id": "sglang: conversation affinity",
    "custom_labels": "sglang: custom labels (routing and metrics keys)",
    "return_routed_experts": "sglang: discloses the routed experts in the response",
    "lora_id": "sglang: LoRA adapter uid (its tokenizer manager sets it from lora_path)",
    "request_id": "vllm: request id (pylon's x-request-id is the only one)",
    "vllm_xargs": "vllm: free-form extension arguments (can carry session_id)",
}

DENIED_NVEXT_FIELDS: Mapping[str, str] = {
    "backend_instance_id": "worker pin",
    "prefill_worker_id": "prefill worker pin",
    "decode_worker_id": "decode worker pin",
    "dp_rank": "DP-rank pin",
    "prefill_dp_rank": "prefill DP-rank pin",
    "token_data": "pre-tokenized prompt (skips tokenization, client-chosen routing hashes)",
    "agent_hints": "priority, strict priority, latency sensitivity, osl, speculative prefill",
    "annotations": "out-of-band disclosure and disagg behaviour",
    "extra_fields": "response disclosure of worker ids and timing",
    "metadata_upload": "egress to a client-chosen URL",
    "request_timestamp_ms": "client-asserted time",
    "routing_constraints": "worker filter and score",
    "router": "router SLO parameters",
    "agent_context": "session / agent identity",
    "cache_salt": "KV cache namespace",
}

DENIED_NESTED_FIELDS: Mapping[tuple[str, str], str] = {
    ("vllm_xargs", "session_id"): "vllm: session affinity through extension args",
}


def header_denied_reason(name: bytes) -> str | None:
    """Why a (normalised, lower-case) request header may not reach the engine, or None."""
    # `find`, not `in`: CPython 3.11 tries a bytes operand of `in` as an integer first and
    # builds (then drops) a TypeError each time; three times the cost on a per-field path.
    if name.find(b"_") >= 0:
        # Underscore twins (`x_dynamo_request_priority`): some servers and CGI-style stacks
        # read them as the dashed name, so they are as dangerous as the original.
        dashed = name.replace(b"_", b"-")
        if dashed in PYLON_OWNED_REQUEST_HEADERS or dashed in _CONTRACT_TWINS:
            return "underscore twin of a tunnel or pylon-owned header"
        reason = header_denied_reason(dashed)
        return None if reason is None else f"underscore twin: {reason}"
    if name in HOP_BY_HOP:
        return HOP_BY_HOP_REASON
    reason = DENIED_REQUEST_HEADERS.get(name)
    if reason is not None:
        return reason
    if name.startswith(_DENIED_PREFIXES):  # one C call for the common miss
        for prefix, prefix_reason in DENIED_REQUEST_HEADER_PREFIXES:
            if name.startswith(prefix):
                return prefix_reason
    return None


_DENIED_PREFIXES = tuple(prefix for prefix, _ in DENIED_REQUEST_HEADER_PREFIXES)


# The tunnel headers pylon reads itself; their underscore twins would look like them downstream.
_CONTRACT_TWINS: frozenset[bytes] = frozenset(
    {b"x-model", b"x-priority", b"x-input-tokens", b"x-routing-key"}
)


def _connection_tokens(headers: Sequence[Header]) -> frozenset[bytes]:
    # Names listed in Connection are hop-by-hop for this message (RFC 9110 7.6.1).
    tokens: set[bytes] = set()
    for name, value in headers:
        if name.strip(_OWS).lower() == b"connection":
            tokens.update(t.strip(_OWS).lower() for t in value.split(b","))
    tokens.discard(b"")
    return frozenset(tokens)


@static_frozen  # one per request: no run-time freeze (see `pylon.core.values`)
class SanitizedHeaders:
    headers: tuple[Header, ...]
    stripped: tuple[str, ...]  # client controls removed (pylon-owned and hop-by-hop excluded)


def sanitize_request_headers(
    headers: Sequence[Header],
    consumed: frozenset[bytes] = frozenset(),
    names: Sequence[bytes] | None = None,
) -> SanitizedHeaders:
    """Drop every denied, hop-by-hop and pylon-owned header; keep the rest in order, unchanged.

    `stripped` reports the client controls removed (denied names, their underscore twins, and
    denied names also listed in `Connection`). Hop-by-hop fields and other names listed in
    `Connection` are connection management, not controls: dropped without a report, like the
    pylon-owned ones. `consumed` names (lower-case) are dropped silently too: pylon used them.
    `names`: the names of `headers` already stripped and lower-cased (`TunnelRequest.names`).
    """
    kept: list[Header] = []
    stripped: list[str] = []
    has_connection = False
    if names is None:
        names = field_names(headers)
    for index, name in enumerate(names):
        if name in PYLON_OWNED_REQUEST_HEADERS or name in consumed:
            continue
        reason = header_denied_reason(name)
        if reason is None:
            kept.append(headers[index])
        elif reason != HOP_BY_HOP_REASON:
            stripped.append(name.decode("latin-1"))  # a client control: reported
        else:
            # connection management, not a client control: dropped unreported
            has_connection = has_connection or name == b"connection"
    if has_connection:  # rare: a second pass only when there is a Connection header
        kept = _without_listed(kept, _connection_tokens(headers))
    return SanitizedHeaders(tuple(kept), tuple(stripped))


def _without_listed(headers: list[Header], listed: frozenset[bytes]) -> list[Header]:
    return [(name, value) for name, value in headers if name.strip(_OWS).lower() not in listed]


@static_frozen  # one per response: no run-time freeze (see `pylon.core.values`)
class ResponseHead:
    """The engine's response head as the client gets it, read in one pass (the one response
    head normaliser: every transport's sink frames `fields` as they are)."""

    status: int
    # Kept fields: names lower case, values without surrounding whitespace, no hop-by-hop,
    # framing, pylon-owned or engine-made retry field (pylon writes its own).
    fields: list[Header]
    content_length: int | None  # the engine's declared body length; None: none or invalid
    event_stream: bool  # content-type text/event-stream


def sanitize_response_head(
    status: int, fields: Sequence[Header], extra_denied: frozenset[bytes] = frozenset()
) -> ResponseHead:
    """Engine -> gateway: drop hop-by-hop, framing, any retry metadata the engine made up and
    the headers pylon writes itself, and read the length and the content type on the way.

    `fields`: the engine's fields with names lower case and values trimmed, as the upstream
    connection reads them (`pylon.upstream.connection`; `normalised_fields` for any other).
    """
    kept: list[Header] = []
    has_connection = typed = event_stream = False
    length: int | None = None
    for field in fields:
        name = field[0]
        if name.find(b"_") >= 0:
            # Underscore twins (`x_stargate_retryable`): the gateway's stack may read `_` as `-`.
            name = name.replace(b"_", b"-")
        if name == b"content-length":
            value = field[1]
            length = int(value) if value.isdigit() else None
            continue
        if name == b"content-type":
            if not typed:  # the first one says (a second is the engine's mistake)
                typed = True
                event_stream = field[1].lower().startswith(b"text/event-stream")
        elif name == b"connection":
            has_connection = True
            continue
        elif (
            name in HOP_BY_HOP
            or name in extra_denied
            or name in PYLON_OWNED_RESPONSE_HEADERS
            or name.startswith(DENIED_RESPONSE_HEADER_PREFIXES)
        ):
            continue
        kept.append(field)
    if has_connection:
        kept = _without_listed(kept, _connection_tokens(fields))
    # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
    return ResponseHead(status, kept, length, event_stream)


def normalised_fields(headers: Sequence[Header]) -> list[Header]:
    """`headers` as the upstream connection reads an engine's: names without surrounding
    whitespace and lower case, values without surrounding whitespace."""
    return [(name.strip(_OWS).lower(), value.strip(_OWS)) for name, value in headers]


def sanitize_response_headers(
    headers: Sequence[Header], extra_denied: frozenset[bytes] = frozenset()
) -> list[Header]:
    """`sanitize_response_head`'s kept fields, for fields of any spelling."""
    return sanitize_response_head(0, normalised_fields(headers), extra_denied).fields


@static_frozen  # one per request: no run-time freeze (see `pylon.core.values`)
class SanitizedBody:
    body: dict[str, Any]
    stripped: tuple[str, ...]  # dotted paths removed, e.g. "nvext.backend_instance_id"

    @property
    def changed(self) -> bool:
        return bool(self.stripped)


def sanitize_body(body: Mapping[str, Any]) -> SanitizedBody:
    """Remove client routing and scheduling controls from a parsed JSON object body.

    Returns a new dict (the input is not mutated). `nvext` stays an object while other keys
    remain; emptied by the strip, it is removed, since pylon never adds an `nvext` key itself.
    """
    stripped: list[str] = []
    result: dict[str, Any] = {}
    for key, value in body.items():
        if key in DENIED_BODY_FIELDS:
            stripped.append(key)
        elif key == "nvext" and isinstance(value, dict):
            nvext = _strip_keys(value, DENIED_NVEXT_FIELDS, "nvext", stripped)
            if nvext or not value:
                result[key] = nvext
        else:
            result[key] = _strip_nested(key, value, stripped)
    return SanitizedBody(result, tuple(stripped))


def _strip_keys(
    obj: Mapping[str, Any], denied: Mapping[str, str], parent: str, stripped: list[str]
) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in obj.items():
        if key in denied:
            stripped.append(f"{parent}.{key}")
        else:
            kept[key] = value
    return kept


def _strip_nested(parent: str, value: Any, stripped: list[str]) -> Any:
    if not isinstance(value, dict):
        return value
    denied = {child: why for (p, child), why in DENIED_NESTED_FIELDS.items() if p == parent}
    if not denied or not any(key in value for key in denied):
        return value
    return _strip_keys(value, denied, parent, stripped)


# --- metrics labels ---------------------------------------------------------------------------

HEADER = "header"
BODY = "body"
OTHER_CONTROL = "_other"


def _header_rule(dashed: str) -> str | None:
    """The deny-list entry a dashed, lower-case header name falls under, as written there."""
    if dashed in _DENIED_HEADER_NAMES:
        return dashed
    for prefix in _DENIED_PREFIX_NAMES:
        if dashed.startswith(prefix):
            return prefix + "*"
    return None


_DENIED_HEADER_NAMES = frozenset(name.decode("ascii") for name in DENIED_REQUEST_HEADERS)
_DENIED_PREFIX_NAMES = tuple(prefix.decode("ascii") for prefix, _ in DENIED_REQUEST_HEADER_PREFIXES)
_TWIN_NAMES = frozenset(
    name.decode("ascii").replace("-", "_") for name in PYLON_OWNED_REQUEST_HEADERS | _CONTRACT_TWINS
)
# `keep_alive`, `proxy_connection`, ...: the underscore spellings of hop-by-hop fields, which a
# stack that reads `_` as `-` would take for connection management: stripped and reported.
_HOP_BY_HOP_TWINS = frozenset(name.decode("ascii").replace("-", "_") for name in HOP_BY_HOP)
_BODY_LABELS = frozenset(
    [
        *DENIED_BODY_FIELDS,
        *(f"nvext.{key}" for key in DENIED_NVEXT_FIELDS),
        *(f"{parent}.{key}" for parent, key in DENIED_NESTED_FIELDS),
    ]
)


def stripped_control_label(name: str) -> tuple[str, str]:
    """(control, location) for one entry of a plan's `stripped`: the metrics labels of a
    removed client control, drawn from a fixed set (`stripped_control_labels`), never free text.

    A header is labelled with the deny-list entry it matched: its own name, or its family's
    prefix rule (`x-dynamo-*`); an underscore twin with the entry's underscore spelling
    (`x_dynamo_*`, `x_model`). A body field is labelled with its path (`nvext.dp_rank`).
    """
    if name in _BODY_LABELS:
        return name, BODY
    if "_" in name:
        if name in _TWIN_NAMES or name in _HOP_BY_HOP_TWINS:
            return name, HEADER
        rule = _header_rule(name.replace("_", "-"))
        return (rule.replace("-", "_"), HEADER) if rule is not None else (OTHER_CONTROL, HEADER)
    rule = _header_rule(name)
    return (rule, HEADER) if rule is not None else (OTHER_CONTROL, HEADER)


def stripped_control_labels() -> frozenset[tuple[str, str]]:
    """Every (control, location) `stripped_control_label` can return."""
    rules = {*_DENIED_HEADER_NAMES, *(prefix + "*" for prefix in _DENIED_PREFIX_NAMES)}
    headers = {
        *rules,
        *(rule.replace("-", "_") for rule in rules),
        *_TWIN_NAMES,
        *_HOP_BY_HOP_TWINS,
    }
    headers.add(OTHER_CONTROL)
    return frozenset({*((label, HEADER) for label in headers), *((p, BODY) for p in _BODY_LABELS)})

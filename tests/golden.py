"""Golden lists: every client control that must never reach an engine, written out by hand.

Independent of the code under test on purpose. These names come from the reference documents
(`dynamo-contract.md`, `engines-and-peers.md`, `pylon-inventory.md`, RFC 9110) and from
docs/api-contract.md, NOT from `pylon.core.sanitize`: a test generated from the deny table deletes
itself together with the entry it should have caught. `tests/unit/test_golden_docs.py` checks that
this module imports nothing from `pylon`. Do not "fix" a failing golden test by deleting the entry
here: find out why the code stopped stripping it.

Source references are abbreviated: DC = dynamo-contract.md, EP = engines-and-peers.md,
PI = pylon-inventory.md, API = docs/api-contract.md.

An entry with `gap` set is named by a reference as a control but is NOT stripped by pylon today.
Its tests run under `xfail(strict=True)`: the gap stays visible, and closing it turns the xfail
into an XPASS failure, which forces whoever closes it to drop the `gap` here (and add the name to
docs/api-contract.md, which the docs tests then require).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True, slots=True)
class Golden:
    name: str  # lower-case header name or prefix, or a dotted body path ("nvext.dp_rank")
    source: str  # where the references name it
    gap: str | None = None  # why it is a known gap (pylon does not strip it today)

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.name.split("."))

    def __str__(self) -> str:  # the test id
        return self.name


G = Golden  # short name for the tables below


def params(entries: Iterable[Golden]) -> list[Any]:
    """One pytest param per entry, id = the name; known gaps are xfail(strict=True)."""
    out = []
    for entry in entries:
        marks = [pytest.mark.xfail(strict=True, reason=f"known gap: {entry.gap}")]
        out.append(pytest.param(entry, id=entry.name, marks=marks if entry.gap else ()))
    return out


def enforced(entries: Iterable[Golden]) -> list[Golden]:
    """The entries pylon must strip today (known gaps left out)."""
    return [entry for entry in entries if entry.gap is None]


# --- request headers, exact names ----------------------------------------------------------------

REQUEST_HEADERS: tuple[Golden, ...] = (
    # Dynamo routing and priority overrides and their aliases
    G("x-dynamo-worker-instance-id", "DC 1a: worker pin -> nvext.backend_instance_id"),
    G("x-worker-instance-id", "DC 1a alias of x-dynamo-worker-instance-id; DC 9 GAIE v0.5 EPP"),
    G("x-dynamo-prefill-instance-id", "DC 1a: prefill pin -> nvext.prefill_worker_id"),
    G("x-prefill-instance-id", "DC 1a alias of x-dynamo-prefill-instance-id"),
    G("x-dynamo-dp-rank", "DC 1a: decode DP-rank pin -> nvext.dp_rank"),
    G("x-dp-rank", "DC 1a alias of x-dynamo-dp-rank"),
    G("x-data-parallel-rank", "DC 1a alias; EP A1 vLLM DP pin; EP A2 SGLang routed_dp_rank"),
    G("x-dynamo-prefill-dp-rank", "DC 1a: prefill DP-rank pin -> nvext.prefill_dp_rank"),
    G("x-prefill-dp-rank", "DC 1a alias of x-dynamo-prefill-dp-rank"),
    G("x-dynamo-request-priority", "DC 1a: agent_hints.priority (pylon writes its own)"),
    G("x-dynamo-request-strict-priority", "DC 1a: agent_hints.strict_priority (pylon writes 0)"),
    # Tenant / cache namespace
    G("x-tenant-id", "DC 1b: becomes nvext.cache_salt, overrides the body"),
    # Session and agent identity
    G("x-dynamo-session-id", "DC 1c: session id (wins over the others)"),
    G("x-dynamo-parent-session-id", "DC 1c: parent session"),
    G("x-dynamo-session-final", "DC 1c: evict_session, session-aware admission"),
    G("x-claude-code-session-id", "DC 1c: Claude Code session"),
    G("x-claude-code-agent-id", "DC 1c: Claude Code agent id is the session"),
    G("x-claude-code-parent-agent-id", "DC 1c: Claude Code parent agent"),
    G("thread-id", "DC 1c: Codex session"),
    G("x-codex-parent-thread-id", "DC 1c: Codex parent session"),
    G("x-codex-turn-metadata", "DC 1c: Codex (newer than 1.6.1)"),
    G("x-session-id", "DC 1c: OpenCode session; EP A1 vLLM X-Session-ID affinity"),
    G("x-parent-session-id", "DC 1c: OpenCode parent session"),
    G("x-deepseek-harness-session-id", "DC 1c: DeepSeek harness (newer than 1.6.1)"),
    G("x-deepseek-harness-parent-session-id", "DC 1c: DeepSeek harness (newer than 1.6.1)"),
    G("x-deepseek-harness-compact", "DC 1c: DeepSeek harness (newer than 1.6.1)"),
    # Other Dynamo routing headers and the legacy EPP / body-transformer sidecars
    G("x-dynamo-meta-policy-class", "DC 1d: picks the router policy class"),
    G("x-dynamo-request-id", "DC 1d: router bookkeeping key"),
    G("x-dynamo-routing-mode", "DC 1d, DC 9: aggregated|disaggregated"),
    G("x-dynamo-epp-prefill-reservation-id", "DC 1d, DC 9: EPP reservation"),
    G("x-enable-local-updates", "DC 1d, DC 9: legacy EPP, frontend skips bookkeeping"),
    G("x-epp-inject-nvext-worker-instance-id", "DC 1d, DC 9: sidecar -> nvext.backend_instance_id"),
    G("x-epp-inject-nvext-token-data", "DC 1d, DC 9: sidecar -> nvext.token_data"),
    G("x-prefiller-host-port", "DC 1d; EP B llm-d decode sidecar prefill target (SSRF)"),
    # Gateway API Inference Extension / llm-d
    G("x-gateway-destination-endpoint", "DC 9, DC 10.1: Envoy destination; agentgateway #3144"),
    G("x-gateway-destination-endpoint-subset", "DC 9: endpoint subset hint"),
    G("x-gateway-destination-endpoint-served", "EP B: which endpoint served"),
    G("x-gateway-inference-objective", "EP priority cheat-sheet: InferenceObjective priority"),
    G(
        "x-gateway-inference-fairness-id",
        "EP B: llm-d EPP takes the fairness id from the client",
    ),
    # vLLM
    G("x-vllm-priority", "EP A1: overrides body priority"),
    # SGLang and its model gateway (SMG)
    G("x-smg-routing-key", "EP A2: routing-key policy"),
    G("x-smg-target-worker", "EP B: sglang-router trusts a client worker pick"),
    G("x-smg-priority", "EP B, priority cheat-sheet: SMG priority class"),
    G("x-override-rid", "EP A2: request overrides"),
    G("x-override-bootstrap-host", "EP A2: request overrides"),
    G("x-override-bootstrap-port", "EP A2: request overrides"),
    G("x-override-bootstrap-room", "EP A2: request overrides"),
    G("x-override-conversation-id", "EP A2: request overrides"),
    G("x-override-routed-dp-rank", "EP A2: request overrides"),
    G("x-override-disagg-prefill-dp-rank", "EP A2: request overrides"),
    G("x-override-priority", "EP A2: request overrides (priority)"),
    G(
        "x-custom-labels",
        "EP A2: SGLang custom-labels header; EP implications: strip 'the custom-labels header'",
    ),
    # Stargate tunnel and gateway metadata (never meaningful to an engine)
    G("x-method", "PI 1.4: raw-QUIC tunnel framing, stripped"),
    G("x-path", "PI 1.4: raw-QUIC tunnel framing, stripped"),
    G("x-stargate-expected-queue-ms", "PI 1.4; API 2: gateway queue estimate"),
    G("x-stargate-upstream-retryable", "PI 1.5: the default engine retry header"),
    G("x-stargate-retryable", "PI 1.5: retry metadata a client could forge"),
    G("x-stargate-retry-reason", "PI 1.5: retry metadata a client could forge"),
    G("x-stargate-retry-after-ms", "PI 1.5: retry metadata a client could forge"),
    G("x-stargate-error-code", "PI (Stargate): stripped from callers"),
    # Client address claims: pylon's peer is the gateway
    G("forwarded", "API 4.1: client address claim (spoofable)"),
    G("x-forwarded-for", "API 4.1: client address claim (spoofable)"),
    G("x-real-ip", "API 4.1: client address claim (spoofable)"),
)

# --- request headers, whole families (any suffix) ------------------------------------------------

REQUEST_HEADER_PREFIXES: tuple[Golden, ...] = (
    G("x-dynamo-", "DC 1a-1d, DC 9: pins, priority, session, metadata, routing mode"),
    G("x-dynamo-meta-", "DC 1d, DC 10.1: 'all x-dynamo-meta-*'"),
    G("x-dynamo-request-", "PI #783: 'any future x-dynamo-request-*'"),
    G("x-stargate-", "API 2, PI 1.5: gateway-to-pylon metadata"),
    G("x-epp-", "DC 1d, DC 9: legacy EPP sidecar injection"),
    G("x-gateway-destination-endpoint", "DC 10.1: 'x-gateway-destination-endpoint*'"),
    G("x-override-", "EP implications: 'all x-override-*'"),
    G("x-smg-", "EP implications: 'x-smg-*'"),
    G(
        "x-gateway-",
        "EP implications: 'Gateway-level: x-smg-*, x-gateway-*, x-prefiller-host-port'",
    ),
)

# --- hop-by-hop, pylon-owned and tunnel-contract request headers --------------------------------

# RFC 9110 7.6.1 (PI 1.5 lists the first seven), plus the RFC 2616 13.5.1 proxy fields (API 4.3).
HOP_BY_HOP: tuple[Golden, ...] = (
    G("connection", "RFC 9110 7.6.1; PI 1.5"),
    G("proxy-connection", "PI 1.5; API 4.3"),
    G("keep-alive", "RFC 9110 7.6.1; PI 1.5"),
    G("transfer-encoding", "RFC 9110 7.6.1; PI 1.5"),
    G("te", "RFC 9110 7.6.1; PI 1.5"),
    G("trailer", "RFC 9110 7.6.1; PI 1.5"),
    G("upgrade", "RFC 9110 7.6.1; PI 1.5"),
    G("proxy-authorization", "RFC 2616 13.5.1; API 4.3"),
    G("proxy-authenticate", "RFC 2616 13.5.1; API 4.3"),
)

# Dropped from the client and rewritten by pylon (or its transport): exactly one, pylon's own.
PYLON_OWNED: tuple[Golden, ...] = (
    G("host", "API 2, 8: Host toward the engine is always pylon's own; PI 1.4"),
    G("content-length", "API 2: the transport writes its own"),
    G("expect", "API 2: pylon reads the whole body, no 100-continue upstream"),
    G("x-request-id", "API 2: the validated value, exactly once"),
    G("traceparent", "API 2: re-sent by pylon, once"),
    G("tracestate", "API 2: re-sent by pylon, once (repeats joined)"),
)

# Read by pylon and forwarded unchanged; only their underscore twins are stripped (API 4.1).
TUNNEL_HEADERS: tuple[str, ...] = ("x-model", "x-priority", "x-input-tokens", "x-routing-key")

# Forwarded as they are (API 4.3 "Forwarded as they are"), with token authentication off.
BENIGN_HEADERS: tuple[str, ...] = (
    "authorization",
    "content-type",
    "accept",
    "x-model",
    "x-input-tokens",
    "x-priority",
    "x-routing-key",
)

# --- response headers (engine -> gateway) --------------------------------------------------------

RESPONSE_HEADER_PREFIXES: tuple[Golden, ...] = (
    G("x-stargate-", "API 4.8, 7: an engine can never forge retry metadata; PI 1.5"),
)
RESPONSE_HEADERS: tuple[Golden, ...] = (
    G("x-stargate-upstream-retryable", "API 7: the default engine retry header; PI 1.5"),
    G("x-stargate-retryable", "API 7; PI 1.5: pylon's own marking only"),
    G("x-stargate-retry-reason", "API 7; PI 1.5: pylon's own marking only"),
    G("x-stargate-retry-after-ms", "API 7; PI 1.5: pylon's own marking only"),
    G("content-length", "API 4.8; PI 1.5: pylon re-frames"),
    G("x-request-id", "API 4.8, 6: pylon echoes the request's own id, once"),
    G("x-should-retry", "API 4.8, 7: the OpenAI SDKs' retry switch follows pylon's marking"),
)

# --- body fields: top level, inside nvext, nested ------------------------------------------------

BODY_FIELDS: tuple[Golden, ...] = (
    G("priority", "EP A1 vLLM, A2 SGLang engine priority (pylon writes its own)"),
    G("cache_salt", "EP A1, A2 prefix-cache namespace; DC 1b, 10.2 legacy top-level salt"),
    G("data_parallel_rank", "EP A2: deprecated alias of routed_dp_rank"),
    G("routed_dp_rank", "EP A2 PDRoutingFields: DP-rank pin"),
    G("disagg_prefill_dp_rank", "EP A2 PDRoutingFields: prefill DP-rank pin"),
    G("bootstrap_host", "EP A2 PDRoutingFields: PD bootstrap target"),
    G("bootstrap_port", "EP A2 PDRoutingFields: PD bootstrap target"),
    G("bootstrap_room", "EP A2, EP C3: duplicates crash schedulers (sglang #40125)"),
    G("rid", "EP A2: client request id, duplicates block other clients"),
    G("routing_key", "EP A2: native /generate routing key"),
    G("conversation_id", "EP A2: native /generate conversation affinity"),
    G("extra_key", "EP A2: prefix-cache namespace"),
    G("session_params", "EP A2: session continuation"),
    G("kv_transfer_params", "EP A1: P/D connector directives"),
    G("ec_transfer_params", "EP A1: encoder-cache transfer directives"),
    G("session_id", "EP A1: vLLM session affinity (body beats header)"),
    G(
        "custom_labels",
        "EP A2 body routing fields; EP implications (SGLang): strip custom_labels",
    ),
    G(
        "return_routed_experts",
        "EP A2 body routing fields",
    ),
    G(
        "lora_id",
        "SGLang GenerateReqInput: LoRA adapter uid, 'should be initialized by tokenizer "
        "manager'; a client's picks an adapter x-model never named (issue 17, rule 2)",
    ),
    G(
        "request_id",
        "EP A1 body fields that steer caching or routing; EP implications: "
        "'request_id/X-Request-Id (re-mint)'",
    ),
    G(
        "vllm_xargs",
        "EP A1 (free-form extension args); EP implications list vllm_xargs as a whole",
    ),
)

NVEXT_FIELDS: tuple[Golden, ...] = (
    G("nvext.backend_instance_id", "DC 3: router worker pin"),
    G("nvext.prefill_worker_id", "DC 3: prefill pin"),
    G("nvext.decode_worker_id", "DC 3: decode pin"),
    G("nvext.dp_rank", "DC 3: decode DP rank"),
    G("nvext.prefill_dp_rank", "DC 3: prefill DP rank"),
    G("nvext.token_data", "DC 3, 11: pre-tokenized prompt, client-chosen routing hashes"),
    G("nvext.agent_hints", "DC 2c, 3: priority, strict priority, latency, osl, spec. prefill"),
    G("nvext.cache_salt", "DC 1b, 3: KV hash namespace"),
    G("nvext.routing_constraints", "DC 3: router worker filter/score"),
    G("nvext.router", "DC 3: router SLO params"),
    G("nvext.annotations", "DC 3: out-of-band disclosure, x-bypass-remote-prefill"),
    G("nvext.extra_fields", "DC 3: response disclosure of worker ids and timing"),
    G("nvext.request_timestamp_ms", "DC 3: client-asserted time"),
    G("nvext.metadata_upload", "DC 3: egress to a client URL (SSRF)"),
    G("nvext.agent_context", "DC 1c, 3: session / agent identity"),
)

NESTED_FIELDS: tuple[Golden, ...] = (
    G("vllm_xargs.session_id", "EP A1: session id through extension args"),
    G("nvext.agent_hints.priority", "DC 2a, 2c: router queue + engine priority"),
    G("nvext.agent_hints.strict_priority", "DC 2a, 2c: router strict tier"),
    G("nvext.agent_hints.latency_sensitivity", "DC 2a, 2c, 10.2: router priority jump"),
    G("nvext.agent_hints.osl", "DC 2c: output-length load prediction"),
    G("nvext.agent_hints.speculative_prefill", "DC 2c, 10.2: extra prefill work"),
)

ALL_BODY_FIELDS: tuple[Golden, ...] = BODY_FIELDS + NVEXT_FIELDS + NESTED_FIELDS

# Documented as passing (API 4.5) or ordinary OpenAI fields.
BENIGN_BODY_FIELDS: tuple[str, ...] = (
    "model",
    "messages",
    "stream",
    "temperature",
    "max_tokens",
    "n",
    "seed",
    "stop",
    "tools",
    "user",
    "metadata",
)
BENIGN_NVEXT_FIELDS: tuple[str, ...] = ("greed_sampling", "use_raw_prompt", "max_thinking_tokens")

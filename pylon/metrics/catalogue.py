"""The catalogue of pylon's metrics: every family's name, type, labels and meaning (`METRICS`),
the bucket bounds of its histograms and the values its bounded labels take.

Nothing here counts or exposes anything: `pylon.metrics.observer` counts into these families and
`pylon.metrics.exposition` writes them out, both by name. docs/operations.md renders `METRICS`
(scripts/gen_operations_doc.py), and tests pin it against their own list.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- bounded label values ---
MODEL_LABEL_LIMIT = 100  # distinct client model names with a label of their own
OTHER_MODEL = "_other"  # every model past the limit
NO_MODEL = "_none"  # requests without a model (health checks, refused before the contract)
# Requests refused at admission whose `x-model` names no model this pylon publishes: client text
# that never becomes a label of its own.
UNPUBLISHED_MODEL = "_unpublished"
STATUS_CLASS = {0: "none", 1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}  # status // 100
BEFORE_HEAD, AFTER_HEAD = "before_head", "after_head"  # an upstream error's `stage`
RETRYABLE = {True: "true", False: "false"}  # a retry marking's `retryable`
TLS_RELOAD_RESULTS = ("ok", "rejected")  # a TLS reload's `result`

# --- histogram bucket bounds ---
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (*SECONDS_BUCKETS, 120.0, 300.0, 600.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
PRIORITY_FRACTIONS = (0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)  # of --priority-ceiling


def priority_buckets(priority_ceiling: int) -> tuple[int, ...]:
    """The engine priority histogram's bounds: `PRIORITY_FRACTIONS` of the ceiling, rounded."""
    return tuple(sorted({round(priority_ceiling * fraction) for fraction in PRIORITY_FRACTIONS}))


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  # as exposed in the Prometheus text format (counters end in _total)
    kind: str  # counter, gauge, histogram or info
    labels: tuple[str, ...]
    help: str


_REQUEST = ("model", "status_class", "transport", "backend")
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "pylon_build_info",
        "info",
        ("version", "python"),
        "pylon's version and the Python running it (value 1)",
    ),
    MetricSpec(
        "pylon_requests_total",
        "counter",
        _REQUEST,
        "requests answered, by the status class of the answer (`none`: the client left before "
        "any answer); pylon's own refusals included",
    ),
    MetricSpec(
        "pylon_requests_in_flight",
        "gauge",
        ("model", "transport", "backend"),
        "requests sent to the engine and not finished yet",
    ),
    MetricSpec(
        "pylon_request_time_to_response_head_seconds",
        "histogram",
        ("model",),
        "from the request head to the response head, for requests the engine answered",
    ),
    MetricSpec(
        "pylon_request_time_to_first_output_seconds",
        "histogram",
        ("model",),
        "from the request head to the first output: the first output event of a stream, the "
        "response head otherwise",
    ),
    MetricSpec(
        "pylon_request_duration_seconds",
        "histogram",
        ("model",),
        "from the request head to the end of the exchange, for requests sent to the engine",
    ),
    MetricSpec(
        "pylon_request_input_tokens",
        "histogram",
        ("model", "source"),
        "input tokens per request: `usage` (the engine's report) or `gateway` (x-input-tokens)",
    ),
    MetricSpec(
        "pylon_request_output_tokens",
        "histogram",
        ("model", "source"),
        "output tokens per request: `usage` (the engine's report) or `estimate` (streamed data "
        "events, when the engine reports no usage)",
    ),
    MetricSpec(
        "pylon_engine_priority",
        "histogram",
        ("backend",),
        "engine priority values pylon derived for requests sent to the engine (buckets: "
        "fractions of --priority-ceiling)",
    ),
    MetricSpec(
        "pylon_upstream_errors_total",
        "counter",
        ("reason", "stage"),
        "engine exchanges that failed: unreachable, busy, timed out or broken (reason: the error "
        "code), before or after the response head (stage)",
    ),
    MetricSpec(
        "pylon_retry_markings_total",
        "counter",
        ("reason", "retryable"),
        "retry markings (x-stargate-retryable, x-stargate-retry-reason) on answers: pylon's own "
        "problems (reason: the error code) and the engine's error statuses",
    ),
    MetricSpec(
        "pylon_stripped_controls_total",
        "counter",
        ("control", "location"),
        "client steering controls removed before the engine (a security signal): the deny-list "
        "rule that matched (a header, a header family such as `x-dynamo-*`, an underscore twin, "
        "or a body field path) and where it was (header or body)",
    ),
    MetricSpec(
        "pylon_transport_events_total",
        "counter",
        ("protocol", "event"),
        "connection-level events: flood guards, malformed frames, client timeouts, cancelled "
        "streams, ...",
    ),
    MetricSpec(
        "pylon_request_crashes_total",
        "counter",
        (),
        "requests pylon failed to handle (a bug; the stream was reset or closed)",
    ),
    MetricSpec(
        "pylon_queue_admission_decisions_total",
        "counter",
        ("result",),
        "queue-admission decisions on requests that carried x-stargate-expected-queue-ms: "
        "`accepted`, `rejected` (429 queue_estimate_mismatch), `unknown_estimate` (let through: no "
        "throughput measured yet) or `disabled` (let through: --no-queue-admission)",
    ),
    MetricSpec(
        "pylon_queue_estimate_milliseconds",
        "gauge",
        ("model", "level"),
        "pylon's local queue estimate for a new request of a model at an engine priority level "
        "(lower levels run first; `idle` = nothing pending ahead, prefill work only); absent "
        "while the model's input throughput is unknown",
    ),
    MetricSpec(
        "pylon_queue_input_tokens_per_second",
        "gauge",
        ("model",),
        "a model's measured prefill throughput (or --initial-input-tps before 5 samples), "
        "which the queue estimates divide by",
    ),
    MetricSpec(
        "pylon_model_discovery_polls_total",
        "counter",
        ("outcome", "reason"),
        "polls of the engine's /v1/models: `ok`, or `failed` with the reason (connect, timeout, "
        "closed, protocol, too_large, status, invalid, error); a failed poll keeps the last set",
    ),
    MetricSpec(
        "pylon_models_published",
        "gauge",
        (),
        "models published now (static --model set or the last good discovery poll)",
    ),
    MetricSpec(
        "pylon_ready",
        "gauge",
        (),
        "1 while /ready answers 200, else 0 (the readiness_changed line says why)",
    ),
    MetricSpec(
        "pylon_tls_certificate_expiry_timestamp_seconds",
        "gauge",
        (),
        "notAfter of the TLS certificate in use, in seconds since the epoch (TLS listeners only)",
    ),
    MetricSpec(
        "pylon_tls_reloads_total",
        "counter",
        ("result",),
        "reloads of --tls-cert / --tls-key: `ok` (the new pair is in use) or `rejected` (kept "
        "the old one)",
    ),
    MetricSpec(
        "pylon_router_catalogue_reloads_total",
        "counter",
        ("result",),
        "worker catalogue reloads (--workers-file, --discover-instances): `changed` (workers "
        "added or removed) or `refused` (a source that cannot be the catalogue; the one in use "
        "stays)",
    ),
    MetricSpec(
        "pylon_router_active_bookings",
        "gauge",
        ("worker",),
        "requests booked on the engine worker and not finished (with --routing other than off)",
    ),
    MetricSpec(
        "pylon_router_worker_healthy",
        "gauge",
        ("worker",),
        "1 while the worker is in rotation (its health checks pass and passive health has not "
        "ejected it), 0 while it is ejected (or not in rotation yet)",
    ),
    MetricSpec(
        "pylon_router_worker_ejected",
        "gauge",
        ("worker",),
        "1 while passive health holds the worker out of rotation (its real answers kept failing), "
        "0 otherwise",
    ),
    MetricSpec(
        "pylon_router_worker_ejections_total",
        "counter",
        ("worker", "reason"),
        "times passive health took the worker out of rotation, by the failure that did it: "
        "`status_5xx`, `connect_failure`, `broken`, `timeout`",
    ),
    MetricSpec(
        "pylon_router_decisions_total",
        "counter",
        ("worker", "policy"),
        "requests booked on the worker, by the policy that chose it (with --routing kv, "
        "`least-loaded` counts the requests with no prompt to route by)",
    ),
    MetricSpec(
        "pylon_router_kv_event_faults_total",
        "counter",
        ("worker", "kind"),
        "faults seen on the worker's KV-event streams (--routing kv): `gap` (messages lost) and "
        "`regressed` (the sequence went back: the engine restarted) each reset the worker's "
        "cache view in the selection core; `malformed` messages are skipped",
    ),
    MetricSpec(
        "pylon_router_select_seconds",
        "histogram",
        ("policy",),
        "time the event loop waited for Dynamo's native select-and-reserve (--routing kv)",
    ),
    MetricSpec(
        "pylon_router_core_active_requests",
        "gauge",
        ("worker",),
        "requests Dynamo's selection core counts on the worker (--routing kv): this pylon's "
        "bookings plus, with --replica-peer, every peer's it heard of",
    ),
    MetricSpec(
        "pylon_router_catalogue_info",
        "info",
        ("digest",),
        "the digest of the worker catalogue (--routing kv; value 1): replicas that share "
        "bookings (--replica-peer) must show the same",
    ),
    MetricSpec(
        "pylon_router_replica_sync_events_total",
        "counter",
        ("peer", "result"),
        "booking events heard from the peer replica (--replica-peer): `applied` (a worker this "
        "pylon knows), `unknown_worker` (Dynamo's core drops it: the catalogues differ), "
        "`malformed`",
    ),
    MetricSpec(
        "pylon_router_authority_connected",
        "gauge",
        (),
        "1 while this process books at the node's booking authority, 0 while it books alone "
        "(the authority is away); absent in a process that has none",
    ),
    MetricSpec(
        "pylon_router_authority_events_total",
        "counter",
        ("event",),
        "this process's link to the node's booking authority: `connects`, `losses` (the "
        "connection lost), `timeouts` (a booking unanswered in time), `local_bookings` (booked "
        "alone while the authority was away or stalled)",
    ),
    MetricSpec(
        "pylon_gateway_registration_connected",
        "gauge",
        ("gateway",),
        "1 while the registration stream to the gateway (its authority, --gateway's watch) is "
        "open and acked, else 0; one series per gateway registered with",
    ),
    MetricSpec(
        "pylon_gateway_acks_total",
        "counter",
        ("gateway",),
        "registration snapshots the gateway acknowledged",
    ),
    MetricSpec(
        "pylon_gateway_reconnects_total",
        "counter",
        ("gateway", "reason"),
        "registration streams to the gateway that ended and are reopened, by reason: "
        "`unauthenticated`, `unavailable`, `connect_timeout`, `token_unreadable`, `ended` (by "
        "the gateway), `error`",
    ),
    MetricSpec(
        "pylon_gateway_model_status",
        "gauge",
        ("gateway", "model"),
        "1 when the model was last advertised ACTIVE to the gateway, 0 INACTIVE (canary "
        "failing, reverse tunnel down, draining); absent while the stream is down",
    ),
    MetricSpec(
        "pylon_gateway_tunnel_connections",
        "gauge",
        ("gateway",),
        "reverse-tunnel connections to the gateway that are up (handshake accepted), of "
        "--tunnel-connections; 0 in direct mode",
    ),
    MetricSpec(
        "pylon_gateway_tunnel_refusals_total",
        "counter",
        ("gateway", "reason"),
        "reverse-tunnel handshakes the gateway refused, by its reason: `empty "
        "inference_server_id`, `authentication failed`, `unauthorized inference_server_id`, "
        "`routing key mismatch`, `duplicate connection`, or `other`",
    ),
)
SPECS = {spec.name: spec for spec in METRICS}  # name -> its spec

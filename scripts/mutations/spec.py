"""What a mutation is, and the names the catalogue is written in: the files it edits, the test
files it names, and the edits every transport's wiring shares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mutations.anchors import Edit, ReplaceExpr

TRANSPORTS = ("http1", "h2", "h3")


@dataclass(frozen=True)
class Mutation:
    """One security control removed or weakened, and the tests that must notice."""

    control: str  # the control, as the audit table names it
    label: str  # what the mutation does to it
    edits: Edit | tuple[Edit, ...]  # made in order; usually one
    # transport ("http1", "h2", "h3" or "core") -> tests, one of which must fail. A spec is a
    # pytest node id; `*` matches any run of characters (for parameter ids). Empty for the
    # golden mutations, whose script names the tests.
    tests: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def all_edits(self) -> tuple[Edit, ...]:
        return self.edits if isinstance(self.edits, tuple) else (self.edits,)

    @property
    def name(self) -> str:
        return f"{self.control}: {self.label}"


def per_transport(spec: str, transports: Sequence[str] = TRANSPORTS) -> dict[str, tuple[str, ...]]:
    """A test parametrized by protocol: its `[...<transport>...]` instance for each transport."""
    return {t: (f"{spec}[*{t}*]",) for t in transports}


# The files the mutations edit.
ADMISSION = "pylon/proxy/admission.py"
ASSEMBLE = "pylon/assemble.py"
AUTH = "pylon/auth.py"
BODY = "pylon/core/body.py"
BRINGUP = "pylon/bringup.py"
CONNECTION = "pylon/upstream/connection.py"
CONTRACT = "pylon/core/contract.py"
FLOOD = "pylon/core/flood.py"
FORWARDING = "pylon/proxy/forwarding.py"
H3LAYER = "pylon/server/h3layer.py"
HEAD = "pylon/core/head.py"
HTTP = "pylon/core/http.py"
HTTP1 = "pylon/server/http1.py"
HTTP2 = "pylon/server/http2.py"
HTTP3 = "pylon/server/http3.py"
INTAKE = "pylon/core/intake.py"
KV_WATCH = "pylon/routing/kv_watch.py"
LOG_RATE = "pylon/core/log_rate.py"
OBSERVE = "pylon/observe.py"
PLAN = "pylon/core/plan.py"
POOL = "pylon/upstream/pool.py"
PROBE = "pylon/upstream/probe.py"
RELAY = "pylon/proxy/relay.py"
SANITIZE = "pylon/core/sanitize.py"
SSE = "pylon/core/sse.py"
STREAMS = "pylon/server/streams.py"
TLS = "pylon/tls.py"

# Test files, shortened in the specs.
AUTH_T = "tests/transport/test_auth.py"
SAME = "tests/transport/test_same_fault_same_answer.py"
FLOODS_T = "tests/transport/test_floods.py"
H1_T = "tests/transport/test_http1_hardening.py"
H2L_T = "tests/transport/test_http2_limits.py"
H2TLS_T = "tests/transport/test_http2_tls.py"
H3ISO_T = "tests/transport/test_http3_isolation.py"
H3TLS_T = "tests/transport/test_http3_tls.py"
SHUT_T = "tests/transport/test_shutdown.py"
GOLDEN_T = "tests/transport/test_golden_every_protocol.py"
CONTRACT_EP_T = "tests/transport/test_contract_every_protocol.py"
QUIC_T = "tests/transport/test_quic_packets.py"
QCA_T = "tests/transport/test_quic_client_auth.py"
LIFE_T = "tests/transport/test_drain.py"
ERRORS_T = "tests/integration/test_errors_and_limits.py"
SEAMS_T = "tests/integration/test_seams.py"
POOL_T = "tests/integration/test_upstream_pool.py"
FAULTS_T = "tests/integration/test_engine_faults.py"
BRINGUP_T = "tests/integration/test_bringup_and_models.py"
RESP_T = "tests/integration/test_response_headers.py"
KV_ROUTING_T = "tests/integration/test_kv_routing.py"
H3L_T = "tests/unit/test_h3layer.py"
HEADS_T = "tests/unit/test_transport_heads.py"
INTAKE_T = "tests/unit/test_intake.py"
CONTRACT_T = "tests/unit/test_contract.py"
SAN_T = "tests/unit/test_sanitize_headers.py"
GOLDEN_H_T = "tests/unit/test_golden_headers.py"


# Each transport's wiring: the scope that builds its StreamTable and the `Ingress` (proxy,
# admission, limits, lifecycle, budget) it hands over there. A mutation hands one transport's
# table a changed copy, as a transport wired to the wrong part would have.
_TABLES = {
    "http1": (HTTP1, "Http1Connection.__init__", "ingress"),
    "h2": (HTTP2, "Http2Connection.__init__", "ingress"),
    "h3": (HTTP3, "Http3Protocol.__init__", "ingress"),
}
_REPLACE = '__import__("dataclasses").replace'


def _table_ingress(transport: str, changes: str) -> Edit:
    path, scope, ingress = _TABLES[transport]
    changed = f"{_REPLACE}({ingress}, {changes})"
    return ReplaceExpr(path, scope, ingress, changed, inside="StreamTable")


def table_limits(transport: str, **changes: str) -> Edit:
    """One transport's StreamTable gets looser limits than the process has configured."""
    ingress = _TABLES[transport][2]
    args = ", ".join(f"{name}={value}" for name, value in changes.items())
    return _table_ingress(transport, f"limits={_REPLACE}({ingress}.limits, {args})")


def without_auth(transport: str) -> Edit:
    """One transport's StreamTable gets an admission without the token check."""
    ingress = _TABLES[transport][2]
    admission = '__import__("pylon.proxy", fromlist=["_"]).ProxyAdmission'
    return _table_ingress(transport, f"admission={admission}({ingress}.lifecycle, None)")

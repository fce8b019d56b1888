"""Remove or weaken one security control at a time; some test must fail for each, per transport.

The project rule: every security control needs a test that fails when that control is removed, on
every transport it applies to. Each mutation below edits pylon/ in place (one or more exact text
replacements), runs the tests named for each transport it applies to, and restores pylon/ with
`git checkout`. A mutation is caught when, for every transport it lists, at least one of that
transport's tests fails. `core` stands for a transport-neutral check reached by unit tests.

Run it in a scratch git worktree, never in a checkout you care about:

    git worktree add --detach /tmp/wt-sec HEAD
    cd /tmp/wt-sec && python scripts/security_mutations.py [--only TEXT] [--full] [--check]

--only TEXT   run only the mutations whose label contains TEXT (repeatable)
--check       only check that every mutation applies and every named test exists
--full        instead of the named tests, run the whole suite (tests/unit, tests/integration,
              tests/transport) with -x and report the first failure: "does any test at all catch
              it?" (the audit's "before" column, where the named tests may not exist yet)
--markdown    print the final table as Markdown
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TRANSPORTS = ("http1", "h2", "h3")
SUITE = ["tests/unit", "tests/integration", "tests/transport"]

ADMISSION = "pylon/proxy/admission.py"
ASSEMBLE = "pylon/assemble.py"
AUTH = "pylon/auth.py"
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
SANITIZE = "pylon/core/sanitize.py"
STREAMS = "pylon/server/streams.py"
TLS = "pylon/tls.py"

# Test files, shortened in the specs below.
AUTH_T = "tests/transport/test_auth.py"
SAME = "tests/transport/test_same_fault_same_answer.py"
FLOODS_T = "tests/transport/test_floods.py"
H1_T = "tests/transport/test_http1_hardening.py"
H2_T = "tests/transport/test_http2.py"
H2L_T = "tests/transport/test_http2_limits.py"
H2TLS_T = "tests/transport/test_http2_tls.py"
H3ISO_T = "tests/transport/test_http3_isolation.py"
H3TLS_T = "tests/transport/test_http3_tls.py"
H3FWD_T = "tests/transport/test_http3_forwarding.py"
SHUT_T = "tests/transport/test_shutdown.py"
GOLDEN_T = "tests/transport/test_golden_every_protocol.py"
CONTRACT_EP_T = "tests/transport/test_contract_every_protocol.py"
QUIC_T = "tests/transport/test_quic_packets.py"
ERRORS_T = "tests/integration/test_errors_and_limits.py"
SEAMS_T = "tests/integration/test_seams.py"
FWD_T = "tests/integration/test_forwarding.py"
POOL_T = "tests/integration/test_upstream_pool.py"
H3L_T = "tests/unit/test_h3layer.py"
HEADS_T = "tests/unit/test_transport_heads.py"
INTAKE_T = "tests/unit/test_intake.py"
CONTRACT_T = "tests/unit/test_contract.py"
SAN_T = "tests/unit/test_sanitize_headers.py"
GOLDEN_H_T = "tests/unit/test_golden_headers.py"
GOLDEN_B_T = "tests/unit/test_golden_body.py"
# Added by this audit.
QCA_T = "tests/transport/test_quic_client_auth.py"
LIFE_T = "tests/transport/test_drain.py"
BRINGUP_T = "tests/integration/test_bringup_and_models.py"
RESP_T = "tests/integration/test_response_headers.py"


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutation:
    control: str  # the control, as the audit table names it
    label: str  # what the mutation does to it
    edits: tuple[Edit, ...]
    # transport ("http1", "h2", "h3" or "core") -> tests, one of which must fail. A spec is a
    # pytest node id; `*` matches any run of characters (for parameter ids).
    tests: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def edit(path: str, old: str, new: str) -> tuple[Edit, ...]:
    return (Edit(path, old, new),)


def never(path: str, condition: str) -> tuple[Edit, ...]:
    """`if <condition>:` becomes `if False:`: the check is there and never fires."""
    return edit(path, f"if {condition}:", "if False:")


def per_transport(spec: str, transports: Sequence[str] = TRANSPORTS) -> dict[str, tuple[str, ...]]:
    """A test parametrized by protocol: its `[...<transport>...]` instance for each transport."""
    return {t: (f"{spec}[*{t}*]",) for t in transports}


# Each transport's wiring: the injected `Ingress` (proxy, admission, limits, lifecycle, budget)
# handed to its StreamTable, in one place each. A mutation hands one transport's table a changed
# copy, as a transport wired to the wrong part would have.
_TABLES = {
    "http1": (HTTP1, 'StreamTable("http1", self, ingress, self._loop, serial=True)', "ingress"),
    "h2": (HTTP2, 'StreamTable("h2", self, ingress, self.loop)', "ingress"),
    "h3": (HTTP3, 'StreamTable("h3", self, server.ingress, self._loop)', "server.ingress"),
}
_REPLACE = '__import__("dataclasses").replace'


def _table_ingress(transport: str, changes: str) -> tuple[Edit, ...]:
    path, table, ingress = _TABLES[transport]
    return edit(path, table, table.replace(f" {ingress},", f" {_REPLACE}({ingress}, {changes}),"))


def table_limits(transport: str, **changes: str) -> tuple[Edit, ...]:
    """One transport's StreamTable gets looser limits than the process has configured."""
    ingress = _TABLES[transport][2]
    args = ", ".join(f"{name}={value}" for name, value in changes.items())
    return _table_ingress(transport, f"limits={_REPLACE}({ingress}.limits, {args})")


def without_auth(transport: str) -> tuple[Edit, ...]:
    """One transport's StreamTable gets an admission without the token check."""
    ingress = _TABLES[transport][2]
    admission = '__import__("pylon.proxy", fromlist=["_"]).ProxyAdmission'
    return _table_ingress(transport, f"admission={admission}({ingress}.lifecycle, None)")


MUTATIONS: list[Mutation] = [
    # --- tunnel token auth ---
    Mutation(
        "tunnel token auth",
        "token never checked",
        never(ADMISSION, "self._auth is not None and not self._auth.allows(request.headers)"),
        per_transport(f"{SAME}::test_missing_tunnel_token_is_401_on_every_transport"),
    ),
    *(
        Mutation(
            "tunnel token auth",
            f"skipped on {t} only (its stream table gets an admission without auth)",
            without_auth(t),
            {t: (f"{SAME}::test_missing_tunnel_token_is_401_on_every_transport[{t}]",)},
        )
        for t in TRANSPORTS
    ),
    Mutation(
        "tunnel token auth",
        "authorization forwarded to the engine (Planner consumed=empty)",
        edit(
            ASSEMBLE,
            "consumed=auth.consumed if auth is not None else frozenset())",
            "consumed=frozenset())",
        ),
        per_transport(f"{SAME}::test_missing_tunnel_token_is_401_on_every_transport"),
    ),
    Mutation(
        "tunnel token auth",
        "a second authorization header is ignored (first wins)",
        edit(AUTH, "return False  # two credentials: ambiguous, refuse", "continue"),
        {"core": (f"{AUTH_T}::test_two_authorization_headers_are_refused[*]",)},
    ),
    Mutation(
        "tunnel token auth",
        "Bearer scheme not checked",
        edit(
            AUTH,
            "if presented is None or presented[:7].lower() != _BEARER:",
            "if presented is None:",
        ),
        {"core": (f"{AUTH_T}::test_token_under_another_scheme_is_refused[*]",)},
    ),
    Mutation(
        "tunnel token auth",
        "rotated token file never re-read",
        edit(
            AUTH,
            "    def _refresh(self) -> None:\n",
            "    def _refresh(self) -> None:\n        return\n",
        ),
        {"core": (f"{AUTH_T}::test_rotated_token_file_is_picked_up[*]",)},
    ),
    Mutation(
        "tunnel token auth",
        "/health bypass for any method",
        edit(
            CONTRACT,
            'return method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] == HEALTH_PATH',
            'return target.split(b"?", 1)[0] == HEALTH_PATH',
        ),
        {
            "core": (f"{CONTRACT_T}::test_only_get_head_exact_health_bypass[*]",),
            **per_transport(f"{AUTH_T}::test_only_get_and_head_of_exactly_health_skip_the_token"),
        },
    ),
    Mutation(
        "tunnel token auth",
        "/health bypass for any path starting /health",
        edit(
            CONTRACT,
            'return method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] == HEALTH_PATH',
            'return method in (b"GET", b"HEAD") and target.startswith(HEALTH_PATH)',
        ),
        {
            "core": (f"{CONTRACT_T}::test_only_get_head_exact_health_bypass[*]",),
            **per_transport(f"{AUTH_T}::test_only_get_and_head_of_exactly_health_skip_the_token"),
        },
    ),
    Mutation(
        "tunnel token auth",
        "declared body limit (413) answered before the token (401)",
        edit(
            INTAKE,
            "        try:\n            self.request = self._admission.admit(head)\n"
            "        except PylonError as error:\n            return self._reject(error)\n"
            "        declared = head.content_length\n",
            "        declared = head.content_length\n"
            "        if declared is not None and declared > self._limits.max_body_bytes:\n"
            "            known = __import__('pylon.core.contract', fromlist=['_']).request_id_of\n"
            "            limit = self._limits.max_body_bytes\n"
            "            return self._reject(body_too_large(limit, known(head.headers)))\n"
            "        try:\n            self.request = self._admission.admit(head)\n"
            "        except PylonError as error:\n            return self._reject(error)\n",
        ),
        per_transport(f"{SAME}::test_missing_token_is_answered_before_the_declared_body_length"),
    ),
    # --- mTLS ---
    Mutation(
        "mTLS (TCP)",
        "client certificate optional (CERT_OPTIONAL)",
        edit(
            TLS,
            "context.verify_mode = ssl.CERT_REQUIRED",
            "context.verify_mode = ssl.CERT_OPTIONAL",
        ),
        {
            "http1": (f"{H2TLS_T}::test_mtls_requires_a_client_certificate_from_the_ca",),
            "h2": (f"{H2TLS_T}::test_mtls_requires_a_client_certificate_from_the_ca",),
        },
    ),
    Mutation(
        "mTLS (TCP)",
        "client CA not given to the TCP context",
        edit(
            TLS,
            "context = build_server_ssl_context(self._material, alpn, self.client_ca)",
            "context = build_server_ssl_context(self._material, alpn, None)",
        ),
        {
            "http1": (f"{H2TLS_T}::test_mtls_requires_a_client_certificate_from_the_ca",),
            "h2": (f"{H2TLS_T}::test_mtls_requires_a_client_certificate_from_the_ca",),
        },
    ),
    Mutation(
        "TLS (TCP)",
        "minimum version lowered to TLS 1.0",
        edit(
            TLS,
            "context.minimum_version = ssl.TLSVersion.TLSv1_2",
            "context.minimum_version = ssl.TLSVersion.TLSv1",
        ),
        {
            "http1": (f"{H3TLS_T}::test_ssl_context_for_tcp_listeners",),
            "h2": (f"{H3TLS_T}::test_ssl_context_for_tcp_listeners",),
        },
    ),
    Mutation(
        "mTLS (QUIC)",
        "client chain not verified",
        edit(
            TLS,
            "            self._client_verifier.verify(certificate, chain)\n",
            "            pass\n",
        ),
        {"h3": (f"{H3TLS_T}::test_quic_mutual_tls",)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "connection without a certificate accepted (verify_client)",
        edit(TLS, 'return "no client certificate"', "return None"),
        {"h3": (f"{H3TLS_T}::test_quic_mutual_tls",)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "Http3Protocol._check_client_certificate skipped",
        edit(
            HTTP3,
            "        if identity.client_ca is None:\n            return\n        certificate,",
            "        if True:\n            return\n        certificate,",
        ),
        {"h3": (f"{H3TLS_T}::test_quic_mutual_tls",)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "CertificateRequest not sent (request_client_certificate)",
        edit(HTTP3, "            request_client_certificate(quic)\n", "            pass\n"),
        {"h3": (f"{H3TLS_T}::test_quic_mutual_tls",)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "refused connection still reads what came with the handshake (_refused)",
        edit(HTTP3, "        self._refused = True\n", ""),
        {
            "h3": (
                f"{QCA_T}::test_a_request_riding_with_a_refused_handshake_never_reaches_the_engine",
            )
        },
    ),
    Mutation(
        "mTLS (QUIC)",
        "refused connection never forgotten (its ConnectionTerminated swallowed)",
        edit(
            HTTP3,
            "if self._refused and not isinstance(event, ConnectionTerminated):",
            "if self._refused:",
        ),
        {"h3": (f"{QCA_T}::test_a_refused_connection_is_forgotten_once_it_ends",)},
    ),
    Mutation(
        "QUIC 0-RTT",
        "session tickets issued (resumption, hence replayable 0-RTT)",
        edit(
            HTTP3,
            "                retry=self.options.retry,\n            ),",
            "                retry=self.options.retry,\n"
            "                session_ticket_fetcher=self.__dict__.setdefault('_t', {}).pop,\n"
            "                session_ticket_handler=lambda t: self.__dict__.setdefault('_t', {})"
            ".__setitem__(t.ticket, t),\n            ),",
        ),
        {"h3": (f"{QCA_T}::test_quic_issues_no_session_ticket",)},
    ),
    Mutation(
        "QUIC address validation",
        "Retry disabled",
        edit(
            HTTP3, "                retry=self.options.retry,\n", "                retry=False,\n"
        ),
        {"h3": (f"{QUIC_T}::test_unvalidated_source_gets_at_most_three_times_its_bytes[True]",)},
    ),
    # --- header limits ---
    Mutation(
        "header limits",
        "HTTP/1.1 header bytes not counted (_head_over_limits)",
        never(HTTP1, "self._head_bytes > self._limits.max_header_bytes"),
        {"http1": (f"{ERRORS_T}::test_header_limits_are_431",)},
    ),
    Mutation(
        "header limits",
        "HTTP/1.1 header count not checked (max_headers)",
        never(HTTP1, "len(self._headers) > self._limits.max_headers"),
        {"http1": (f"{SAME}::test_too_many_header_fields_is_431[http1]",)},
    ),
    Mutation(
        "header limits",
        "HTTP/2 check_header_block call removed",
        edit(
            HTTP2,
            "            check_header_block(fields, self._limits.max_headers, "
            "self._limits.max_header_bytes)\n",
            "",
        ),
        {
            "h2": (
                f"{SAME}::test_too_many_header_fields_is_431[h2]",
                f"{H2L_T}::test_header_bytes_over_limit_is_431",
            )
        },
    ),
    Mutation(
        "header limits",
        "HTTP/3 check_header_block call removed",
        edit(
            HTTP3,
            "            check_header_block(\n"
            "                event.headers, self._limits.max_headers, "
            "self._limits.max_header_bytes\n"
            "            )\n",
            "",
        ),
        {
            "h3": (
                f"{SAME}::test_too_many_header_fields_is_431[h3]",
                f"{H3ISO_T}::test_header_bytes_over_the_limit_is_431",
            )
        },
    ),
    Mutation(
        "header limits",
        "HTTP/3 header block over the limit read and decoded (h3layer)",
        never(H3LAYER, "length > self._max_header_block"),
        {"h3": (f"{H3L_T}::test_oversized_header_block_is_refused_unread_with_bounded_memory",)},
    ),
    Mutation(
        "header limits",
        "HTTP/2 hard HPACK cap lifted",
        edit(
            HTTP2,
            "hard_headers = max(64 * KiB, 2 * (limits.max_header_bytes + 32 * limits.max_headers))",
            "hard_headers = 2**31 - 1",
        ),
        {"h2": (f"{H2L_T}::test_hpack_bomb_past_the_hard_cap_is_a_connection_error",)},
    ),
    Mutation(
        "header limits",
        "trailer section not held to the limits",
        edit(
            INTAKE,
            "            check_header_block(fields, limits.max_headers, limits.max_header_bytes)\n"
            "        except LimitError",
            "            pass\n        except LimitError",
        ),
        {
            "core": (
                f"{INTAKE_T}::test_trailers_over_the_limits_or_with_pseudo_headers_are_rejected",
            ),
            "h2": (f"{SAME}::test_trailers_over_the_header_limits_are_431[h2]",),
            "h3": (f"{SAME}::test_trailers_over_the_header_limits_are_431[h3]",),
        },
    ),
    Mutation(
        "header limits",
        "pseudo-header in trailers accepted (intake)",
        edit(HEAD, '        return "pseudo-header in trailers"', "        return None"),
        {
            "core": (
                f"{INTAKE_T}::test_trailers_over_the_limits_or_with_pseudo_headers_are_rejected",
            ),
            "h2": (f"{SAME}::test_pseudo_header_in_trailers_is_400[h2]",),
        },
    ),
    Mutation(
        "header limits",
        "HTTP/2 trailers end the request unchecked",
        edit(
            HTTP2,
            "            self._table.trailers(sid, stream.trailers)",
            "            self._table.end(sid)",
        ),
        {
            "h2": (
                f"{SAME}::test_trailers_over_the_header_limits_are_431[h2]",
                f"{SAME}::test_pseudo_header_in_trailers_is_400[h2]",
            )
        },
    ),
    Mutation(
        "header limits",
        "HTTP/3 trailers end the request unchecked",
        edit(
            HTTP3,
            "            self._table.trailers(event.stream_id, event.headers)",
            "            self._table.end(event.stream_id)",
        ),
        {"h3": (f"{SAME}::test_trailers_over_the_header_limits_are_431[h3]",)},
    ),
    Mutation(
        "header limits",
        "pseudo-header in HTTP/3 trailers accepted (h3layer)",
        never(H3LAYER, 'name[:1] == b":"'),
        {"h3": (f"{H3L_T}::test_malformed_request_is_a_stream_error_and_others_keep_working[*]",)},
    ),
    # --- body limits ---
    Mutation(
        "body limit",
        "declared length not checked (receive_head)",
        never(INTAKE, "declared is not None and declared > self._limits.max_body_bytes"),
        {
            "http1": (f"{ERRORS_T}::test_declared_body_over_limit_is_413_before_reading",),
            "h2": (f"{H2L_T}::test_declared_body_over_limit_is_413_at_headers",),
            "h3": (f"{H3ISO_T}::test_declared_body_over_the_limit_is_413_at_once",),
        },
    ),
    Mutation(
        "body limit",
        "streamed size not checked (receive_data)",
        never(INTAKE, "size > self._limits.max_body_bytes"),
        {
            "http1": (f"{ERRORS_T}::test_chunked_body_over_limit_is_413",),
            "h2": (f"{H2L_T}::test_streamed_body_over_limit_is_413",),
            "h3": (f"{H3ISO_T}::test_streamed_body_over_the_limit_is_413",),
        },
    ),
    *(
        Mutation(
            "body limit",
            f"{t} stream table without the body limit",
            table_limits(t, max_body_bytes="1 << 62"),
            {t: (f"{SAME}::test_body_over_the_limit_is_413_with_the_request_id[{t}]",)},
        )
        for t in TRANSPORTS
    ),
    # --- the head: wire safety, pseudo-headers, HTTP/1.1 rules, content-length ---
    Mutation(
        "wire safety",
        "wire_unsafe never objects",
        edit(
            HTTP,
            "the joined names and values, so the cost does not grow with the number of fields.\n"
            '    """\n',
            "the joined names and values, so the cost does not grow with the number of fields.\n"
            '    """\n    return None\n',
        ),
        {
            # llhttp refuses these bytes itself: on HTTP/1.1 only a unit test sees the check.
            "core": (f"{HEADS_T}::test_http1_head_checks_host_and_wire_safety",),
            **per_transport(
                f"{SAME}::test_control_character_in_a_field_value_is_400", ["h2", "h3"]
            ),
        },
    ),
    Mutation(
        "wire safety",
        "skipped for HTTP/1.1 heads (http1_head)",
        edit(
            HEAD,
            "    return _finish(method, target, list(fields), names)",
            "    return RequestHead(method, target, list(fields), declared_length(fields))",
        ),
        {"core": (f"{HEADS_T}::test_http1_head_checks_host_and_wire_safety",)},
    ),
    Mutation(
        "wire safety",
        "skipped for HTTP/2 and HTTP/3 heads (pseudo_head)",
        edit(
            HEAD,
            "    return _finish(method, path, headers, [name for name, _ in headers])",
            "    return RequestHead(method, path, headers, declared_length(headers))",
        ),
        per_transport(f"{SAME}::test_control_character_in_a_field_value_is_400", ["h2", "h3"]),
    ),
    Mutation(
        "wire safety",
        "field-name token check off",
        never(HTTP, 'not _TOKEN_LINES.fullmatch(b"\\n".join([name for name, _ in headers]))'),
        {"core": (f"{HEADS_T}::test_wire_unsafe_agrees_with_a_field_by_field_check",)},
    ),
    Mutation(
        "wire safety",
        "field-value control check off",
        edit(
            HTTP, "    if _UNSAFE_VALUE_BYTE.search(", "    if False and _UNSAFE_VALUE_BYTE.search("
        ),
        {
            "core": (f"{HEADS_T}::test_http1_head_checks_host_and_wire_safety",),
            **per_transport(
                f"{SAME}::test_control_character_in_a_field_value_is_400", ["h2", "h3"]
            ),
        },
    ),
    *(
        Mutation(
            "pseudo-header rules",
            label,
            never(HEAD, condition),
            {"h2": (h2,), "h3": (h3,)} if h3 else {"core": (h2,)},
        )
        # (label, condition, HTTP/2 test, HTTP/3 test); no HTTP/3 test: a rule only a unit test
        # can see, as a later layer (the contract) refuses the same requests anyway.
        for label, condition, h2, h3 in [
            (
                "edge whitespace in values",
                "_EDGE_WHITESPACE.search(value)",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[value_leading_space]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[value_with_leading_space]",
            ),
            (
                ":method not a token",
                "not TOKEN.fullmatch(method)",
                f"{HEADS_T}::test_each_pseudo_header_is_checked_by_the_head_itself[*:method*]",
                None,
            ),
            (
                ":scheme not a URI scheme",
                "not _SCHEME.fullmatch(scheme)",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[scheme_not_a_scheme]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[scheme_not_a_scheme]",
            ),
            (
                ":path not origin-form",
                "not _PATH.fullmatch(path)",
                f"{HEADS_T}::test_each_pseudo_header_is_checked_by_the_head_itself[*:path*]",
                None,
            ),
            (
                "pseudo-header after a regular field",
                "after_regular",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[pseudo_after_regular]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[pseudo_after_regular]",
            ),
            (
                "unknown pseudo-header (:protocol)",
                "name not in _REQUEST_PSEUDO",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[unknown_pseudo]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[unknown_pseudo]",
            ),
            (
                "repeated pseudo-header",
                "name in pseudo",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[repeated_path]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[repeated_path]",
            ),
            (
                "field name not a lowercase token",
                "not _LOWER_TOKEN.fullmatch(name)",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[uppercase_name]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[uppercase_name]",
            ),
            (
                "connection-specific field",
                "name in _CONNECTION_SPECIFIC",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[connection]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[connection_header]",
            ),
            (
                "te other than trailers",
                'name == b"te" and value != b"trailers"',
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[te_gzip]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[te_not_trailers]",
            ),
            (
                ":authority empty or with userinfo",
                'not authority or authority.find(b"@") >= 0',
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[authority_userinfo]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[authority_userinfo]",
            ),
            (
                "host differing from :authority",
                "any(host != authority for host in hosts)",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[host_differs]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[host_differs]",
            ),
            (
                ":authority or host required",
                "not hosts and scheme in _AUTHORITY_SCHEMES",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[missing_authority]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[missing_authority]",
            ),
            (
                "repeated host without :authority",
                "len(hosts) > 1",
                f"{H2L_T}::test_malformed_header_block_is_a_400_on_that_stream_only[two_hosts_no_authority]",
                f"{H3ISO_T}::test_malformed_request_costs_only_its_stream[two_hosts_no_authority]",
            ),
        ]
    ),
    Mutation(
        "HTTP/1.1 head rules",
        "exactly one Host not enforced",
        never(HEAD, "hosts > 1 or (hosts == 0 and not http10)"),
        {"http1": (f"{H1_T}::test_smuggling_shapes_are_400_and_close[two_hosts]",)},
    ),
    Mutation(
        "HTTP/1.1 head rules",
        "Transfer-Encoding on HTTP/1.0 accepted",
        never(HEAD, 'http10 and b"transfer-encoding" in names'),
        {"http1": (f"{H1_T}::test_smuggling_shapes_are_400_and_close[te_on_http10]",)},
    ),
    Mutation(
        "content-length",
        "declared_length takes the last of differing values",
        edit(
            HEAD,
            "if not value.isdigit() or (found is not None and value != found):",
            "if not value.isdigit():",
        ),
        {"core": (f"{HEADS_T}::test_declared_length",)},
    ),
    Mutation(
        "request target",
        "origin-form target not checked (contract)",
        edit(
            CONTRACT,
            '        not target.startswith(b"/")\n        or target.startswith(b"//")\n'
            "        or not _VISIBLE_ASCII.fullmatch(target)\n",
            "        False\n",
        ),
        {
            "core": (f"{CONTRACT_T}::test_only_origin_form_targets[*]",),
        },
    ),
    Mutation(
        "request target",
        "ambiguous path accepted (dot or empty segments, encoded separators, fragment)",
        never(CONTRACT, 'b"#" in target or _AMBIGUOUS_PATH.search(target.split(b"?", 1)[0])'),
        per_transport(f"{SAME}::test_an_ambiguous_request_path_is_400"),
    ),
    Mutation(
        "request target",
        "/health query not checked for visible ASCII",
        never(CONTRACT, "not _VISIBLE_ASCII.fullmatch(target)"),
        {"core": (f"{CONTRACT_T}::test_health_with_non_ascii_query_is_a_contract_error",)},
    ),
    Mutation(
        "method allow-list",
        "any method accepted",
        never(CONTRACT, "method not in _ALLOWED_METHODS"),
        {
            "core": (f"{CONTRACT_T}::test_unsupported_methods[*]",),
        },
    ),
    Mutation(
        "duplicate contract headers",
        "repeated contract header: first copy wins",
        edit(
            CONTRACT,
            "    if len(found) > 1:\n        raise ContractError(",
            "    if False:\n        raise ContractError(",
        ),
        {
            "core": (f"{CONTRACT_T}::test_duplicate_priority_rejected_even_when_equal",),
        },
    ),
    Mutation(
        "x-request-id validation",
        "any bytes and length accepted",
        never(CONTRACT, "len(raw) > MAX_REQUEST_ID_CHARS or not _VISIBLE_ASCII.fullmatch(raw)"),
        {"core": (f"{CONTRACT_T}::test_request_id_invalid[*]",)},
    ),
    # --- the stall clock and the connection timers ---
    Mutation(
        "stall clock",
        "intake tick never rejects",
        edit(
            INTAKE,
            "        if now - self.progress < self._limits.stall_timeout:\n            return None",
            "        if True:\n            return None",
        ),
        {
            "http1": (f"{H1_T}::test_stalled_body_is_408_after_the_header_timeout",),
            "h2": (f"{H2L_T}::test_stalled_request_body_is_408_on_that_stream_only",),
            "h3": (f"{H3ISO_T}::test_stalled_request_body_is_408_on_that_stream_only",),
        },
    ),
    Mutation(
        "stall clock",
        "stall watcher never armed (StreamTable.head)",
        edit(
            STREAMS,
            "            self._stall_watch.arm(self._limits.stall_timeout)",
            "            pass",
        ),
        {
            "http1": (f"{H1_T}::test_stalled_body_is_408_after_the_header_timeout",),
            "h2": (f"{H2L_T}::test_stalled_request_body_is_408_on_that_stream_only",),
            "h3": (f"{H3ISO_T}::test_stalled_request_body_is_408_on_that_stream_only",),
        },
    ),
    *(
        Mutation(
            "stall clock",
            f"{t} stream table without the stall clock",
            table_limits(t, stall_timeout="1e9"),
            {t: (test,)},
        )
        for t, test in [
            ("http1", f"{H1_T}::test_stalled_body_is_408_after_the_header_timeout"),
            ("h2", f"{H2L_T}::test_stalled_request_body_is_408_on_that_stream_only"),
            ("h3", f"{H3ISO_T}::test_stalled_request_body_is_408_on_that_stream_only"),
        ]
    ),
    Mutation(
        "HTTP/1.1 head timer",
        "a started head never times out",
        never(HTTP1, "stream is not None and stream.intake.state is AWAITING_HEAD"),
        {"http1": (f"{H1_T}::test_slowloris_head_is_closed_after_the_header_timeout",)},
    ),
    Mutation(
        "HTTP/1.1 head timer",
        "every read restarts the head clock",
        edit(
            HTTP1,
            "        try:\n            self._parser.feed_data(data)",
            "        self._timer.arm(self._limits.stall_timeout)\n"
            "        try:\n            self._parser.feed_data(data)",
        ),
        {"http1": (f"{H1_T}::test_slowloris_head_is_closed_after_the_header_timeout",)},
    ),
    Mutation(
        "HTTP/1.1 head timer",
        "not armed when the connection is handed over",
        edit(
            HTTP1,
            "        self._timer.arm(self._limits.stall_timeout)\n"
            "        self._lifecycle.on_drain(self.graceful_close)",
            "        self._lifecycle.on_drain(self.graceful_close)",
        ),
        {
            "http1": (
                f"{H2TLS_T}::test_silent_tls_client_is_closed_after_the_header_timeout[http/1.1]",
            )
        },
    ),
    Mutation(
        "idle timers",
        "HTTP/1.1 idle keep-alive never closed",
        edit(
            HTTP1,
            '            self._observer.transport_event("client_timeout", "http1", timer="idle")\n'
            "            self.abort()",
            '            self._observer.transport_event("client_timeout", "http1", timer="idle")',
        ),
        {"http1": (f"{H1_T}::test_idle_keep_alive_connection_is_closed",)},
    ),
    Mutation(
        "idle timers",
        "HTTP/2 idle connection never closed",
        edit(
            HTTP2,
            '        self._observer.transport_event("client_timeout", "h2", timer="idle")\n'
            "        self._h2.close_connection()\n",
            "        return\n        self._h2.close_connection()\n",
        ),
        {"h2": (f"{H2L_T}::test_idle_connection_gets_goaway",)},
    ),
    Mutation(
        "idle timers",
        "HTTP/2 connection silent after its preface never closed",
        edit(
            HTTP2,
            "        self._start_h2()\n        self._timer.arm(self._limits.stall_timeout)\n",
            "        self._start_h2()\n",
        ),
        {
            "h2": (
                f"{H2L_T}::test_connection_silent_after_its_preface_is_closed_after_the_header_timeout",
                f"{H2TLS_T}::test_silent_tls_client_is_closed_after_the_header_timeout[h2]",
            )
        },
    ),
    Mutation(
        "idle timers",
        "TCP connection that never speaks never closed (ProtocolSwitch)",
        edit(
            HTTP2,
            "self._timer = loop.call_later(self._header_timeout, self._transport.abort)",
            "self._timer = None",
        ),
        {
            "http1": (f"{H1_T}::test_silent_client_is_closed_after_the_header_timeout",),
            "h2": (f"{H2L_T}::test_silent_connection_is_closed_after_the_header_timeout",),
        },
    ),
    Mutation(
        "idle timers",
        "QUIC idle timeout ignored",
        edit(
            HTTP3,
            "            idle_timeout=options.idle_timeout,",
            "            idle_timeout=3600.0,",
        ),
        {"h3": (f"{H3ISO_T}::test_idle_connection_is_closed",)},
    ),
    # --- floods and concurrency ---
    Mutation(
        "rapid reset",
        "StreamTable.peer_reset never trips",
        edit(
            STREAMS,
            "        return live and self._resets.hit(self._loop.time())",
            "        return False",
        ),
        {
            "h2": (f"{FLOODS_T}::test_h2_rapid_reset_gets_enhance_your_calm",),
            "h3": (f"{FLOODS_T}::test_h3_rapid_reset_closes_the_connection",),
        },
    ),
    Mutation(
        "rapid reset",
        "ignored on HTTP/2",
        edit(
            HTTP2,
            "        if self._table.peer_reset(sid):\n            self._enhance_your_calm",
            "        if False:\n            self._enhance_your_calm",
        ),
        {"h2": (f"{FLOODS_T}::test_h2_rapid_reset_gets_enhance_your_calm",)},
    ),
    Mutation(
        "rapid reset",
        "ignored on HTTP/3",
        edit(
            HTTP3,
            "        if self._table.peer_reset(sid):\n            # Rapid reset",
            "        if self._table.peer_reset(sid) and False:\n            # Rapid reset",
        ),
        {"h3": (f"{FLOODS_T}::test_h3_rapid_reset_closes_the_connection",)},
    ),
    Mutation(
        "flood guard",
        "RateGuard never trips",
        edit(FLOOD, "        return self._count > self.limit", "        return False"),
        {
            "core": (f"{FLOODS_T}::test_rate_guard_trips_past_the_limit_and_resets_per_window",),
            "h2": (f"{FLOODS_T}::test_h2_ping_flood_gets_enhance_your_calm",),
            "h3": (f"{FLOODS_T}::test_h3_rapid_reset_closes_the_connection",),
        },
    ),
    Mutation(
        "flood guard",
        "HTTP/2 PING flood not counted",
        edit(
            HTTP2,
            "        elif isinstance(event, PingReceived):\n"
            "            if self._control.hit(self.loop.time()):",
            "        elif isinstance(event, PingReceived):\n            if False:",
        ),
        {"h2": (f"{FLOODS_T}::test_h2_ping_flood_gets_enhance_your_calm",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 SETTINGS flood not counted",
        edit(
            HTTP2,
            "            if self._control.hit(self.loop.time()):\n"
            '                self._enhance_your_calm("settings_flood")',
            '            if False:\n                self._enhance_your_calm("settings_flood")',
        ),
        {"h2": (f"{FLOODS_T}::test_h2_settings_flood_gets_enhance_your_calm",)},
    ),
    Mutation(
        "concurrency cap",
        "HTTP/2 streams above the cap not refused",
        edit(
            HTTP2,
            "        if len(self._streams) >= self._limits.max_streams:\n"
            "            # Over the advertised limit",
            "        if False:\n            # Over the advertised limit",
        ),
        {"h2": (f"{H2L_T}::test_streams_past_the_concurrency_limit_are_refused",)},
    ),
    Mutation(
        "concurrency cap",
        "QUIC stream credit not limited (limit_peer_bidi_streams)",
        edit(HTTP3, "        limit_peer_bidi_streams(quic, self._limits.max_quic_streams)\n", ""),
        {"h3": (f"{H3ISO_T}::test_concurrent_streams_are_capped_by_quic_max_streams",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 refused-stream flood not counted",
        never(HTTP2, "self._refused.hit(self.loop.time())"),
        {"h2": (f"{FLOODS_T}::test_h2_refused_stream_flood_gets_enhance_your_calm",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 empty DATA flood not counted",
        never(
            HTTP2,
            "not event.data and event.stream_ended is None and self._empty.hit(self.loop.time())",
        ),
        {"h2": (f"{FLOODS_T}::test_h2_cheap_frame_floods_get_enhance_your_calm[empty_data]",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 PRIORITY and unknown-frame flood not counted",
        edit(
            HTTP2,
            "        elif isinstance(event, PriorityUpdated | UnknownFrameReceived):\n"
            "            if self._control.hit(self.loop.time()):",
            "        elif isinstance(event, PriorityUpdated | UnknownFrameReceived):\n"
            "            if False:",
        ),
        {"h2": (f"{FLOODS_T}::test_h2_cheap_frame_floods_get_enhance_your_calm[priority]",)},
    ),
    Mutation(
        "flood guard",
        "HTTP/2 WINDOW_UPDATE flood not counted",
        never(
            HTTP2, "self._window_updates > 2 * self._data_frames_sent + _WINDOW_UPDATE_ALLOWANCE"
        ),
        {"h2": (f"{FLOODS_T}::test_h2_cheap_frame_floods_get_enhance_your_calm[window_update]",)},
    ),
    # --- body budgets ---
    Mutation(
        "body budget",
        "a connection may hold any number of bodies at once",
        never(STREAMS, "self._held + size > self._limits.max_connection_body_bytes"),
        {"h2": (f"{SAME}::test_one_connection_cannot_hold_more_than_its_body_budget",)},
    ),
    Mutation(
        "body budget",
        "the process budget never refuses",
        never(STREAMS, "not self._budget.take(size)"),
        per_transport(f"{SAME}::test_the_process_body_budget_bounds_every_transport"),
    ),
    Mutation(
        "content encoding",
        "a content-encoded body is admitted (the engine would read other bytes)",
        never(ADMISSION, "coding is not None"),
        per_transport(f"{SAME}::test_a_content_encoded_body_is_415"),
    ),
    # --- lifecycle ---
    Mutation(
        "drain",
        "tunnel requests admitted while draining",
        edit(
            ADMISSION,
            "        if lifecycle.phase is not _READY:\n            raise _refusal(",
            "        if False:\n            raise _refusal(",
        ),
        {"http1": (f"{SEAMS_T}::test_a_request_arriving_during_the_drain_gets_a_retryable_503",)},
    ),
    Mutation(
        "model gate",
        "a request for a model pylon does not publish reaches the engine",
        never(ADMISSION, "request.model not in lifecycle.models.published"),
        per_transport(
            f"{BRINGUP_T}::test_an_unpublished_model_is_503_and_never_reaches_the_engine"
        ),
    ),
    Mutation(
        "health gate",
        "tunnel requests admitted before the engine passed its health gate",
        never("pylon/bringup.py", "options.health_gate"),
        {
            "core": (
                f"{BRINGUP_T}::test_requests_during_the_gate_get_503_not_ready_on_every_transport",
            )
        },
    ),
    Mutation(
        "drain",
        "/health admitted while draining",
        never(ADMISSION, "self._lifecycle.draining"),
        {"http1": (f"{LIFE_T}::test_health_arriving_during_the_drain_is_503",)},
    ),
    Mutation(
        "drain",
        "HTTP/2 GOAWAY not sent",
        edit(
            HTTP2,
            "        if self._closed or self._goaway_sent is not None:\n            return\n"
            "        last = ",
            "        if True:\n            return\n        last = ",
        ),
        {
            "h2": (
                f"{SHUT_T}::test_http2_goaway_lets_open_streams_finish",
                f"{LIFE_T}::test_h2_drain_sends_goaway_and_refuses_new_streams",
            )
        },
    ),
    Mutation(
        "drain",
        "HTTP/2 streams above the GOAWAY id not refused",
        never(HTTP2, "self._goaway_sent is not None and sid > self._goaway_sent"),
        {"h2": (f"{LIFE_T}::test_h2_drain_sends_goaway_and_refuses_new_streams",)},
    ),
    Mutation(
        "drain",
        "HTTP/3 GOAWAY not sent",
        edit(
            HTTP3,
            "        if self._goaway_sent or self._http is None:\n            return",
            "        if True:\n            return",
        ),
        {"h3": (f"{H3ISO_T}::test_drain_sends_goaway_and_lets_in_flight_streams_finish",)},
    ),
    Mutation(
        "drain",
        "HTTP/3 streams after GOAWAY not refused",
        edit(
            HTTP3,
            "        if self._goaway_sent:\n            self._refuse_stream(sid)\n"
            "            return\n        self._highest_stream = max(self._highest_stream, sid)",
            "        if False:\n            self._refuse_stream(sid)\n"
            "            return\n        self._highest_stream = max(self._highest_stream, sid)",
        ),
        {"h3": (f"{H3ISO_T}::test_drain_sends_goaway_and_lets_in_flight_streams_finish",)},
    ),
    Mutation(
        "drain",
        "HTTP/1.1 request completed during the drain not answered connection: close",
        edit(
            HTTP1,
            "Http1Responder(self, keep_alive and self._lifecycle.phase is not DRAINING, is_head)",
            "Http1Responder(self, keep_alive, is_head)",
        ),
        {
            "http1": (
                f"{LIFE_T}::test_h1_request_completed_during_the_drain_is_answered_with_connection_close",
            )
        },
    ),
    Mutation(
        "drain",
        "HTTP/1.1 connection kept open after its in-flight response",
        edit(
            HTTP1,
            "        if self._lifecycle.phase is DRAINING:\n            # Shutting down",
            "        if False:\n            # Shutting down",
        ),
        {
            "http1": (
                f"{LIFE_T}::test_h1_drain_closes_after_the_response_in_flight_and_runs_no_more",
            )
        },
    ),
    Mutation(
        "drain",
        "HTTP/1.1 idle keep-alive not closed",
        never(HTTP1, "not self._table.busy and self._stream is None"),
        {"http1": (f"{LIFE_T}::test_h1_idle_keep_alive_is_closed_at_once_on_drain",)},
    ),
    Mutation(
        "drain",
        "TCP connection that has not spoken yet kept open (ProtocolSwitch)",
        edit(
            HTTP2,
            "        if self._transport is not None and self._transport.get_protocol() is self:\n"
            "            self._transport.close()",
            "        if False:\n            self._transport.close()",
        ),
        {
            "http1": (f"{LIFE_T}::test_tcp_connection_that_has_not_spoken_is_closed_on_drain",),
            "h2": (f"{LIFE_T}::test_tcp_connection_that_has_not_spoken_is_closed_on_drain",),
        },
    ),
    # --- HTTP/1.1 reading after a refusal ---
    Mutation(
        "HTTP/1.1 stop reading after a refusal",
        "pipelined bytes read after an admission refusal (on_headers_complete)",
        edit(
            HTTP1,
            "        self._table.head(stream, head, ended=False)\n"
            "        if stream.intake.state is REJECTED:\n"
            "            self._stop_reading()\n            raise _StopParsing\n",
            "        self._table.head(stream, head, ended=False)\n",
        ),
        {"http1": (f"{H1_T}::test_nothing_behind_a_refused_request_is_read[*]",)},
    ),
    Mutation(
        "HTTP/1.1 stop reading after a refusal",
        "pipelined bytes read after a body refusal (on_body)",
        edit(
            HTTP1,
            "        self._table.data(stream.id, body, ended=self._ended)\n"
            "        if stream.intake.state is REJECTED:\n"
            "            self._stop_reading()\n            raise _StopParsing\n",
            "        self._table.data(stream.id, body, ended=self._ended)\n",
        ),
        {
            "http1": (
                f"{H1_T}::test_nothing_behind_a_refused_request_is_read[streamed_body_over_limit]",
            )
        },
    ),
    Mutation(
        "HTTP/1.1 protocol upgrade",
        "Upgrade not refused",
        edit(
            HTTP1,
            "        except httptools.HttpParserUpgrade:\n"
            '            self._refuse(ContractError("protocol upgrade is not supported"))',
            "        except httptools.HttpParserUpgrade:\n            pass",
        ),
        {"http1": (f"{H1_T}::test_upgrade_ends_the_connection",)},
    ),
    # --- the strip (spot checks; scripts/golden_mutations.py covers every entry) ---
    Mutation(
        "request strip",
        "x-dynamo-* header prefix",
        edit(
            SANITIZE,
            '    (b"x-dynamo-", "dynamo: pins, priority, session, metadata, routing mode"),\n',
            "",
        ),
        per_transport(f"{GOLDEN_T}::test_no_golden_control_reaches_the_engine"),
    ),
    Mutation(
        "request strip",
        "body cache_salt",
        edit(
            SANITIZE, '    "cache_salt": "vllm, sglang, dynamo (legacy): KV cache namespace",\n', ""
        ),
        per_transport(f"{GOLDEN_T}::test_no_golden_control_reaches_the_engine"),
    ),
    Mutation(
        "request strip",
        "client content-length forwarded beside pylon's",
        edit(SANITIZE, '    {b"host", b"content-length", b"expect",', '    {b"host", b"expect",'),
        {
            "core": (f"{GOLDEN_H_T}::test_pylon_owned_header_dropped_without_report[*]",),
            **per_transport(
                f"{CONTRACT_EP_T}::test_engine_sees_only_pylons_host_and_content_length"
            ),
        },
    ),
    Mutation(
        "request strip",
        "client host forwarded beside pylon's",
        edit(
            SANITIZE,
            '    {b"host", b"content-length", b"expect",',
            '    {b"content-length", b"expect",',
        ),
        {
            "core": (f"{GOLDEN_H_T}::test_pylon_owned_header_dropped_without_report[*]",),
            **per_transport(
                f"{CONTRACT_EP_T}::test_engine_sees_only_pylons_host_and_content_length"
            ),
        },
    ),
    # --- the response side ---
    Mutation(
        "response headers",
        "engine headers relayed unsanitized",
        edit(
            FORWARDING,
            "headers = sanitize_response_headers("
            "exchange.headers, self._retry_header, exchange.names)",
            "headers = list(exchange.headers)",
        ),
        per_transport(
            f"{RESP_T}::test_engine_control_and_hop_by_hop_headers_never_reach_the_client"
        ),
    ),
    Mutation(
        "response headers",
        "engine x-stargate-* relayed",
        edit(SANITIZE, "            or name.startswith(DENIED_RESPONSE_HEADER_PREFIXES)\n", ""),
        {
            "core": (f"{GOLDEN_H_T}::test_golden_response_header_removed[*]",),
            **per_transport(
                f"{RESP_T}::test_engine_control_and_hop_by_hop_headers_never_reach_the_client"
            ),
        },
    ),
    Mutation(
        "response headers",
        "engine hop-by-hop headers relayed",
        edit(SANITIZE, "            name in HOP_BY_HOP\n            or ", "            "),
        {
            "core": (f"{GOLDEN_H_T}::test_golden_response_header_removed[*]",),
            **per_transport(
                f"{RESP_T}::test_engine_control_and_hop_by_hop_headers_never_reach_the_client"
            ),
        },
    ),
    Mutation(
        "response headers",
        "names listed in the engine's Connection relayed",
        edit(
            SANITIZE,
            "    if has_connection:\n"
            "        kept = _without_listed(kept, _connection_tokens(headers))\n"
            "    return kept\n",
            "    return kept\n",
        ),
        {
            "core": (f"{SAN_T}::test_response_headers",),
            **per_transport(
                f"{RESP_T}::test_engine_control_and_hop_by_hop_headers_never_reach_the_client"
            ),
        },
    ),
    Mutation(
        "response headers",
        "engine's x-should-retry and x-request-id relayed (pylon-owned)",
        edit(
            SANITIZE,
            'frozenset({b"x-request-id", b"x-should-retry"})',
            "frozenset()",
        ),
        per_transport(
            f"{RESP_T}::test_engine_control_and_hop_by_hop_headers_never_reach_the_client"
        ),
    ),
    # --- the engine side: what an engine can make pylon hold ---
    Mutation(
        "engine connection cap",
        "connections per engine not capped",
        never("pylon/upstream/pool.py", "pool.open >= self._max_connections"),
        {"core": (f"{POOL_T}::test_requests_above_the_cap_wait_for_a_free_connection",)},
    ),
    Mutation(
        "SSE event size cap",
        "an engine's SSE event may grow without bound",
        never("pylon/core/sse.py", "len(self._pending) > self.max_event_bytes"),
        {"core": (f"{ERRORS_T}::test_oversized_sse_event_ends_the_stream",)},
    ),
    # --- QPACK ---
    Mutation(
        "QPACK dynamic table refused",
        "decoder accepts a dynamic table",
        edit(
            H3LAYER,
            "self._decoder = pylsqpack.Decoder(0, 0)",
            "self._decoder = pylsqpack.Decoder(4096, 16)",
        ),
        {"h3": (f"{H3L_T}::test_connection_error_closes_with_the_right_code[*]",)},
    ),
    Mutation(
        "QPACK dynamic table refused",
        "a dynamic table capacity advertised",
        edit(
            H3LAYER,
            "(Setting.QPACK_MAX_TABLE_CAPACITY, 0),",
            "(Setting.QPACK_MAX_TABLE_CAPACITY, 4096),",
        ),
        {"h3": (f"{H3L_T}::test_layer_settings_are_static_qpack_and_field_section_size_only",)},
    ),
]


# --- running ---


def _pattern(spec: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part) for part in spec.split("*")) + r"\Z")


def collect(files: set[str]) -> list[str]:
    """Every test node id in `files` (that exist)."""
    present = sorted(f for f in files if Path(f).exists())
    if not present:
        return []
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *present,
        ],
        capture_output=True,
        text=True,
        env=_env(),
    )
    return [line for line in done.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def expand(spec: str, known: list[str]) -> list[str]:
    pattern = _pattern(spec)
    return [node for node in known if pattern.match(node)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path.cwd())}


def run_tests(nodes: list[str], extra: Sequence[str] = ()) -> tuple[int, list[str], str]:
    """(exit code, failed node ids, last line) of one pytest run."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *extra, *nodes]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)
    failed = []
    summary = done.stdout.partition("short test summary info")[2]
    for line in summary.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            failed.append(line.split(" ", 1)[1].split(" - ", 1)[0])
    lines = done.stdout.strip().splitlines()
    return done.returncode, failed, lines[-1] if lines else done.stderr.strip()[-200:]


def apply(mutation: Mutation) -> None:
    for change in mutation.edits:
        path = Path(change.path)
        text = path.read_text(encoding="utf-8")
        count = text.count(change.old)
        if count != 1:
            raise SystemExit(f"{mutation.label}: expected one match in {change.path}, got {count}")
        path.write_text(text.replace(change.old, change.new), encoding="utf-8")


def mutant_problem(mutation: Mutation) -> str | None:
    """Build the mutant in memory (no file is written): why it is unusable, or None."""
    mutated: dict[str, str] = {}
    for change in mutation.edits:
        text = mutated.get(change.path)
        if text is None:
            text = Path(change.path).read_text(encoding="utf-8")
        count = text.count(change.old)
        if count != 1:
            raise SystemExit(f"{mutation.label}: expected one match in {change.path}, got {count}")
        mutated[change.path] = text.replace(change.old, change.new)
    for path, text in mutated.items():  # a mutant that does not even compile would prove nothing
        try:
            compile(text, path, "exec")
        except SyntaxError as exc:
            return f"{mutation.label}: the mutant does not compile: {exc}"
    return None


def restore() -> None:
    subprocess.run(["git", "checkout", "--", "pylon"], check=True)


@dataclass
class Result:
    mutation: Mutation
    caught: dict[str, list[str]]  # transport -> failing tests named for it
    missed: list[str]  # transports none of whose tests failed
    note: str
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.missed


def _short(node: str) -> str:
    path, _, name = node.partition("::")
    return f"{Path(path).stem}::{name}"


def audit(mutation: Mutation, known: list[str]) -> Result:
    per: dict[str, list[str]] = {
        t: [n for spec in specs for n in expand(spec, known)] for t, specs in mutation.tests.items()
    }
    nodes = sorted({n for found in per.values() for n in found})
    started = time.monotonic()
    apply(mutation)
    try:
        code, failed, last = run_tests(nodes) if nodes else (5, [], "no tests named")
    finally:
        restore()
    caught = {t: [n for n in found if n in failed] for t, found in per.items()}
    missed = [t for t, found in caught.items() if not found]
    note = "" if code in (0, 1) else f"pytest exit {code}: {last}"
    return Result(mutation, caught, missed, note, time.monotonic() - started)


def audit_full(mutation: Mutation) -> Result:
    hints = sorted({spec.split("::")[0] for specs in mutation.tests.values() for spec in specs})
    hints = [h for h in hints if Path(h).exists()]
    started = time.monotonic()
    apply(mutation)
    try:
        # The likely catchers first (pytest would fold them into the suite's own order).
        code, failed, last = run_tests(hints, extra=["-x"]) if hints else (5, [], "")
        if code != 1:
            code, failed, last = run_tests(SUITE, extra=["-x"])
    finally:
        restore()
    if code == 1 and failed:
        return Result(mutation, {"any": failed[:1]}, [], "", time.monotonic() - started)
    note = "" if code == 0 else f"pytest exit {code}: {last}"
    return Result(mutation, {}, ["any"], note, time.monotonic() - started)


def row(result: Result, markdown: bool) -> str:
    m = result.mutation
    verdict = "caught" if result.ok else f"SURVIVED ({', '.join(result.missed)})"
    by = "; ".join(f"{t}: {_short(tests[0])}" for t, tests in result.caught.items() if tests)
    if markdown:
        transports = ", ".join(m.tests) or "-"
        return f"| {m.control} | {m.label} | {transports} | {verdict} | {by or result.note} |"
    return f"{m.control + ': ' + m.label:<88} {verdict:<20} {by or result.note}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    mutations = [
        m
        for m in MUTATIONS
        if not args.only or any(text in f"{m.control}: {m.label}" for text in args.only)
    ]
    if not args.check:
        restore()  # --check writes nothing: it may run in a checkout with work in progress
    files = {spec.split("::")[0] for m in mutations for specs in m.tests.values() for spec in specs}
    known = collect(files)
    problems = []
    for m in mutations:
        problem = mutant_problem(m)  # exits if an edit no longer matches exactly once
        if problem is not None:
            problems.append(problem)
        for t, specs in m.tests.items():
            for spec in specs:
                if not expand(spec, known) and not args.full:
                    problems.append(f"{m.label} [{t}]: no test matches {spec}")
    if problems:
        print("\n".join(problems))
        if not args.full:
            sys.exit(2)
    if args.check:
        print(f"{len(mutations)} mutations apply; every named test exists")
        return
    if not args.full:
        nodes = sorted(
            {n for m in mutations for s in m.tests.values() for p in s for n in expand(p, known)}
        )
        code, failed, last = run_tests(nodes)
        assert code == 0, f"the named tests fail before any mutation: {failed or last}"
    results = []
    for m in mutations:
        result = audit_full(m) if args.full else audit(m, known)
        results.append(result)
        print(row(result, False), f"({result.seconds:.0f} s)", flush=True)
    survivors = [r for r in results if not r.ok]
    print(f"\n{len(results)} mutations, {len(survivors)} survived")
    for r in survivors:
        print(f"  SURVIVED: {r.mutation.control}: {r.mutation.label} ({', '.join(r.missed)})")
    if args.markdown:
        print("\n| Control | Mutation | Transports | Verdict | Caught by |\n|---|---|---|---|---|")
        for r in results:
            print(row(r, True))
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()

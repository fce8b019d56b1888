"""TLS and mutual TLS: the TCP listeners' contexts (OpenSSL checks the client) and the QUIC
listener's own client-certificate check (aioquic's TLS verifies no client chain)."""

from __future__ import annotations

from mutations.anchors import Always, ReplaceExpr, ReplaceStatements
from mutations.spec import H2TLS_T, H3TLS_T, HTTP3, QCA_T, TLS, Mutation

_TCP_MTLS = f"{H2TLS_T}::test_mtls_requires_a_client_certificate_from_the_ca"
_QUIC_MTLS = f"{H3TLS_T}::test_quic_mutual_tls"

MUTATIONS = [
    Mutation(
        "mTLS (TCP)",
        "client certificate optional (CERT_OPTIONAL)",
        ReplaceExpr(TLS, "build_server_ssl_context", "ssl.CERT_REQUIRED", "ssl.CERT_OPTIONAL"),
        {"http1": (_TCP_MTLS,), "h2": (_TCP_MTLS,)},
    ),
    Mutation(
        "mTLS (TCP)",
        "client CA not given to the TCP context",
        ReplaceExpr(
            TLS,
            "TlsIdentity.current_ssl_context",
            "self.client_ca",
            "None",
            inside="build_server_ssl_context",
        ),
        {"http1": (_TCP_MTLS,), "h2": (_TCP_MTLS,)},
    ),
    Mutation(
        "TLS (TCP)",
        "minimum version lowered to TLS 1.0",
        ReplaceExpr(
            TLS, "build_server_ssl_context", "ssl.TLSVersion.TLSv1_2", "ssl.TLSVersion.TLSv1"
        ),
        {
            "http1": (f"{H3TLS_T}::test_ssl_context_for_tcp_listeners",),
            "h2": (f"{H3TLS_T}::test_ssl_context_for_tcp_listeners",),
        },
    ),
    Mutation(
        "mTLS (QUIC)",
        "client chain not verified",
        ReplaceStatements(
            TLS, "TlsIdentity.verify_client", "self._client_verifier.verify(certificate, chain)", ""
        ),
        {"h3": (_QUIC_MTLS,)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "connection without a certificate accepted (verify_client)",
        ReplaceStatements(
            TLS, "TlsIdentity.verify_client", 'return "no client certificate"', "return None"
        ),
        {"h3": (_QUIC_MTLS,)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "Http3Protocol._check_client_certificate skipped",
        Always(
            HTTP3,
            "Http3Protocol._check_client_certificate",
            "identity is None or identity.client_ca is None",
        ),
        {"h3": (_QUIC_MTLS,)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "CertificateRequest not sent (request_client_certificate)",
        ReplaceStatements(HTTP3, "Http3Protocol.__init__", "request_client_certificate(quic)", ""),
        {"h3": (_QUIC_MTLS,)},
    ),
    Mutation(
        "mTLS (QUIC)",
        "refused connection still reads what came with the handshake (_refused)",
        ReplaceStatements(
            HTTP3, "Http3Protocol._check_client_certificate", "self._refused = True", ""
        ),
        {
            "h3": (
                f"{QCA_T}::test_a_request_riding_with_a_refused_handshake_never_reaches_the_engine",
            )
        },
    ),
    Mutation(
        "mTLS (QUIC)",
        "refused connection never forgotten (its ConnectionTerminated swallowed)",
        ReplaceExpr(
            HTTP3,
            "Http3Protocol.quic_event_received",
            "self._refused and not isinstance(event, ConnectionTerminated)",
            "self._refused",
        ),
        {"h3": (f"{QCA_T}::test_a_refused_connection_is_forgotten_once_it_ends",)},
    ),
]

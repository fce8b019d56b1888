"""Pylon's TLS server identity: one validated cert+key pair, hot-reloaded, for every TLS listener.

The pair comes from `--tls-cert`/`--tls-key` (PEM), or, when neither is given, from a self-signed
ECDSA P-256 certificate for `localhost` generated at start. A reload poller watches the two files;
a valid new pair is used for new handshakes only (established connections keep the pair they
negotiated), invalid material is refused and the old pair kept.

Listeners never read the files themselves: TCP listeners take `identity.current_ssl_context()`
per accepted connection, QUIC listeners `identity.install_quic(configuration)` per new connection.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import (
    ClientVerifier,
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from pylon.logs import get_logger

SELF_SIGNED_DNS = ("localhost",)
SELF_SIGNED_IPS = ("127.0.0.1",)
SELF_SIGNED_DAYS = 365
_PUBLIC = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


class TlsMaterialError(ValueError):
    """The cert/key material cannot be used; the message says why (never the key itself)."""


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """One validated server identity. PEM bytes are kept so contexts can be rebuilt from them."""

    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    private_key: Any  # a cryptography private key matching `certificate`
    cert_pem: bytes
    key_pem: bytes
    source: str  # "file" or "self-signed"

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the leaf certificate (DER), hex: what operators compare."""
        return self.certificate.fingerprint(hashes.SHA256()).hex()

    @property
    def not_after(self) -> datetime.datetime:
        return self.certificate.not_valid_after_utc


def parse_material(cert_pem: bytes, key_pem: bytes, source: str = "file") -> TlsMaterial:
    """Validate a PEM pair: parseable, key matches the leaf, leaf valid now."""
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise TlsMaterialError("certificate is not valid PEM (no certificate in it)") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise TlsMaterialError("private key is encrypted (pylon needs it unencrypted)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise TlsMaterialError("private key is not an unencrypted PEM key") from None
    leaf = certs[0]
    if key.public_key().public_bytes(*_PUBLIC) != leaf.public_key().public_bytes(*_PUBLIC):
        raise TlsMaterialError("private key does not match the certificate")
    now = datetime.datetime.now(datetime.UTC)
    if now < leaf.not_valid_before_utc:
        raise TlsMaterialError("certificate is not valid yet")
    if now > leaf.not_valid_after_utc:
        raise TlsMaterialError("certificate has expired")
    return TlsMaterial(leaf, tuple(certs[1:]), key, cert_pem, key_pem, source)


def load_material(cert_path: Path, key_path: Path) -> TlsMaterial:
    try:
        cert_pem = cert_path.read_bytes()
        key_pem = key_path.read_bytes()
    except OSError as exc:
        raise TlsMaterialError(f"cannot read: {exc}") from None
    return parse_material(cert_pem, key_pem)


def self_signed_material(
    dns_names: Sequence[str] = SELF_SIGNED_DNS, ips: Sequence[str] = SELF_SIGNED_IPS
) -> TlsMaterial:
    """A fresh ECDSA P-256 certificate for loopback use (SAN DNS:localhost, IP:127.0.0.1)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])])
    now = datetime.datetime.now(datetime.UTC)
    san: list[x509.GeneralName] = [x509.DNSName(dns) for dns in dns_names]
    san += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return parse_material(cert_pem, key_pem, source="self-signed")


def write_certificate(material: TlsMaterial, path: Path) -> None:
    """Write the certificate (PEM, never the key) to `path`, atomically (a reader never sees
    half a file), readable by all: it is public, and clients load it to trust pylon."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(material.cert_pem)
        tmp.chmod(0o644)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise TlsMaterialError(f"cannot write it: {exc.strerror or exc}") from None


def file_state(path: Path) -> tuple[int, int, int] | None:
    """What tells a file's new version from the one read: (mtime, size, inode); None when it
    cannot be read. Every watched file of pylon (TLS pair, tokens, the gateway CA) uses it."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def build_server_ssl_context(
    material: TlsMaterial,
    alpn: Sequence[str] = ("h2", "http/1.1"),
    client_ca: Path | None = None,
) -> ssl.SSLContext:
    """A TLS >= 1.2 server context for TCP listeners; with `client_ca`, client certs required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(list(alpn))
    # ssl only loads cert chains from files: write the validated bytes to a private temporary
    # directory, so what is loaded is exactly what was validated even if the source files change.
    with tempfile.TemporaryDirectory(prefix="pylon-tls-") as folder:
        cert_file = Path(folder) / "cert.pem"
        key_file = Path(folder) / "key.pem"
        cert_file.write_bytes(material.cert_pem)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(material.key_pem)
        context.load_cert_chain(cert_file, key_file)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=str(client_ca))
    return context


Report = Callable[..., None]


def _log_report(event: str, /, **fields: Any) -> None:
    """Without an observer: a log line, at warning for a refused reload."""
    log = get_logger()
    if event == "tls_reload_rejected":
        log.warning(event, **fields)
    else:
        log.info(event, **fields)


class TlsIdentity:
    """The current server identity, reloadable. One per process, shared by all TLS listeners."""

    def __init__(
        self,
        material: TlsMaterial,
        cert_path: Path | None = None,
        key_path: Path | None = None,
        client_ca: Path | None = None,
        report: Report | None = None,
    ) -> None:
        self._material = material
        self.cert_path = cert_path
        self.key_path = key_path
        self.client_ca = client_ca
        self._client_verifier = _client_verifier(client_ca) if client_ca is not None else None
        self._contexts: dict[tuple[str, ...], ssl.SSLContext] = {}
        self._listeners: list[Callable[[TlsMaterial], None]] = []
        self._seen = self._stat()
        self._report = report or _log_report

    @classmethod
    def from_paths(
        cls,
        cert_path: Path | None,
        key_path: Path | None,
        client_ca: Path | None = None,
        report: Report | None = None,
    ) -> TlsIdentity:
        """Load the configured pair, or generate a self-signed one when neither path is set.

        `report(event, **fields)`: where the identity tells what happened to it
        (`tls_identity_loaded`, `tls_reloaded`, `tls_reload_rejected`); pylon passes its
        observer's `process_event`, so the log line and the metrics both see each. By default,
        a log line."""
        if (cert_path is None) != (key_path is None):
            raise TlsMaterialError("--tls-cert and --tls-key must be given together")
        if cert_path is not None and key_path is not None:
            material = load_material(cert_path, key_path)
        else:
            material = self_signed_material()
        identity = cls(material, cert_path, key_path, client_ca, report)
        identity._report_loaded()
        return identity

    @classmethod
    def shared(
        cls,
        cert_path: Path,
        key_path: Path,
        client_ca: Path | None = None,
        report: Report | None = None,
    ) -> TlsIdentity:
        """The self-signed pair a supervisor generated once for all its processes
        (`pylon.supervisor`), so each presents the same certificate. Not watched: the pair
        lives as long as the supervisor."""
        material = load_material(cert_path, key_path)
        material = parse_material(material.cert_pem, material.key_pem, source="self-signed")
        identity = cls(material, None, None, client_ca, report)
        identity._report_loaded()
        return identity

    def _report_loaded(self) -> None:
        material = self.current
        client_ca = self.client_ca
        self._report(
            "tls_identity_loaded",
            source=material.source,
            fingerprint_sha256=material.fingerprint,
            not_after=material.not_after.isoformat(),
            client_ca=str(client_ca) if client_ca else None,
        )

    @property
    def current(self) -> TlsMaterial:
        return self._material

    def on_change(self, callback: Callable[[TlsMaterial], None]) -> None:
        """Call `callback(new_material)` after each successful reload."""
        self._listeners.append(callback)

    # --- TCP (ssl) ---
    def current_ssl_context(self, alpn: Sequence[str] = ("h2", "http/1.1")) -> ssl.SSLContext:
        """The context for the next accepted TCP connection; rebuilt once per reload."""
        key = tuple(alpn)
        context = self._contexts.get(key)
        if context is None:
            context = build_server_ssl_context(self._material, alpn, self.client_ca)
            self._contexts[key] = context
        return context

    # --- QUIC (aioquic) ---
    def quic_configuration(self, **options: Any) -> QuicConfiguration:
        """A server `QuicConfiguration` (ALPN h3 unless given) carrying the current pair."""
        options.setdefault("alpn_protocols", ["h3"])
        configuration = QuicConfiguration(is_client=False, **options)
        self.install_quic(configuration)
        return configuration

    def install_quic(self, configuration: QuicConfiguration) -> None:
        """Put the current pair on `configuration`; aioquic copies it at each new handshake."""
        material = self._material
        configuration.certificate = material.certificate
        configuration.certificate_chain = list(material.chain)
        configuration.private_key = material.private_key

    def verify_client(
        self, certificate: x509.Certificate | None, chain: list[x509.Certificate]
    ) -> str | None:
        """Check a QUIC client's certificate against --tls-client-ca; None = accepted.

        The TCP listeners leave this to OpenSSL (`ssl.CERT_REQUIRED`); aioquic's TLS does not
        verify client chains, so QUIC connections are checked here, after the handshake.
        """
        if self._client_verifier is None:
            return None
        if certificate is None:
            return "no client certificate"
        try:
            self._client_verifier.verify(certificate, chain)
        except VerificationError as exc:
            return f"client certificate rejected: {exc}"
        return None

    # --- hot reload ---
    def _stat(self) -> tuple[object, object] | None:
        if self.cert_path is None or self.key_path is None:
            return None
        return (file_state(self.cert_path), file_state(self.key_path))

    def check_reload(self) -> bool | None:
        """Reload if either file changed: True = new pair in use, False = refused, None = no
        change."""
        state = self._stat()
        if state is None or state == self._seen:
            return None
        return self.reload() is None

    def reload(self) -> str | None:
        """Re-read the files now, changed or not (SIGHUP): None = the pair read is in use for
        new handshakes (nothing to read when self-signed), else why it was refused (the old
        pair kept, `tls_reload_rejected`)."""
        if self.cert_path is None or self.key_path is None:
            return None
        self._seen = self._stat()
        try:
            material = load_material(self.cert_path, self.key_path)
        except TlsMaterialError as exc:
            self._report("tls_reload_rejected", reason=str(exc), kept=self._material.fingerprint)
            return str(exc)
        previous = self._material
        self._material = material
        self._contexts.clear()
        self._report(
            "tls_reloaded",
            fingerprint_sha256=material.fingerprint,
            previous_sha256=previous.fingerprint,
            not_after=material.not_after.isoformat(),
        )
        for callback in self._listeners:
            callback(material)
        return None

    async def watch(self, interval: float) -> None:
        """Poll the files every `interval` seconds until cancelled."""
        if self.cert_path is None:
            return  # self-signed: nothing to watch
        while True:
            await asyncio.sleep(interval)
            self.check_reload()


def check_client_ca(data: bytes, path: Path) -> None:
    """Refuse a client CA bundle that cannot work: no PEM certificate, no CA among them (no
    client could ever be accepted), or refused by OpenSSL (TCP) or by the QUIC verifier."""
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsMaterialError("no PEM certificate in it") from None
    if not any(is_ca(certificate) for certificate in certificates):
        raise TlsMaterialError(
            "no CA certificate in it (basic constraints CA:TRUE), so no client certificate "
            "could ever be accepted"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=str(path))
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc.strerror or "refused"
        raise TlsMaterialError(f"OpenSSL refused it ({reason})") from None
    _client_verifier(path)


def is_ca(certificate: x509.Certificate) -> bool:
    """Basic constraints CA:TRUE."""
    try:
        return bool(certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def _client_verifier(path: Path) -> ClientVerifier:
    """`cryptography`'s public chain verifier for client certificates issued by `path`'s CAs.

    CA certificates must be CAs (webpki rules: basic constraints, key usage); leaf extensions are
    not held to the web PKI's (internal client certificates rarely carry an authority key id),
    except that an extended key usage, when present, must allow client authentication, as
    OpenSSL requires of TCP clients.
    """
    try:
        data = path.read_bytes()
        roots = x509.load_pem_x509_certificates(data)
    except (OSError, ValueError) as exc:
        raise TlsMaterialError(f"--tls-client-ca: {exc}") from None
    leaf_policy = ExtensionPolicy.permit_all().may_be_present(
        x509.ExtendedKeyUsage, Criticality.AGNOSTIC, _allows_client_auth
    )
    return (
        PolicyBuilder()
        .store(Store(roots))
        .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=leaf_policy)
        .build_client_verifier()
    )


def _allows_client_auth(
    _policy: object, _certificate: x509.Certificate, usage: x509.ExtendedKeyUsage | None
) -> None:
    if usage is None:
        return
    if (
        ExtendedKeyUsageOID.CLIENT_AUTH in usage
        or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in usage
    ):
        return
    raise ValueError("the extended key usage does not allow client authentication")

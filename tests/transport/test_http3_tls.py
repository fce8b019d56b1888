"""pylon/tls.py: validation, self-signed identity, hot reload (seen over real QUIC handshakes),
mutual TLS on QUIC and on a TCP ssl context."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pylon.settings import SettingsError, load_settings
from pylon.tls import (
    TlsIdentity,
    TlsMaterial,
    TlsMaterialError,
    build_server_ssl_context,
    parse_material,
    self_signed_material,
)
from tests.certs import fingerprint, make_ca, make_leaf, write_pair
from tests.h3client import CHAT, chat, client_configuration
from tests.stack import StackFactory


def test_self_signed_identity_is_p256_for_localhost() -> None:
    material = self_signed_material()
    san = material.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in san.value.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert material.private_key.curve.name == "secp256r1"
    assert len(material.fingerprint) == 64 and material.source == "self-signed"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (make_leaf(None)[0], make_leaf(None)[1]), "does not match"),
        (lambda: make_leaf(None, days=-1, start_days=-10), "expired"),
        (lambda: make_leaf(None, days=10, start_days=1), "not valid yet"),
        (lambda: (b"not a cert", make_leaf(None)[1]), "not valid PEM"),
        (lambda: (make_leaf(None)[0], b"not a key"), "private key"),
    ],
)
def test_invalid_material_is_refused(make: object, reason: str) -> None:
    cert, key = make()  # type: ignore[operator]
    with pytest.raises(TlsMaterialError, match=reason):
        parse_material(cert, key)


def test_cert_and_key_flags_come_together(tmp_path: Path) -> None:
    cert, _ = write_pair(tmp_path, make_leaf(None))
    with pytest.raises(SettingsError, match="together"):
        load_settings({"tls_cert": str(cert)})
    with pytest.raises(TlsMaterialError, match="together"):
        TlsIdentity.from_paths(cert, None)


def test_ssl_context_for_tcp_listeners(tmp_path: Path) -> None:
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(Encoding.PEM))
    identity = TlsIdentity(self_signed_material(), client_ca=ca_file)
    context = identity.current_ssl_context(("h2", "http/1.1"))
    assert context.verify_mode == ssl.CERT_REQUIRED
    # pylon's own floor, whatever the system's OpenSSL policy would allow.
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert identity.current_ssl_context(("h2", "http/1.1")) is context  # cached per pair
    plain = build_server_ssl_context(self_signed_material(), ["h2"])
    assert plain.verify_mode == ssl.CERT_NONE


async def test_tcp_mutual_tls_handshake(tmp_path: Path) -> None:
    """The context the HTTP/2 listener uses: a client without a CA-signed cert is refused."""
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(Encoding.PEM))
    client_cert, client_key = write_pair(tmp_path, make_leaf(ca, name="gateway"), "client")
    identity = TlsIdentity(self_signed_material(), client_ca=ca_file)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"ok:" + (writer.get_extra_info("ssl_object").selected_alpn_protocol() or "").encode()
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(
        echo, "127.0.0.1", 0, ssl=identity.current_ssl_context(("h2",))
    )
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_alpn_protocols(["h2"])
    try:
        client.load_cert_chain(client_cert, client_key)
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        assert await asyncio.wait_for(reader.read(), 3) == b"ok:h2"
        writer.close()
        anonymous = ssl.create_default_context()
        anonymous.check_hostname = False
        anonymous.verify_mode = ssl.CERT_NONE
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=anonymous)
            refused = await asyncio.wait_for(reader.read(), 3)  # TLS 1.3: refusal comes after
        except (ssl.SSLError, ConnectionError):
            refused = b""
        assert refused == b"", "a client without a certificate got an answer"
    finally:
        server.close()


async def test_reload_serves_new_handshakes_and_keeps_old_connections(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    first = make_leaf(None)
    cert, key = write_pair(tmp_path, first)
    stack = await make_stack("dynamo", tls_cert=str(cert), tls_key=str(key))
    async with stack.connect() as old:
        assert old.peer_fingerprint == fingerprint(first[0])
        second = make_leaf(None)
        write_pair(tmp_path, second)
        assert stack.identity.check_reload() is True
        async with stack.connect() as new:
            assert new.peer_fingerprint == fingerprint(second[0])
            assert (await new.request(CHAT, chat())).status == 200
        # The connection made before the reload keeps working on its own keys.
        assert (await old.request(CHAT, chat())).status == 200
        assert old.peer_fingerprint == fingerprint(first[0])

        # Invalid material: refused, the second pair stays in use.
        (tmp_path / "server.crt").write_bytes(b"garbage")
        assert stack.identity.check_reload() is False
        write_pair(tmp_path, (make_leaf(None)[0], second[1]))  # key of another cert
        assert stack.identity.check_reload() is False
        assert stack.identity.check_reload() is None  # unchanged since the last check
        async with stack.connect() as third:
            assert third.peer_fingerprint == fingerprint(second[0])


async def test_reload_poller_picks_up_a_new_pair(tmp_path: Path) -> None:
    cert, key = write_pair(tmp_path, make_leaf(None))
    identity = TlsIdentity.from_paths(cert, key)
    fresh = make_leaf(None)
    seen: list[str] = []
    changed = asyncio.Event()

    def note(material: TlsMaterial) -> None:
        seen.append(material.fingerprint)
        changed.set()

    identity.on_change(note)
    watcher = asyncio.create_task(identity.watch(0.02))
    try:
        write_pair(tmp_path, fresh)
        async with asyncio.timeout(3):
            await changed.wait()
    finally:
        watcher.cancel()
    assert seen == [fingerprint(fresh[0])]
    assert identity.current.fingerprint == fingerprint(fresh[0])


async def test_quic_mutual_tls(make_stack: StackFactory, tmp_path: Path) -> None:
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(Encoding.PEM))
    # mTLS needs a server certificate (without one the TCP listener would accept anyone).
    server_cert, server_key = write_pair(tmp_path, make_leaf(None), "server")
    stack = await make_stack(
        "dynamo", tls_cert=str(server_cert), tls_key=str(server_key), tls_client_ca=str(ca_file)
    )
    good_cert, good_key = write_pair(tmp_path, make_leaf(ca, name="gateway"), "good")
    async with stack.connect(client_configuration(good_cert, good_key)) as client:
        assert (await client.request(CHAT, chat())).status == 200
    rogue_cert, rogue_key = write_pair(tmp_path, make_leaf(make_ca("rogue"), "gateway"), "rogue")
    for configuration in (client_configuration(), client_configuration(rogue_cert, rogue_key)):
        async with stack.connect(configuration) as client:
            reply = await client.request(CHAT, chat(), timeout=3)
            assert reply.status is None
            assert client.terminated is not None
            assert client.terminated.error_code == 0x100 + 116  # certificate_required
    assert len((await stack.control())["requests"]) == 1


def _signed_leaf(
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    usages: list[x509.ObjectIdentifier] | None,
) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway")]))
        .issuer_name(issuer[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    if usages is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer[1], hashes.SHA256())


def test_quic_client_verifier_rules(tmp_path: Path) -> None:
    """QUIC clients are checked with cryptography's public verifier, as OpenSSL checks TCP ones:
    chain to the CA, and an extended key usage (when present) that allows client auth."""
    ca = make_ca()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca[0].public_bytes(Encoding.PEM))
    identity = TlsIdentity(self_signed_material(), client_ca=ca_file)
    client_auth = ExtendedKeyUsageOID.CLIENT_AUTH
    assert identity.verify_client(_signed_leaf(ca, None), []) is None
    assert identity.verify_client(_signed_leaf(ca, [client_auth]), []) is None
    refusals = [
        identity.verify_client(None, []),
        identity.verify_client(_signed_leaf(ca, [ExtendedKeyUsageOID.SERVER_AUTH]), []),
        identity.verify_client(_signed_leaf(make_ca("rogue"), [client_auth]), []),
    ]
    assert all(refusal is not None for refusal in refusals), refusals

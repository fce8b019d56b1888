"""Two real aioquic `QuicConnection`s joined by an in-memory link, for sans-I/O tests.

No sockets and no event loop: datagrams are handed from one side to the other, and time is a
counter that only moves when `pump` runs out of datagrams and fires the next timer, so every run
is the same. Certificates are made once per process with `cryptography`.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

from aioquic.buffer import Buffer  # type: ignore[attr-defined]  # re-exported from _buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent
from aioquic.quic.packet import pull_quic_header
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from tests.certs import make_leaf

CLIENT_ADDR = ("10.0.0.1", 4433)
SERVER_ADDR = ("10.0.0.2", 443)
Setup = Callable[[QuicConnection], None]


@functools.cache
def certificate(name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed ECDSA P-256 certificate for `name` (cached: key generation is slow)."""
    cert_pem, key_pem = make_leaf(None, name, days=1)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return x509.load_pem_x509_certificate(cert_pem), key


def server_configuration(alpn: str = "h3") -> QuicConfiguration:
    cert, key = certificate("localhost")
    return QuicConfiguration(
        is_client=False, alpn_protocols=[alpn], certificate=cert, private_key=key
    )


def client_configuration(alpn: str = "h3", *, with_certificate: bool = False) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=[alpn], server_name="localhost", verify_mode=ssl.CERT_NONE
    )
    if with_certificate:
        configuration.certificate, configuration.private_key = certificate("client.test")
    return configuration


@dataclass
class Side:
    """One endpoint: its connection and the QUIC events it produced, not yet consumed."""

    quic: QuicConnection
    events: list[QuicEvent] = field(default_factory=list)

    def take_events(self) -> list[QuicEvent]:
        events, self.events = self.events, []
        return events

    @property
    def terminated(self) -> ConnectionTerminated | None:
        return next((e for e in self.events if isinstance(e, ConnectionTerminated)), None)


class QuicPair:
    """A client and a server `QuicConnection`, handshake done by `connect()`.

    `server_setup` / `client_setup` run on each connection before its first packet (where
    aioquic private tweaks must happen).
    """

    def __init__(
        self,
        *,
        client_certificate: bool = False,
        server_setup: Setup | None = None,
        client_setup: Setup | None = None,
    ) -> None:
        self.now = 1000.0
        self.client = Side(
            QuicConnection(configuration=client_configuration(with_certificate=client_certificate))
        )
        if client_setup is not None:
            client_setup(self.client.quic)
        self._server_setup = server_setup
        self._server: Side | None = None

    @property
    def server(self) -> Side:
        assert self._server is not None, "connect() first"
        return self._server

    def connect(self) -> QuicPair:
        self.client.quic.connect(SERVER_ADDR, now=self.now)
        self.pump()
        return self

    def pump(self, rounds: int = 200) -> None:
        """Exchange datagrams (firing due timers) until both sides are quiet."""
        for _ in range(rounds):
            if not self._exchange() and not self._fire_next_timer():
                return

    def _exchange(self) -> bool:
        moved = False
        for datagram, _ in self.client.quic.datagrams_to_send(now=self.now):
            self._server_side(datagram).quic.receive_datagram(datagram, CLIENT_ADDR, now=self.now)
            moved = True
        if self._server is not None:
            for datagram, _ in self._server.quic.datagrams_to_send(now=self.now):
                self.client.quic.receive_datagram(datagram, SERVER_ADDR, now=self.now)
                moved = True
        self._collect()
        return moved

    def _fire_next_timer(self, horizon: float = 0.1) -> bool:
        """Advance to the earliest timer due within `horizon` seconds (ACK delay, loss probes);
        idle timeouts lie beyond it."""
        sides = [self.client] + ([self._server] if self._server is not None else [])
        timers = [(side.quic.get_timer(), side) for side in sides]
        due = [(at, side) for at, side in timers if at is not None and at <= self.now + horizon]
        if not due:
            return False
        at, side = min(due, key=lambda pair: pair[0])
        self.now = max(self.now, at)
        side.quic.handle_timer(now=self.now)
        return True

    def _server_side(self, first_datagram: bytes) -> Side:
        if self._server is None:
            header = pull_quic_header(Buffer(data=first_datagram), host_cid_length=8)
            quic = QuicConnection(
                configuration=server_configuration(),
                original_destination_connection_id=header.destination_cid,
            )
            if self._server_setup is not None:
                self._server_setup(quic)
            self._server = Side(quic)
        return self._server

    def _collect(self) -> None:
        for side in (self.client, self._server):
            if side is None:
                continue
            while (event := side.quic.next_event()) is not None:
                side.events.append(event)

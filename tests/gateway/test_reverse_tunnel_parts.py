"""The reverse tunnel's pure parts: addresses and SNI, the gateway CA's reload, the handshake
stream."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import StreamDataReceived, StreamReset
from cryptography.hazmat.primitives import serialization
from hypothesis import given
from hypothesis import strategies as st

from pylon.gateway import wire
from pylon.gateway.tunnel import (
    DEFAULT_SNI,
    GatewayTrust,
    HandshakeStream,
    TunnelError,
    derive_sni,
    load_gateway_ca,
    split_host_port,
)
from tests.certs import make_ca, make_leaf
from tests.observers import EventObserver

LABEL = st.from_regex(r"[a-z][a-z0-9-]{0,14}[a-z0-9]", fullmatch=True)
HOSTNAME = st.lists(LABEL, min_size=1, max_size=4).map(".".join).filter(lambda h: h != "localhost")
PORT = st.integers(min_value=1, max_value=65535)


@given(HOSTNAME, PORT)
def test_a_host_and_port_split_back(host: str, port: int) -> None:
    assert split_host_port(f"{host}:{port}") == (host, port)
    assert split_host_port(f"quic://{host}:{port}/") == (host, port)
    assert derive_sni(f"{host}:{port}") == host


@given(st.ip_addresses(), PORT)
def test_an_ip_target_gets_the_default_sni(address: ipaddress.IPv4Address, port: int) -> None:
    text = f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"
    assert split_host_port(text) == (str(address), port)
    assert derive_sni(text) == DEFAULT_SNI


@given(st.text(max_size=40))
def test_any_text_splits_without_raising(text: str) -> None:
    _, port = split_host_port(text)
    assert port is None or 0 < port < 65536
    assert derive_sni(text)


@pytest.mark.parametrize(
    ("target", "sni"),
    [
        ("localhost:4433", DEFAULT_SNI),
        ("LOCALHOST", DEFAULT_SNI),
        ("::1", DEFAULT_SNI),
        ("[::1]:443", DEFAULT_SNI),
        ("gw-0.stargate.svc", "gw-0.stargate.svc"),
        ("", DEFAULT_SNI),
    ],
)
def test_sni_examples(target: str, sni: str) -> None:
    assert derive_sni(target) == sni


def test_a_port_out_of_range_is_no_port() -> None:
    assert split_host_port("gw:0") == ("gw", None)
    assert split_host_port("gw:65536") == ("gw", None)
    assert split_host_port("gw:\u0661\u0662") == ("gw", None)  # non-ASCII digits


def write_ca(path: Path, name: str) -> bytes:
    data = make_ca(name)[0].public_bytes(serialization.Encoding.PEM)
    path.write_bytes(data)
    return data


def test_the_gateway_ca_is_checked_and_reloaded_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "ca.pem"
    first = write_ca(path, "one")
    assert load_gateway_ca(path) == first
    events = EventObserver()
    trust = GatewayTrust(path, events)
    assert trust.current() == first
    path.write_bytes(b"not a certificate")  # a bad rewrite: refused, the old bundle kept
    assert trust.current() == first
    assert "no PEM certificate" in events.of("tunnel_ca_reload_rejected")[0]["reason"]
    second = write_ca(path, "two")
    assert trust.current() == second
    assert events.kinds() == ["tunnel_ca_reload_rejected", "tunnel_ca_reloaded"]
    assert GatewayTrust(None, events).current() is None  # insecure


def test_a_bundle_without_a_ca_is_refused(tmp_path: Path) -> None:
    leaf = tmp_path / "leaf.pem"
    leaf.write_bytes(make_leaf(None)[0])
    with pytest.raises(ValueError, match="no CA certificate"):
        load_gateway_ca(leaf)
    with pytest.raises(ValueError, match="missing"):
        load_gateway_ca(tmp_path / "missing")
    with pytest.raises(TunnelError):
        GatewayTrust(leaf, EventObserver()).current()


def handshake_stream() -> tuple[HandshakeStream, QuicConnection]:
    quic = QuicConnection(configuration=QuicConfiguration(is_client=True))
    stream = HandshakeStream(quic)
    stream.send(wire.Handshake("node-1", "t"))
    return stream, quic


@given(st.integers(min_value=1, max_value=40))
def test_the_ack_is_read_however_it_is_split(step: int) -> None:
    stream, _ = handshake_stream()
    assert stream.stream_id == 0
    data = wire.encode_handshake_ack(wire.HandshakeAck(False, wire.NACK_DUPLICATE))
    acks = []
    for start in range(0, len(data), step):
        chunk = data[start : start + step]
        event = StreamDataReceived(data=chunk, end_stream=start + step >= len(data), stream_id=0)
        assert stream.owns(event)
        acks.append(stream.feed(event))
    assert [a for a in acks if a is not None] == [wire.HandshakeAck(False, wire.NACK_DUPLICATE)]


def test_a_handshake_stream_without_an_ack_fails() -> None:
    stream, _ = handshake_stream()
    assert not stream.owns(StreamDataReceived(data=b"x", end_stream=False, stream_id=1))
    with pytest.raises(TunnelError, match="without an ack"):
        stream.feed(StreamDataReceived(data=b"", end_stream=True, stream_id=0))
    stream, _ = handshake_stream()
    with pytest.raises(TunnelError, match="reset"):
        stream.feed(StreamReset(error_code=1, stream_id=0))
    stream, _ = handshake_stream()
    with pytest.raises(TunnelError, match="bad handshake ack"):
        stream.feed(StreamDataReceived(data=b"\xff" * 16, end_stream=False, stream_id=0))


async def test_the_stream_layer_is_chosen_by_the_protocol(tmp_path: Path) -> None:
    """The raw-QUIC seam: a protocol without a `LinkFactory` is refused at construction, and
    one given in `links` is what dials use."""
    from pylon.gateway.board import GatewayBoard
    from pylon.gateway.tunnel import LINKS, ReverseTunnels, TunnelOptions

    options = TunnelOptions(inference_server_id="n", insecure=True, protocol="raw-quic")
    ingress: Any = SimpleNamespace(limits=SimpleNamespace(max_header_bytes=1000))
    with pytest.raises(ValueError, match="raw-quic"):
        ReverseTunnels(options, GatewayBoard(reverse=True), ingress, EventObserver())
    tunnels = ReverseTunnels(
        options,
        GatewayBoard(reverse=True),
        ingress,
        EventObserver(),
        links={"raw-quic": LINKS["http3"]},
    )
    assert tunnels.max_header_block == 2024
    assert tunnels._configuration("stargate").alpn_protocols is None  # raw QUIC: no ALPN

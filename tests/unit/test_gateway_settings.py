"""The Gateway topic: settings that could not take effect refuse the start, and the files the
gateway side reads are checked before any listener opens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization

from pylon.preflight import StartupError, check_files, config_warnings, registered_url
from pylon.settings import SettingsError, load_settings
from tests.certs import make_ca, make_leaf


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith(("PYLON_", "OTEL_")):
            monkeypatch.delenv(name)


def settings(**overrides: Any) -> Any:
    return load_settings(overrides)


GW = {"gateway": ("127.0.0.1:50071",), "inference_server_id": "node-1"}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"inference_server_id": "n"}, "--inference-server-id needs --gateway"),
        ({"cluster_id": "c"}, "--cluster-id needs --gateway"),
        ({"gateway_token_file": "/t"}, "--gateway-token-file needs --gateway"),
        ({"inference_server_url": "quic://a:1"}, "--inference-server-url needs --gateway"),
        ({"gateway_ca": "/ca"}, "--gateway-ca needs --gateway"),
        ({"connectivity": "reverse"}, "--connectivity reverse needs --gateway"),
        ({"gateway_insecure": True}, "--gateway-insecure needs --gateway"),
        ({"gateway": ("a:1",)}, "--gateway needs --inference-server-id"),
        ({**GW, "connectivity": "reverse"}, "needs --gateway-ca"),
        (
            {**GW, "connectivity": "reverse", "gateway_ca": "/ca", "gateway_insecure": True},
            "contradict",
        ),
        (
            {
                **GW,
                "connectivity": "reverse",
                "gateway_insecure": True,
                "inference_server_url": "x",
            },
            "--inference-server-url has no effect",
        ),
        ({**GW, "gateway_ca": "/ca"}, "--gateway-ca needs --connectivity reverse or --gateway-tls"),
        ({"gateway_tls": True}, "--gateway-tls needs --gateway"),
        ({**GW, "gateway_insecure": True}, "--gateway-insecure needs --connectivity reverse"),
        ({**GW, "tunnel_keepalive": 5, "tunnel_idle_timeout": 5}, "must exceed"),
        ({"gateway": ("nohost",), "inference_server_id": "n"}, "is not HOST:PORT"),
        ({"gateway": ("h:0",), "inference_server_id": "n"}, "is not HOST:PORT"),
        ({"gateway": ("h:1",), "inference_server_id": "has space"}, "visible ASCII"),
        ({"gateway": ("h:1",), "inference_server_id": ""}, "visible ASCII"),
        ({**GW, "tunnel_connections": 0}, "tunnel_connections"),
        ({**GW, "registration_interval": 0.01}, "registration_interval"),
        ({**GW, "processes": 2}, "--gateway needs --processes 1"),
    ],
)
def test_gateway_settings_that_cannot_take_effect_refuse_the_start(
    overrides: dict[str, Any], says: str
) -> None:
    with pytest.raises(SettingsError) as info:
        settings(**overrides)
    assert says in str(info.value)


def test_gateway_settings_that_work() -> None:
    direct = settings(**GW, quic_listen="127.0.0.1:0")
    assert direct.connectivity == "direct" and direct.tunnel_connections == 2
    assert direct.registration_interval == 1.0 and direct.canary_max_tokens == 237
    reverse = settings(**GW, connectivity="reverse", gateway_insecure=True)
    assert reverse.tunnel_protocol == "http3"
    assert settings(gateway="a:1,b:2, a:1", inference_server_id="n").gateway == ("a:1", "b:2")


def test_insecure_tunnels_are_warned_about() -> None:
    names = [
        w.event
        for w in config_warnings(settings(**GW, connectivity="reverse", gateway_insecure=True))
    ]
    assert "gateway_insecure" in names
    assert "gateway_insecure" not in [w.event for w in config_warnings(settings(**GW))]


def test_the_registered_url(tmp_path: Path) -> None:
    assert registered_url(settings(**GW, quic_listen="127.0.0.1:0"), "127.0.0.1:4433") == (
        "quic://127.0.0.1:4433"
    )
    given = settings(**GW, inference_server_url="quic://node-1.example:443")
    assert registered_url(given, "127.0.0.1:4433") == "quic://node-1.example:443"
    reverse = settings(**GW, connectivity="reverse", gateway_insecure=True)
    assert registered_url(reverse, None) == ""


def test_direct_mode_needs_an_address_the_gateway_can_dial() -> None:
    with pytest.raises(StartupError, match="needs --quic-listen"):
        check_files(settings(**GW))
    with pytest.raises(StartupError, match="wildcard"):
        check_files(settings(**GW, quic_listen="0.0.0.0:4433"))
    check_files(settings(**GW, quic_listen="0.0.0.0:4433", inference_server_url="quic://n:1"))
    check_files(settings(**GW, quic_listen="127.0.0.1:0"))


def test_gateway_files_are_checked_before_the_start(tmp_path: Path) -> None:
    reverse = {**GW, "connectivity": "reverse"}
    token = tmp_path / "token"
    with pytest.raises(StartupError, match="no such file"):
        check_files(settings(**reverse, gateway_insecure=True, gateway_token_file=str(token)))
    token.write_text("\n  \n")
    with pytest.raises(StartupError, match="empty"):
        check_files(settings(**reverse, gateway_insecure=True, gateway_token_file=str(token)))
    token.write_text("one\ntwo\n")
    with pytest.raises(StartupError, match="single line"):
        check_files(settings(**reverse, gateway_insecure=True, gateway_token_file=str(token)))
    token.write_text(" secret \n")
    check_files(settings(**reverse, gateway_insecure=True, gateway_token_file=str(token)))
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    with pytest.raises(StartupError, match="no PEM certificate"):
        check_files(settings(**reverse, gateway_ca=str(ca)))
    leaf, _ = make_leaf(make_ca("some CA"), "stargate")
    ca.write_bytes(leaf)  # a server certificate, no CA: no dial could ever verify against it
    with pytest.raises(StartupError, match="no CA certificate"):
        check_files(settings(**reverse, gateway_ca=str(ca)))
    cert, _ = make_ca()
    ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    check_files(settings(**reverse, gateway_ca=str(ca)))

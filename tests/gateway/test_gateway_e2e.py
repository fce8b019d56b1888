"""The gateway side of a whole pylon (`pylon.run.start` from Settings, as `pylon serve` runs it)
against the stand-in gateway: registration in direct and reverse mode, requests through the
reverse tunnel the registration's ack names, the canary's verdict in the snapshot, and the drain
order (INACTIVE advertised before anything closes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pylon.gateway import stargate_pb2 as pb
from tests.gateway.stand_in_grpc import StandInGrpc, gateway_info
from tests.gateway.stand_in_quic import StandInGateway
from tests.observers import EventObserver
from tests.stack import MODEL, StackFactory

NODE = "node-1"
ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
INACTIVE = pb.INFERENCE_SERVER_STATUS_INACTIVE
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def control_plane(**kwargs: Any) -> StandInGrpc:
    grpc = StandInGrpc(**kwargs)
    await grpc.start()
    grpc.set_watch(gateways=[gateway_info(grpc.address)])
    return grpc


def gateway_settings(grpc: StandInGrpc, **extra: Any) -> dict[str, Any]:
    return {
        "gateway": (grpc.address,),
        "inference_server_id": NODE,
        "registration_interval": 0.2,
        "canary_interval": 0.3,
        "canary_recovery_interval": 0.1,
        **extra,
    }


def statuses(grpc: StandInGrpc) -> dict[str, int]:
    received = grpc.registrations()
    if not received:
        return {}
    last = received[-1].message
    return {name: entry.status for name, entry in last.models.items()}


async def test_direct_mode_registers_the_quic_listener_and_its_models(
    make_stack: StackFactory,
) -> None:
    grpc = await control_plane()
    try:
        stack = await make_stack(**gateway_settings(grpc))
        await grpc.wait_for(lambda: len(grpc.registrations()) >= 2, what="two snapshots")
        first = grpc.registrations()[0]
        message = first.message
        assert message.inference_server_id == NODE and message.cluster_id == NODE
        assert message.inference_server_url == f"quic://{stack.running.quic_address}"
        assert not message.reverse_tunnel
        assert set(message.models) == {MODEL} and statuses(grpc) == {MODEL: ACTIVE}
        assert first.metadata["x-stargate-registration-heartbeat-ms"] == "200"
        assert "authorization" not in first.metadata
    finally:
        await grpc.stop()


async def test_a_failing_canary_advertises_the_model_inactive_and_back(
    make_stack: StackFactory,
) -> None:
    grpc = await control_plane()
    try:
        stack = await make_stack(**gateway_settings(grpc))
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: ACTIVE}, what="ACTIVE")
        await stack.faults([{"model": MODEL, "status": 500}])
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: INACTIVE}, what="INACTIVE")
        admin = await stack.client.get(f"{stack.running.admin_url}/ready")
        assert admin.status_code == 503 and "canary_failed" in admin.text
        await stack.faults([])
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: ACTIVE}, what="ACTIVE again")
    finally:
        await grpc.stop()


@pytest.mark.parametrize("protocol", ["http3"])
async def test_reverse_mode_serves_requests_on_the_tunnel_the_ack_names(
    make_stack: StackFactory, tmp_path: Path, protocol: str
) -> None:
    tunnel = StandInGateway(tmp_path, {NODE: "s3cret"})
    await tunnel.start()
    grpc = await control_plane(token="s3cret", ack_target=tunnel.address)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    events = EventObserver()
    try:
        stack = await make_stack(
            observer=events,
            **gateway_settings(
                grpc,
                connectivity="reverse",
                tunnel_protocol=protocol,
                gateway_ca=str(tunnel.ca_path),
                gateway_token_file=str(token),
                tunnel_connections=1,
            ),
        )
        await tunnel.wait_live(1)
        # The tunnel being up flips the advertised status to ACTIVE (INACTIVE before it).
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: ACTIVE}, what="ACTIVE")
        assert grpc.registrations()[0].message.reverse_tunnel
        assert grpc.registrations()[0].metadata["authorization"] == "Bearer s3cret"
        headers = [
            ("x-request-id", "rt-1"),
            ("x-model", MODEL),
            ("x-priority", "2"),
            ("x-dynamo-worker-instance-id", "client-pin"),
        ]
        response = await tunnel.request(
            "POST", "/v1/chat/completions", headers, json.dumps(CHAT).encode()
        )
        assert response.status == 200, response.body
        assert response.json()["object"] == "chat.completion"
        seen = (await stack.client.get(f"{stack.mock.base_url}/test-control")).json()
        last = [r for r in seen["requests"] if r["path"] == "/v1/chat/completions"][-1]
        names = {name.lower() for name, _ in last["headers"]}
        assert "x-dynamo-worker-instance-id" not in names  # the client's pin was stripped
        unknown = await tunnel.request(
            "POST",
            "/v1/chat/completions",
            [("x-request-id", "rt-2"), ("x-model", "nope")],
            json.dumps({**CHAT, "model": "nope"}).encode(),
        )
        assert unknown.status in (404, 503) and unknown.json()["request_id"] == "rt-2"
        scrape = (await stack.client.get(f"{stack.running.admin_url}/metrics")).text
        key = f'gateway="{grpc.address}"'
        assert f"pylon_gateway_registration_connected{{{key}}} 1.0" in scrape
        assert f"pylon_gateway_tunnel_connections{{{key}}} 1.0" in scrape
        assert f'pylon_gateway_model_status{{{key},model="{MODEL}"}} 1.0' in scrape
    finally:
        await grpc.stop()
        tunnel.close()


async def test_drain_advertises_inactive_before_the_tunnel_closes(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    tunnel = StandInGateway(tmp_path, {NODE: None})
    await tunnel.start()
    grpc = await control_plane(ack_target=tunnel.address)
    try:
        stack = await make_stack(
            **gateway_settings(
                grpc,
                connectivity="reverse",
                gateway_ca=str(tunnel.ca_path),
                tunnel_connections=1,
            )
        )
        await tunnel.wait_live(1)
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: ACTIVE}, what="ACTIVE")
        # No ack from here on: pylon then waits (bounded) for the INACTIVE snapshot's ack
        # before its tunnels stop, which leaves the window to see that they have not.
        grpc.ack = False
        shutdown = asyncio.create_task(stack.running.shutdown(grace=2.0))
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: INACTIVE}, what="INACTIVE on drain")
        assert len(tunnel.live) == 1 and tunnel.live[0].goaways == []
        await asyncio.wait_for(shutdown, 10)
        await tunnel.wait_until(lambda: not tunnel.live, 5.0, "the tunnel closed")
    finally:
        await grpc.stop()
        tunnel.close()


async def test_the_snapshot_follows_real_traffic(make_stack: StackFactory) -> None:
    """Requests held in the engine show in the next snapshots (running, queued or in prefill,
    their input tokens), and leave them once answered."""
    grpc = await control_plane()
    try:
        stack = await make_stack(**gateway_settings(grpc, canary_interval=0))
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: ACTIVE}, what="ACTIVE")
        await stack.knobs(ttft_ms=1500)
        body = {**CHAT, "messages": [{"role": "user", "content": "x" * 400}]}
        held = [
            asyncio.create_task(stack.post("/v1/chat/completions", body, {"x-request-id": f"r{i}"}))
            for i in range(3)
        ]

        def stats() -> pb.ModelStats:
            return grpc.registrations()[-1].message.models[MODEL].stats

        await grpc.wait_for(lambda: stats().num_running_queries == 3, what="3 running")
        busy = stats()
        assert busy.queue_size == 3  # no first output yet: pending or in prefill
        assert busy.queued_input_size >= 3 * 100 and busy.total_query_input_size >= 300
        assert "pylon" in busy.stats_sources and busy.stats_observed_at_unix_ms > 0
        answers = await asyncio.gather(*held)
        assert all(a.status_code == 200 for a in answers)
        await grpc.wait_for(lambda: stats().num_running_queries == 0, what="none running")
        assert stats().queue_size == 0
    finally:
        await grpc.stop()


def ip_leaf(ca: Any) -> tuple[bytes, bytes]:
    """A server certificate for 127.0.0.1 (an IP SAN, as gRPC checks a dialled IP), from `ca`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gateway")]))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca[1], hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def test_the_control_plane_over_tls_verifies_the_gateway(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """--gateway-tls: the token crosses TLS, and a gateway whose certificate is not from
    --gateway-ca is never registered with (the stream fails, is said, and retried)."""
    from cryptography.hazmat.primitives import serialization

    from tests.certs import make_ca

    ca = make_ca("control-plane CA")
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    token = tmp_path / "token"
    token.write_text("tls-token")
    grpc = await control_plane(token="tls-token", tls=ip_leaf(ca))
    events = EventObserver()
    try:
        settings = gateway_settings(
            grpc, gateway_tls=True, gateway_ca=str(ca_path), gateway_token_file=str(token)
        )
        await make_stack(observer=events, **settings)
        await grpc.wait_for(lambda: statuses(grpc) == {MODEL: ACTIVE}, what="over TLS")
        assert grpc.registrations()[0].metadata["authorization"] == "Bearer tls-token"
    finally:
        await grpc.stop()
    stranger = await control_plane(tls=ip_leaf(make_ca("another CA")))
    events = EventObserver()
    try:
        settings = gateway_settings(
            stranger, gateway_tls=True, gateway_ca=str(ca_path), gateway_connect_timeout=1
        )
        await make_stack(observer=events, **settings)
        await events.wait_for("gateway_watch_lost")
        assert stranger.registrations() == [] and stranger.watch_calls == 0
    finally:
        await stranger.stop()

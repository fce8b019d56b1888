"""Registration against the stand-in gateway's real gRPC server (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc.aio
import pytest

from pylon.gateway import stargate_pb2 as pb
from pylon.gateway import stargate_pb2_grpc as pb_grpc
from pylon.gateway.board import GatewayBoard, ModelHealth, ModelStatus, TunnelTarget
from pylon.gateway.registration import Registration, RegistrationOptions
from pylon.gateway.stats import ModelStatsValue
from tests.gateway.stand_in_grpc import StandInGrpc, gateway_info
from tests.observers import EventObserver

ACTIVE = pb.INFERENCE_SERVER_STATUS_ACTIVE
INACTIVE = pb.INFERENCE_SERVER_STATUS_INACTIVE


async def _until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what or predicate}") from None


def _dead_address() -> str:
    """A 127.0.0.1 port nobody listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


class Rig:
    def __init__(self) -> None:
        self.gateways: list[StandInGrpc] = []
        self.registrations: list[Registration] = []
        self.observer = EventObserver()

    async def gateway(self, **kwargs: Any) -> StandInGrpc:
        gw = StandInGrpc(**kwargs)
        await gw.start()
        self.gateways.append(gw)
        return gw

    async def self_listing(self, **kwargs: Any) -> StandInGrpc:
        """A gateway whose watch names itself."""
        gw = await self.gateway(**kwargs)
        gw.set_watch([gateway_info(gw.address)])
        return gw

    def registration(
        self,
        board: GatewayBoard,
        seeds: tuple[str, ...],
        models: Callable[[], list[str]] = lambda: ["m1"],
        stats: Callable[[], dict[str, ModelStatsValue]] = dict,
        **options: Any,
    ) -> Registration:
        defaults: dict[str, Any] = {
            "inference_server_id": "node-1",
            "inference_server_url": "quic://127.0.0.1:4433",
            "interval": 0.1,
            "connect_timeout": 1.0,
            "reconnect_base": 0.05,
            "watch_retry": 0.1,
            "discovery_publish_after": 0.3,
        }
        defaults.update(options)
        reg = Registration(
            RegistrationOptions(seeds=seeds, **defaults),
            board,
            models=models,
            stats=stats,
            observer=self.observer,
        )
        self.registrations.append(reg)
        return reg


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    rig = Rig()
    try:
        yield rig
    finally:
        for reg in rig.registrations:
            await reg.close()
        for gw in rig.gateways:
            await gw.stop()


async def test_registers_with_snapshot_and_metadata(rig: Rig) -> None:
    gw = await rig.self_listing()
    board = GatewayBoard(reverse=False)
    stats = {"m1": ModelStatsValue(queue_size=3, output_tps=12.5)}
    reg = rig.registration(board, (gw.address,), models=lambda: ["m1", "m2"], stats=lambda: stats)
    await reg.start()
    await gw.wait_for(lambda: gw.received, what="a registration")
    first = gw.received[0]
    assert first.metadata["x-stargate-registration-heartbeat-ms"] == "100"
    assert "authorization" not in first.metadata
    msg = first.message
    assert msg.inference_server_id == "node-1"
    assert msg.cluster_id == "node-1"
    assert msg.inference_server_url == "quic://127.0.0.1:4433"
    assert not msg.reverse_tunnel
    assert set(msg.models) == {"m1", "m2"}
    assert msg.models["m1"].status == ACTIVE
    assert msg.models["m1"].stats.queue_size == 3
    assert msg.models["m1"].stats.output_tps == 12.5
    assert msg.models["m2"].stats.queue_size == 0
    await rig.observer.wait_for("gateway_registered", gateway=gw.address)
    assert reg.gateways() == [gw.address]
    assert reg.connected(gw.address)
    assert reg.report()[gw.address].acks_total >= 1


async def test_heartbeat_cadence_and_idle_timeout_never_fires(rig: Rig) -> None:
    # The stand-in's idle timeout is 3x the heartbeat (0.3 s): a healthy pylon never hits it.
    gw = await rig.self_listing(idle_min=0.1)
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (gw.address,), interval=0.1)
    await reg.start()
    await gw.wait_for(lambda: gw.received, what="a first registration")
    start = gw.received[0].at
    await gw.wait_for(lambda: gw.received[-1].at - start >= 1.5, timeout=5, what="1.5 s")
    window = [r for r in gw.received if r.at - start <= 1.5]
    # 1.5 s at 0.1 s: about 15 snapshots; a loose band, not exact timing.
    assert 8 <= len(window) <= 25, len(window)
    assert gw.streams[0].idle_timeout == pytest.approx(0.3)
    assert [s.outcome for s in gw.streams] == [""], "the stream was dropped"
    assert len({r.stream for r in gw.received}) == 1


async def test_board_change_resends_at_once(rig: Rig) -> None:
    gw = await rig.self_listing()
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (gw.address,), interval=5.0)
    await reg.start()
    await gw.wait_for(lambda: gw.received, what="a registration")
    await rig.observer.wait_for("gateway_registered")
    before = len(gw.received)
    board.set_model_health("m1", ModelHealth(False, "timeout"))
    # Well inside the 5 s interval: the change itself sent the snapshot.
    await gw.wait_for(lambda: len(gw.received) > before, timeout=2.0, what="the resend")
    assert gw.received[-1].message.models["m1"].status == INACTIVE
    assert reg.report()[gw.address].model_status == {"m1": ModelStatus.INACTIVE}


async def test_reverse_status_follows_tunnel_and_acks_set_target(rig: Rig) -> None:
    gw = await rig.self_listing(ack_target="gw-pod-1:4443", ack_dial_addr="10.0.0.1:4443")
    board = GatewayBoard(reverse=True)
    reg = rig.registration(board, (gw.address,), interval=5.0, reverse_tunnel=True)
    await reg.start()
    await gw.wait_for(lambda: gw.received, what="a registration")
    assert gw.received[0].message.reverse_tunnel
    assert gw.received[0].message.models["m1"].status == INACTIVE  # no tunnel yet
    await _until(lambda: board.target(gw.address) is not None, what="the target")
    assert board.target(gw.address) == TunnelTarget("gw-pod-1:4443", "10.0.0.1:4443")
    before = len(gw.received)
    board.set_tunnels(gw.address, 1)
    await gw.wait_for(lambda: len(gw.received) > before, timeout=2.0, what="the resend")
    assert gw.received[-1].message.models["m1"].status == ACTIVE
    # The stream ends: the target is cleared.
    gw.kick()
    await rig.observer.wait_for("gateway_stream_lost", gateway=gw.address)
    await _until(lambda: len(gw.streams) >= 2, what="the reopened stream")


async def test_token_reread_on_reconnect(rig: Rig, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("  first-token\n")
    gw = await rig.self_listing(token="first-token")
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (gw.address,), token_file=token)
    await reg.start()
    await gw.wait_for(lambda: gw.received, what="a registration")
    assert gw.received[0].metadata["authorization"] == "Bearer first-token"
    token.write_text("second-token")
    gw.token = "second-token"
    gw.kick()
    await gw.wait_for(
        lambda: any(r.metadata.get("authorization") == "Bearer second-token" for r in gw.received),
        what="the rotated token",
    )


async def test_wrong_token_retried_with_backoff(rig: Rig, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("wrong")
    gw = await rig.self_listing(token="right")
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (gw.address,), token_file=token, reconnect_base=0.05)
    await reg.start()
    for _ in range(4):
        await rig.observer.wait_for("gateway_stream_lost", after=len(rig.observer.events))
    lost = rig.observer.of("gateway_stream_lost")
    assert all("UNAUTHENTICATED" in e["reason"] for e in lost[:4]), lost
    delays = [e["retry_in"] for e in lost[:4]]
    assert delays == sorted(delays) and delays[-1] > delays[0], delays
    assert not gw.received
    assert not reg.connected(gw.address)
    assert reg.report()[gw.address].reconnects_total["unauthenticated"] >= 4
    token.write_text("right")
    await gw.wait_for(lambda: gw.received, timeout=5, what="registration after the fix")


async def test_missing_token_file_is_an_event_then_retried(rig: Rig, tmp_path: Path) -> None:
    token = tmp_path / "absent"
    gw = await rig.self_listing(token="t")
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (gw.address,), token_file=token)
    await reg.start()
    event = await rig.observer.wait_for("gateway_token_unreadable")
    assert event["path"] == str(token)
    token.write_text("t\n")
    await gw.wait_for(lambda: gw.received, what="registration once the file exists")


async def test_transitive_watch_several_gateways(rig: Rig) -> None:
    a = await rig.gateway()
    b = await rig.gateway()
    c = await rig.gateway()
    region2 = await rig.gateway()  # a watch endpoint only: never registered with
    region2.set_watch([gateway_info(c.address)])
    a.set_watch([gateway_info(a.address), gateway_info(b.address)], [region2.address])
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (a.address,))
    await reg.start()
    for gw in (a, b, c):
        await gw.wait_for(lambda gw=gw: gw.received, what=f"registration at {gw.address}")
    assert sorted(reg.gateways()) == sorted([a.address, b.address, c.address])
    assert not region2.received


async def test_dial_addr_used_with_advertise_as_authority(rig: Rig) -> None:
    gw = await rig.gateway()
    gw.set_watch([gateway_info("gateway.example:50071", dial=gw.address)])
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (gw.address,))
    await reg.start()
    await gw.wait_for(lambda: gw.received, what="a registration via the dial address")
    assert reg.gateways() == ["gateway.example:50071"]
    # (grpc's server API does not expose the :authority the channel sent, so the authority
    # itself is not checked here: the key is, and that the dial address was the one dialled.)
    assert gw.received[0].message.inference_server_id == "node-1"


async def test_gateway_gone_from_watch_is_retired(rig: Rig) -> None:
    a = await rig.gateway()
    b = await rig.gateway()
    a.set_watch([gateway_info(a.address), gateway_info(b.address)])
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (a.address,))
    await reg.start()
    await b.wait_for(lambda: b.received, what="registration at b")
    a.set_watch([gateway_info(a.address)])
    await rig.observer.wait_for("gateway_retired", gateway=b.address)
    assert reg.gateways() == [a.address]
    await b.wait_for(lambda: not b.open_streams(), what="b's stream closed")
    count = len(b.received)
    await a.wait_for(lambda: len(a.received) > count + 5, what="a keeps registering")
    assert len(b.received) == count


async def test_dead_seed_does_not_block_publication(rig: Rig) -> None:
    gw = await rig.self_listing()
    board = GatewayBoard(reverse=False)
    reg = rig.registration(
        board, (_dead_address(), gw.address), connect_timeout=0.2, discovery_publish_after=0.3
    )
    await reg.start()
    await gw.wait_for(lambda: gw.received, timeout=3.0, what="registration despite a dead seed")
    assert reg.gateways() == [gw.address]


async def test_drain_sends_inactive_before_close(rig: Rig) -> None:
    a = await rig.self_listing()
    b = await rig.gateway()
    a.set_watch([gateway_info(a.address), gateway_info(b.address)])
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (a.address,), interval=5.0, models=lambda: ["m1", "m2"])
    await reg.start()
    for gw in (a, b):
        await gw.wait_for(lambda gw=gw: gw.received, what="registration")
    await _until(lambda: reg.connected(a.address) and reg.connected(b.address), what="acks")
    before = [len(a.received), len(b.received)]
    assert await reg.drain()
    # The drain sends its snapshot once per stream (the 5 s heartbeat is far off), not a burst.
    assert [len(a.received) - before[0], len(b.received) - before[1]] == [1, 1]
    for gw in (a, b):
        last = gw.received[-1].message
        assert {m: e.status for m, e in last.models.items()} == {"m1": INACTIVE, "m2": INACTIVE}
        assert gw.open_streams(), "drain must not close the stream"
    await reg.close()
    for gw in (a, b):
        await gw.wait_for(lambda gw=gw: not gw.open_streams(), what="streams closed")
        assert gw.streams[-1].outcome in ("client ended", "cancelled"), gw.streams[-1]


async def test_discovery_is_bounded(rig: Rig) -> None:
    # Four gateways named, two allowed; a watch chain a -> b -> c with two watched URLs.
    a = await rig.gateway()
    b = await rig.gateway()
    c = await rig.gateway()
    a.set_watch(
        [gateway_info(a.address), *(gateway_info(f"10.255.0.{i}:1") for i in range(1, 4))],
        [b.address],
    )
    b.set_watch([], [c.address])
    c.set_watch([gateway_info(c.address)])
    board = GatewayBoard(reverse=False)
    reg = rig.registration(board, (a.address,), max_gateways=2, max_watched=2)
    await reg.start()
    await a.wait_for(lambda: a.received, what="registration at a")
    await b.wait_for(lambda: b.watch_calls >= 1, what="b watched")
    assert reg.gateways() == [a.address, "10.255.0.1:1"]
    # c is past the watch cap: never watched, never registered with.
    await a.wait_for(lambda: len(a.received) >= 5, what="a few heartbeats")
    assert c.watch_calls == 0
    assert not c.received


async def test_stand_in_drops_a_silent_stream_after_three_heartbeats(rig: Rig) -> None:
    """The stand-in's idle timeout is real (so the test that it never fires means something)."""
    gw = await rig.gateway(idle_min=0.1)
    async with grpc.aio.insecure_channel(gw.address) as channel:
        call: Any = pb_grpc.StargateControlPlaneStub(channel).RegisterInferenceServer(
            metadata=[("x-stargate-registration-heartbeat-ms", "100")]
        )
        await call.write(pb.InferenceServerRegistration(inference_server_id="quiet"))
        assert isinstance(await call.read(), pb.InferenceServerAck)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            async with asyncio.timeout(3):
                await call.read()
        assert failure.value.details() == "idle timeout"
    assert gw.streams[0].outcome == "idle timeout"
    # The client can read the abort's status before the stand-in's handler has unwound.
    await gw.wait_for(lambda: gw.streams[0].ended is not None, what="the stream's end noted")
    assert gw.streams[0].ended is not None
    assert 0.25 <= gw.streams[0].ended - gw.received[0].at <= 2.0

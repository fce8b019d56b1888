"""The reverse tunnel's connections: refusals and their retries, tokens, several connections,
lost paths, trust, drain and target changes, against the stand-in gateway (a refusal's retry, a
redial and the drain over both stream layers, the rest over HTTP/3)."""

from __future__ import annotations

import asyncio
import json
import traceback
from pathlib import Path
from typing import Any

import pytest

import pylon.gateway.tunnel as tunnel_module
from pylon.gateway import wire
from pylon.gateway.board import GatewayBoard, TunnelTarget
from pylon.gateway.tunnel import ReverseTunnels, TunnelOptions, TunnelProtocol
from tests.certs import make_ca
from tests.gateway.stand_in_quic import RAW_STOP_GOAWAY, StandInGateway
from tests.gateway.tunnel_fixtures import GATEWAY, NODE, PROTOCOLS, TunnelFactory, headers
from tests.observers import EventObserver
from tests.stack import MODEL, StackFactory

CHAT = "/v1/chat/completions"
H3_REQUEST_REJECTED = 0x10B


def chat(stream: bool = False, max_tokens: int = 4) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({**body, "stream": stream, "max_tokens": max_tokens}).encode()


async def served(tunnel_gateway: StandInGateway, request_id: str = "ok-1") -> None:
    response = await tunnel_gateway.request("POST", CHAT, headers(request_id), chat())
    assert response.status == 200, response.body


# Every reason over HTTP/3; raw QUIC shares the handshake code, so one reason is enough there.
@pytest.mark.parametrize(
    ("protocol", "reason"),
    [*(("http3", reason) for reason in wire.NACK_REASONS), ("raw-quic", wire.NACK_DUPLICATE)],
)
async def test_each_refusal_is_one_event_and_is_retried(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol, reason: str
) -> None:
    tunnel = await make_tunnel(start=False, protocol=protocol)
    tunnel.gateway.nack_next = [reason]
    tunnel.tunnels.start()
    refused = await tunnel.events.wait_for("tunnel_refused")
    assert refused == {"gateway": GATEWAY, "index": 0, "reason": reason, "backoff_s": 0.05}
    assert tunnel.tunnels.refusals == {reason: 1}
    assert tunnel.board.tunnels(GATEWAY) == 0
    await tunnel.events.wait_for("tunnel_connected")
    assert [r for _, r in tunnel.gateway.handshakes] == [reason, None]
    await served(tunnel.gateway)


async def test_the_gateway_table_refuses_an_unknown_id_with_growing_backoff(
    make_tunnel: TunnelFactory,
) -> None:
    tunnel = await make_tunnel(inference_server_id="node-unknown")
    for _ in range(4):
        await tunnel.events.wait_for("tunnel_refused", after=len(tunnel.events.events))
    backoffs = [e["backoff_s"] for e in tunnel.events.of("tunnel_refused")]
    assert backoffs[:4] == [0.05, 0.1, 0.2, 0.2]  # doubling, capped at backoff_max
    assert {e["reason"] for e in tunnel.events.of("tunnel_refused")} == {wire.NACK_UNAUTHORIZED_ID}
    assert tunnel.gateway.accepted == 0 and not tunnel.events.of("tunnel_connected")


async def test_the_token_file_is_read_at_every_dial(
    make_tunnel: TunnelFactory, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("wrong\n")
    folder = tmp_path / "gw"
    folder.mkdir()
    gateway = StandInGateway(folder, {NODE: "secret-1"})
    tunnel = await make_tunnel(gateway=gateway, token_file=token)
    refused = await tunnel.events.wait_for("tunnel_refused")
    assert refused["reason"] == wire.NACK_AUTHENTICATION
    token.write_text("  secret-1 \n")  # trimmed
    await tunnel.events.wait_for("tunnel_connected")
    assert gateway.handshakes[-1][0].auth_token == "secret-1"
    await served(gateway)
    # Rotation: both sides move to a new token; the next dial presents it.
    gateway.tokens[NODE] = "secret-2"
    token.write_text("secret-2")
    mark = tunnel.events.mark()
    gateway.drop()
    await tunnel.events.wait_for("tunnel_lost", after=mark)
    await tunnel.events.wait_for("tunnel_connected", after=mark)
    assert gateway.handshakes[-1] == (wire.Handshake(NODE, "secret-2"), None)
    await served(gateway, "ok-2")


async def test_an_unreadable_token_file_fails_the_dial(
    make_tunnel: TunnelFactory, tmp_path: Path
) -> None:
    tunnel = await make_tunnel(token_file=tmp_path / "missing")
    failed = await tunnel.events.wait_for("tunnel_dial_failed")
    assert "token file" in failed["reason"] and failed["backoff_s"] == 0.05
    assert tunnel.gateway.dialled == 0


async def test_a_duplicate_is_retried_until_the_gateway_lets_go(
    make_tunnel: TunnelFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "gw"
    folder.mkdir()
    gateway = StandInGateway(folder, refuse_duplicates=True)
    tunnel = await make_tunnel(gateway=gateway)
    await tunnel.events.wait_for("tunnel_connected")
    # A broken path the gateway has not noticed: its old connection still counts.
    gateway.keep_gone = True
    mark = tunnel.events.mark()
    gateway.drop()
    lost = await tunnel.events.wait_for("tunnel_lost", after=mark)
    assert "dropped by the stand-in" in lost["reason"] and lost["lived_s"] >= 0
    assert (await tunnel.events.wait_for("tunnel_refused", after=mark))["reason"] == (
        wire.NACK_DUPLICATE
    )
    assert not tunnel.events.of("tunnel_connected", after=mark)
    gateway.release_gone()
    await tunnel.events.wait_for("tunnel_connected", after=mark)
    assert tunnel.tunnels.refusals[wire.NACK_DUPLICATE] >= 1
    await served(gateway)


async def test_a_gateway_that_takes_one_connection_gets_a_standby(
    make_tunnel: TunnelFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "gw"
    folder.mkdir()
    gateway = StandInGateway(folder, refuse_duplicates=True)
    tunnel = await make_tunnel(gateway=gateway, connections=2)
    await tunnel.up()
    standby = await tunnel.events.wait_for("tunnel_refused", standby=True)
    assert standby["reason"] == wire.NACK_DUPLICATE and standby["backoff_s"] == 0.2
    assert len(gateway.live) == 1
    # The live one goes: one of the two (the standby or the redial) takes over.
    mark = tunnel.events.mark()
    gateway.drop()
    await tunnel.events.wait_for("tunnel_connected", after=mark)
    await tunnel.up()
    await served(gateway)
    assert len(gateway.live) == 1


async def test_two_connections_both_serve(make_tunnel: TunnelFactory) -> None:
    tunnel = await make_tunnel(connections=2)
    await tunnel.up(2)
    assert sorted(e["index"] for e in tunnel.events.of("tunnel_connected")) == [0, 1]
    replies = [
        await tunnel.gateway.request("POST", CHAT, headers(f"rr-{i}"), chat()) for i in range(4)
    ]
    assert [r.status for r in replies] == [200] * 4
    assert len({id(r.connection) for r in replies}) == 2
    # One path lost: the other still serves while the first redials.
    flips: list[str] = []
    tunnel.board.subscribe(flips.append)
    first = tunnel.gateway.live[0]
    first.drop()
    await tunnel.gateway.wait_until(lambda: first.terminated is not None, what="the drop")
    await served(tunnel.gateway, "one-left")
    await tunnel.gateway.wait_live(2)
    assert "tunnel" not in flips  # never down to zero: the registration saw no flip


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_dropped_connection_is_redialled_and_serves_again(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(protocol=protocol)
    await tunnel.events.wait_for("tunnel_connected")
    await served(tunnel.gateway)
    flips: list[str] = []
    tunnel.board.subscribe(flips.append)
    mark = tunnel.events.mark()
    tunnel.gateway.drop()
    await tunnel.events.wait_for("tunnel_lost", after=mark)
    await tunnel.events.wait_for("tunnel_connected", after=mark)
    assert flips == ["tunnel", "tunnel"]  # down, then up again
    assert tunnel.board.tunnels(GATEWAY) == 1
    await served(tunnel.gateway, "again")


async def test_a_silent_path_is_noticed_by_the_idle_timeout(make_tunnel: TunnelFactory) -> None:
    tunnel = await make_tunnel(keepalive=0.2, idle_timeout=1.0)
    await tunnel.up()
    old = tunnel.gateway.live[0]
    mark = tunnel.events.mark()
    old.vanish()
    lost = await tunnel.events.wait_for("tunnel_lost", after=mark, timeout=5)
    assert lost["lived_s"] >= 1.0
    await tunnel.events.wait_for("tunnel_connected", after=mark)
    await served(tunnel.gateway)


async def test_keepalive_holds_a_quiet_tunnel_past_the_idle_timeout(
    make_tunnel: TunnelFactory,
) -> None:
    tunnel = await make_tunnel(keepalive=0.2, idle_timeout=0.8)
    await tunnel.up()
    connection = tunnel.gateway.live[0]
    # Wait on the pings themselves: ten keepalives arrive, well past one idle timeout.
    loop = asyncio.get_running_loop()
    started, seen = loop.time(), connection.datagrams
    await tunnel.gateway.wait_until(lambda: connection.datagrams >= seen + 10, what="pings")
    assert loop.time() - started > 0.8 * 2  # (10 PINGs at 0.2 s: two idle timeouts)
    assert connection.terminated is None and tunnel.gateway.live == [connection]
    assert not tunnel.events.of("tunnel_lost")


async def test_a_gateway_certificate_from_another_ca_is_refused(
    make_tunnel: TunnelFactory, tmp_path: Path
) -> None:
    from cryptography.hazmat.primitives import serialization

    other = tmp_path / "other-ca.pem"
    other.write_bytes(make_ca("someone else")[0].public_bytes(serialization.Encoding.PEM))
    tunnel = await make_tunnel(ca=other)
    failed = await tunnel.events.wait_for("tunnel_dial_failed")
    assert "certificate" in failed["reason"].lower(), failed
    assert tunnel.gateway.accepted == 0 and not tunnel.gateway.handshakes
    assert tunnel.board.tunnels(GATEWAY) == 0


async def test_the_sni_is_the_target_host_when_the_dial_address_differs(
    make_tunnel: TunnelFactory,
) -> None:
    tunnel = await make_tunnel(start=False)
    # The stand-in's certificate names `stargate`: a target host of its own does not match.
    tunnel.board.set_target(GATEWAY, TunnelTarget("gw-7.example:443", tunnel.gateway.address))
    tunnel.tunnels.start()
    failed = await tunnel.events.wait_for("tunnel_dial_failed")
    assert "gw-7.example" in failed["reason"], failed
    # An IP (or localhost) target: SNI `stargate`, which the certificate names.
    tunnel.board.set_target(GATEWAY, TunnelTarget("localhost:443", tunnel.gateway.address))
    await tunnel.up()


async def test_the_next_address_is_tried_when_one_does_not_answer(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    stack = await make_stack(quic_listen=None)
    gateway = await StandInGateway(tmp_path).start()
    tried: list[tuple[str, int]] = []

    async def resolver(host: str, port: int) -> list[str]:
        tried.append((host, port))
        return ["127.0.0.3", "127.0.0.1"]  # nothing listens on the first

    board = GatewayBoard(reverse=True)
    events = EventObserver()
    options = TunnelOptions(
        inference_server_id=NODE, ca=gateway.ca_path, connections=1, connect_timeout=0.5
    )
    tunnels = ReverseTunnels(options, board, stack.running.core.ingress, events, resolver=resolver)
    try:
        board.set_target(
            GATEWAY,
            TunnelTarget(gateway.address, f"gw.example:{gateway.port}"),  # SNI stargate
        )
        tunnels.start()
        connected = await events.wait_for("tunnel_connected")
        assert connected["dial"] == f"127.0.0.1:{gateway.port}"
        assert tried == [("gw.example", gateway.port)]
    finally:
        await tunnels.close()
        gateway.close()


async def test_a_gateway_that_does_not_answer_times_out(
    make_tunnel: TunnelFactory,
) -> None:
    tunnel = await make_tunnel(start=False, connect_timeout=0.3)
    port = tunnel.gateway.port
    tunnel.gateway.close()  # nothing listens there any more
    tunnel.board.set_target(GATEWAY, TunnelTarget(f"127.0.0.1:{port}", f"127.0.0.1:{port}"))
    tunnel.tunnels.start()
    failed = await tunnel.events.wait_for("tunnel_dial_failed")
    # Timed out, or (loopback) the port's ICMP error ended the attempt first.
    assert failed["reason"].startswith("127.0.0.1: "), failed
    assert tunnel.gateway.accepted == 0


async def test_insecure_dials_without_verifying(make_tunnel: TunnelFactory) -> None:
    tunnel = await make_tunnel(insecure=True)
    await tunnel.events.wait_for("tunnel_connected")
    await served(tunnel.gateway)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_drain_stops_new_streams_and_lets_in_flight_finish(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(
        stack_settings={"mock": {"token_delay_ms": 40, "num_tokens": 10}}, protocol=protocol
    )
    await tunnel.up()
    connection = tunnel.gateway.live[0]
    dialled = tunnel.gateway.dialled
    slow = tunnel.gateway.send("POST", CHAT, headers("slow"), chat(stream=True, max_tokens=10))
    await tunnel.stack.wait_record("slow", "received")
    if protocol == "http3":
        drained = asyncio.get_running_loop().create_task(tunnel.tunnels.drain(10.0))
        await tunnel.gateway.wait_until(lambda: connection.goaways != [], what="GOAWAY")
        assert connection.goaways == [slow.stream_id + 4]
    else:
        # Raw QUIC has no GOAWAY: the gateway learns of the drain from the refused stream.
        # `begin_drain` is synchronous, so the next stream is certainly refused.
        tunnel.tunnels.begin_drain()
        drained = asyncio.get_running_loop().create_task(tunnel.tunnels.drain(10.0))
    late = tunnel.gateway.send("POST", CHAT, headers("late"), chat(), connection=connection)
    await late.wait()
    refused = H3_REQUEST_REJECTED if protocol == "http3" else RAW_STOP_GOAWAY
    assert late.reset_code == refused and late.status is None
    await slow.wait()
    assert slow.status == 200 and slow.body.rstrip().endswith(b"[DONE]")
    assert await drained is True
    assert tunnel.board.tunnels(GATEWAY) == 0  # every link closed before drain returned
    assert tunnel.gateway.dialled == dialled  # no redial after the drain
    assert [r["headers"] for r in await tunnel.stack.records()]  # "late" never reached it
    assert len(await tunnel.stack.records()) == 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_the_process_drain_can_drain_the_tunnels(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol
) -> None:
    tunnel = await make_tunnel(connections=2, protocol=protocol)
    await tunnel.up(2)
    connections = list(tunnel.gateway.live)
    dialled = tunnel.gateway.dialled
    tunnel.stack.running.core.lifecycle.on_drain(tunnel.tunnels.begin_drain)
    tunnel.stack.drain()  # what SIGTERM starts
    await tunnel.gateway.wait_until(
        lambda: all(c.terminated is not None for c in connections), what="closed"
    )
    # Nothing was in flight: HTTP/3's GOAWAY names the first stream; raw QUIC has none.
    expected = [[1], [1]] if protocol == "http3" else [[], []]
    assert [c.goaways for c in connections] == expected
    await tunnel.down()
    assert await tunnel.tunnels.drain(1.0) is True
    assert tunnel.gateway.dialled == dialled


async def test_a_new_target_retires_the_old_connections(
    make_tunnel: TunnelFactory, tmp_path: Path
) -> None:
    tunnel = await make_tunnel()
    await tunnel.up()
    old = tunnel.gateway.live[0]
    folder = tmp_path / "second"
    folder.mkdir()
    second = await StandInGateway(folder, ca=tunnel.gateway.ca).start()
    try:
        mark = tunnel.events.mark()
        tunnel.board.set_target(GATEWAY, tunnel.target(second))
        await second.wait_live(1)
        await tunnel.gateway.wait_until(lambda: old.terminated is not None, what="retired")
        connected = await tunnel.events.wait_for("tunnel_connected", after=mark)
        assert connected["target"] == second.address
        await served(second)
        assert tunnel.gateway.accepted == 1  # the old target is not redialled
        tunnel.board.set_target(GATEWAY, None)
        await second.wait_until(lambda: not second.live, what="closed")
        await tunnel.down()
        assert tunnel.board.tunnels(GATEWAY) == 0
    finally:
        second.close()


async def test_a_target_that_goes_away_closes_its_connections(make_tunnel: TunnelFactory) -> None:
    tunnel = await make_tunnel(connections=2)
    await tunnel.gateway.wait_live(2)
    old = list(tunnel.gateway.live)
    tunnel.board.set_target(GATEWAY, None)  # (its registration stream ended)
    await tunnel.gateway.wait_until(
        lambda: all(c.terminated is not None for c in old), what="both closed"
    )
    await tunnel.down()
    assert tunnel.board.tunnels(GATEWAY) == 0
    dialled = tunnel.gateway.dialled
    # Back again: dialled afresh.
    tunnel.board.set_target(GATEWAY, tunnel.target())
    await tunnel.gateway.wait_live(2)
    assert tunnel.gateway.dialled == dialled + 2


def test_options_refuse_what_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CA"):
        TunnelOptions(inference_server_id=NODE)
    with pytest.raises(ValueError, match="contradict"):
        TunnelOptions(inference_server_id=NODE, ca=tmp_path, insecure=True)
    with pytest.raises(ValueError, match="idle timeout"):
        TunnelOptions(inference_server_id=NODE, insecure=True, keepalive=5, idle_timeout=5)
    with pytest.raises(ValueError, match="id"):
        TunnelOptions(inference_server_id="", insecure=True)


async def test_a_dial_cancelled_mid_handshake_closes_its_socket(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """A slot retired (here: the shutdown) while its dial waits for a gateway that never
    answers: the dial's UDP socket is closed with it, not left to the garbage collector (aioquic's
    `connect()` closes it only once the connection's close has completed)."""
    stack = await make_stack(quic_listen=None)
    loop = asyncio.get_running_loop()
    heard = asyncio.Event()

    class Silent(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            heard.set()  # the Initial arrived; never answered

    silent, _ = await loop.create_datagram_endpoint(Silent, local_addr=("127.0.0.1", 0))
    port = silent.get_extra_info("sockname")[1]
    board = GatewayBoard(reverse=True)
    options = TunnelOptions(
        inference_server_id=NODE, insecure=True, connections=1, connect_timeout=30
    )
    tunnels = ReverseTunnels(options, board, stack.running.core.ingress, EventObserver())
    made = []
    factory = tunnels._factory

    def recording(*args: object) -> object:
        made.append(factory(*args))  # type: ignore[arg-type]
        return made[-1]

    tunnels._factory = recording  # type: ignore[assignment]
    try:
        board.set_target(GATEWAY, TunnelTarget(f"127.0.0.1:{port}", f"127.0.0.1:{port}"))
        tunnels.start()
        async with asyncio.timeout(10):
            await heard.wait()
        dials = [slot.task for slot in tunnels._all_slots() if slot.task is not None]
        closing = asyncio.create_task(tunnels.close())
        for _ in range(3):  # the close's cancel delivered: the dial is in connect()'s cleanup
            await asyncio.sleep(0)
        for dial in dials:
            dial.cancel()  # and cancelled again there, as a shutdown's last sweep does
        await closing
    finally:
        await tunnels.close()
        silent.close()
    assert made, "the dial made a link"
    for link in made:
        assert link._datagrams is not None and link._datagrams.is_closing()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_fault_in_a_link_is_logged_and_the_dial_retried(
    make_tunnel: TunnelFactory, protocol: TunnelProtocol, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link that raises what no dial expects (here a TypeError, as a compiled base class
    refusing an interpreted subclass did) is one `tunnel_dial_failed` naming it, and the slot
    dials again: its task must not end in silence, leaving the node without a tunnel. The
    socket aioquic's `connect()` made for the dead link is closed (asyncio would leave it)."""
    stand_ins: list[tunnel_module._Stillborn] = []

    class Recorded(tunnel_module._Stillborn):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            stand_ins.append(self)

    monkeypatch.setattr(tunnel_module, "_Stillborn", Recorded)
    tunnel = await make_tunnel(start=False, protocol=protocol)
    factory = tunnel.tunnels._factory
    faults = [TypeError("a broken link")]

    def faulty(*args: object) -> object:
        if faults:
            raise faults.pop()
        return factory(*args)  # type: ignore[arg-type]

    tunnel.tunnels._factory = faulty  # type: ignore[assignment]
    tunnel.tunnels.start()
    failed = await tunnel.events.wait_for("tunnel_dial_failed")
    assert failed["reason"] == "internal error: TypeError: a broken link"
    # The line carries the traceback (structlog renders `exc_info`), down to the fault.
    fault = failed["exc_info"]
    assert isinstance(fault, TypeError) and fault.__traceback__ is not None
    assert "faulty" in [frame.name for frame in traceback.extract_tb(fault.__traceback__)]
    assert failed["backoff_s"] == 0.05 and tunnel.tunnels.dial_failures == 1
    [dead] = stand_ins
    assert dead._datagrams is not None and dead._datagrams.is_closing()
    await tunnel.up()
    await served(tunnel.gateway)

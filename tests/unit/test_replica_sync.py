"""Replicas across nodes, without Dynamo: the settings and their refusals, the peer parser
(examples and properties), what reaches the selection core's constructor, the start events,
and pylon's own watch of the peers' sync streams (a real ZMQ PUB on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.assemble import routing_options
from pylon.routing.build import build_routing
from pylon.routing.replica_sync import TOPIC, ReplicaSyncWatch, event_worker
from pylon.routing.spec import catalogue_digest, check_replica_peer
from pylon.settings import SettingsError, load_settings
from router_ffi import InvalidConfig, ReplicaSync, SelectionCore, check_replica_sync
from router_ffi import _native as native_module
from router_ffi.service import EXPIRY_ENV
from tests.looplag import LoopLag
from tests.observers import EventObserver
from tests.router_ffi.fake_native import FakeNative

W1 = "url=http://127.0.0.1:9001,kv-events=tcp://127.0.0.1:5557"
W2 = "url=http://127.0.0.1:9002,kv-events=tcp://127.0.0.1:5558"
KV = {"routing": "kv", "worker": [W1, W2], "tokenizer": "/tmp"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith(("PYLON_", "OTEL_")):
            monkeypatch.delenv(name)
    # The core writes its expiry into the environment: put back whatever was there.
    monkeypatch.setenv(EXPIRY_ENV, "300")
    monkeypatch.delenv(EXPIRY_ENV)


# --- settings ------------------------------------------------------------------------------


def test_replica_sync_settings_reach_the_kv_options() -> None:
    settings = load_settings(
        {
            **KV,
            "replica_sync_port": 7100,
            "replica_peer": ["10.0.0.2:7100", "peer.example:7100"],
            "kv_booking_expiry": 30,
        }
    )
    kv = routing_options(settings).kv
    assert kv is not None
    assert kv.replica_sync_port == 7100
    assert kv.replica_peers == ("10.0.0.2:7100", "peer.example:7100")
    assert kv.booking_expiry == 30


def test_replica_peers_come_from_the_environment_and_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYLON_REPLICA_PEER", "10.0.0.2:7100, 10.0.0.3:7100")
    settings = load_settings({**KV, "replica_sync_port": 7100})
    assert settings.replica_peer == ("10.0.0.2:7100", "10.0.0.3:7100")
    monkeypatch.delenv("PYLON_REPLICA_PEER")
    config = tmp_path / "pylon.toml"
    config.write_text(
        'routing = "kv"\ntokenizer = "/tmp"\nreplica_sync_port = 7100\n'
        'replica_peer = ["[fd00::2]:7100"]\n'
        '[[worker]]\nurl = "http://127.0.0.1:9001"\nkv-events = "tcp://127.0.0.1:5557"\n'
    )
    settings = load_settings({}, config_file=config)
    assert settings.replica_peer == ("[fd00::2]:7100",)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"replica_sync_port": 7100}, "--replica-sync-port needs --routing kv"),
        (
            {"routing": "least-loaded", "worker": [W1], "replica_peer": ["10.0.0.2:7100"]},
            "--replica-peer needs --routing kv",
        ),
        ({"kv_booking_expiry": 30}, "--kv-booking-expiry needs --routing kv"),
        ({**KV, "replica_peer": ["10.0.0.2:7100"]}, "--replica-peer needs --replica-sync-port"),
        ({**KV, "replica_sync_port": 7100}, "needs at least one --replica-peer"),
        ({**KV, "replica_sync_port": 0, "replica_peer": ["a:1"]}, "replica_sync_port"),
        ({**KV, "replica_sync_port": 7100, "replica_peer": ["10.0.0.2"]}, "port is required"),
        ({**KV, "replica_sync_port": 7100, "replica_peer": ["a:1", "a:1"]}, "given twice"),
        ({**KV, "kv_booking_expiry": 0.5}, "kv_booking_expiry"),
    ],
)
def test_replica_settings_that_cannot_take_effect_are_refused(overrides: dict, needle: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(overrides)
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


# --- the peer parser -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("10.0.0.2:7100", "tcp://10.0.0.2:7100"),
        ("pylon-b.node.local:1", "tcp://pylon-b.node.local:1"),
        ("[fd00::2]:65535", "tcp://[fd00::2]:65535"),
        ("h:007", "tcp://h:7"),
    ],
)
def test_a_peer_becomes_the_endpoint_the_core_subscribes_to(text: str, endpoint: str) -> None:
    assert check_replica_peer(text) == endpoint


@pytest.mark.parametrize(
    "text",
    ["10.0.0.2", ":7100", "h:0", "h:65536", "h:-1", "h:1x", "fd00::2:7100", "[zz]:1", "h h:1",
     "tcp://h:1", "h:1/", "ünï:1", "h:999999"],
)  # fmt: skip
def test_a_peer_that_is_not_host_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="replica peer"):
        check_replica_peer(text)


hosts = st.one_of(
    st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]"),
)


@given(hosts, st.integers(1, 65535))
def test_every_host_and_port_round_trips(host: str, port: int) -> None:
    endpoint = check_replica_peer(f"{host}:{port}")
    assert endpoint == f"tcp://{host}:{port}"
    assert check_replica_sync(ReplicaSync(7100, (endpoint,))).peers == (endpoint,)


@given(st.text(max_size=40))
def test_any_text_is_an_endpoint_or_one_line_refusal(text: str) -> None:
    try:
        endpoint = check_replica_peer(text)
    except ValueError as exc:
        assert "\n" not in str(exc).replace(repr(text), "")
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    assert 1 <= int(port) <= 65535 and host
    if host.startswith("["):
        ipaddress.IPv6Address(host[1:-1])


# --- the selection core's constructor ------------------------------------------------------


def test_the_core_refuses_a_replica_sync_it_cannot_start() -> None:
    for sync in (
        ReplicaSync(0, ("tcp://a:1",)),
        ReplicaSync(7100, ()),
        ReplicaSync(7100, ("a:1",)),
        ReplicaSync(7100, ("tcp://a",)),
        ReplicaSync(7100, ("ipc:///tmp/x",)),
    ):
        with pytest.raises(InvalidConfig, match="replica sync"):
            check_replica_sync(sync)
        with pytest.raises(InvalidConfig, match="replica sync"):
            SelectionCore(native=FakeNative, replica_sync=sync)


def test_the_replica_sync_and_expiry_reach_dynamos_constructor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `SelectionService(...)` is built with: the port and the peers' endpoints, and the
    expiry in the environment the native core reads when it is built."""
    built: list[dict[str, Any]] = []

    class Module:
        @staticmethod
        def SelectionService(**kwargs: Any) -> FakeNative:
            built.append({**kwargs, "expiry": os.environ.get(EXPIRY_ENV)})
            return FakeNative()

    monkeypatch.setattr(native_module, "load_native", lambda: Module)
    sync = ReplicaSync(7100, ("tcp://10.0.0.2:7100",))
    core = SelectionCore(indexer_threads=1, replica_sync=sync, active_request_expiry_s=30.0)
    core.shutdown()
    assert built == [
        {
            "indexer_threads": 1,
            "replica_sync_port": 7100,
            "replica_sync_peers": ["tcp://10.0.0.2:7100"],
            "expiry": "30",
        }
    ]
    SelectionCore(indexer_threads=1).shutdown()
    assert built[-1] == {"indexer_threads": 1, "expiry": "30"}  # no sync: no sync arguments


# --- what pylon builds ---------------------------------------------------------------------


class Words:
    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        return list(body)


async def test_the_start_events_name_the_exposure_and_the_digest() -> None:
    settings = load_settings(
        {
            **KV,
            "replica_sync_port": 7100,
            "replica_peer": ["127.0.0.1:9"],
            "worker_health_interval": 3600.0,
        }
    )
    observer = EventObserver()
    fake = FakeNative()
    routing = await build_routing(
        routing_options(settings), observer, tokenizer=Words(), native=lambda: fake
    )
    try:
        digest = catalogue_digest(settings.worker)
        (started,) = observer.of("kv_router_started")
        assert started["catalogue_digest"] == digest
        (sync,) = observer.of("replica_sync_started")
        assert sync["exposure"] == "0.0.0.0:7100" and sync["peers"] == ["127.0.0.1:9"]
        assert sync["catalogue_digest"] == digest and "unauthenticated" in sync["detail"]
        routing.start()
        snapshot = routing.snapshot()
        assert snapshot.catalogue_digest == digest
        assert snapshot.core_active == {"http://127.0.0.1:9001": 0, "http://127.0.0.1:9002": 0}
        assert snapshot.replica_sync_events[("127.0.0.1:9", "applied")] == 0
    finally:
        await routing.aclose()
        fake.join_helpers()


# --- the watch of the peers' sync streams --------------------------------------------------


def sync_message(worker_id: object, data: object = "Free") -> list[bytes]:
    """One message as Dynamo 1.6.1 publishes it (docs/routing.md, 'Replicas across nodes')."""
    event = {
        "request_id": "pylon-x-1",
        "worker": {"worker_id": worker_id, "dp_rank": 0},
        "data": data,
        "router_id": 12345,
        "lora_name": None,
    }
    body = {"model_name": "default", "routing_group": "default", "block_size": 16, "event": event}
    return [TOPIC, msgspec.msgpack.encode(body)]


def test_a_sync_message_names_its_worker_or_is_malformed() -> None:
    add = {"AddRequest": {"token_sequence": [1, 2], "track_prefill_tokens": True}}
    assert event_worker(sync_message(7, add)) == 7
    assert event_worker(sync_message((1 << 64) - 1)) == (1 << 64) - 1
    for frames in (
        [TOPIC],
        [b"other.topic", sync_message(7)[1]],
        [TOPIC, b"\xc1"],  # not msgpack
        [TOPIC, msgspec.msgpack.encode([1, 2])],  # not a map
        sync_message("7"),
        sync_message(True),
        sync_message(-1),
        [TOPIC, msgspec.msgpack.encode({"event": {"worker": None}})],
        [*sync_message(7), b"third frame"],
    ):
        assert event_worker(frames) is None, frames


@pytest.fixture
async def publisher() -> AsyncIterator[Any]:
    zmq = pytest.importorskip("zmq")
    context = zmq.Context()
    pub = context.socket(zmq.XPUB)  # XPUB: the subscription arriving says the SUB joined
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    yield pub
    pub.close(0)
    context.term()


async def test_the_watch_counts_each_peers_events_and_warns_at_a_bounded_rate(
    publisher: Any,
) -> None:
    import zmq

    endpoint = publisher.getsockopt_string(zmq.LAST_ENDPOINT)
    observer = EventObserver()
    watch = ReplicaSyncWatch({"peer-b:7100": endpoint}, [7, 8], "d1g3st", observer)
    watch.start()
    try:
        await asyncio.wait_for(asyncio.to_thread(publisher.recv), 10)  # subscribed
        for _ in range(5):
            publisher.send_multipart(sync_message(7))
        for _ in range(300):
            publisher.send_multipart(sync_message(99))  # a worker this pylon does not know
        publisher.send_multipart([TOPIC, b"\xc1"])
        publisher.send_multipart(sync_message(8))
        expected = {
            ("peer-b:7100", "applied"): 6,
            ("peer-b:7100", "unknown_worker"): 300,
            ("peer-b:7100", "malformed"): 1,
        }
        await LoopLag().until(lambda: watch.counts == expected, timeout=10)
        warning = await observer.wait_for("replica_sync_dropped", worker="99")
        assert warning["endpoint"] == "peer-b:7100" and warning["digest"] == "d1g3st"
        assert len(observer.of("replica_sync_dropped")) == 1  # 300 drops, one line so far
    finally:
        await watch.aclose()


@given(st.lists(st.binary(max_size=64), max_size=3), st.binary(max_size=64))
def test_any_bytes_are_a_worker_id_or_malformed_never_an_error(
    frames: list[bytes], body: bytes
) -> None:
    for candidate in (frames, [TOPIC, body]):
        worker_id = event_worker(candidate)
        assert worker_id is None or (isinstance(worker_id, int) and worker_id >= 0)


async def test_a_catalogue_reload_changes_which_workers_the_watch_counts_as_known() -> None:
    """A worker added by a reload is applied from then on; one removed becomes unknown (the
    core drops its peers' events too), and the warnings name the new digest."""
    observer = EventObserver()
    watch = ReplicaSyncWatch({"peer-b:7100": "tcp://127.0.0.1:1"}, [7], "before", observer)
    watch.heard("peer-b:7100", sync_message(7))
    watch.heard("peer-b:7100", sync_message(99))
    watch.catalogue_changed([99], "after")
    watch.heard("peer-b:7100", sync_message(99))
    watch.heard("peer-b:7100", sync_message(7))
    assert watch.counts[("peer-b:7100", "applied")] == 2
    assert watch.counts[("peer-b:7100", "unknown_worker")] == 2
    warnings = await observer.wait_for("replica_sync_dropped", worker="7")
    assert warnings["digest"] == "after"
    await watch.aclose()

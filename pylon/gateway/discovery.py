"""Discovery of the gateway set: `WatchStargates` on each seed, following `watch_stargate_urls`
transitively (bounded), publishing the set of gateways to register with.

The set is published once every watched URL has answered, or `publish_after` seconds after the
start when at least one gateway is known (a dead redundant seed cannot block registration).
After the first publication every change is published at once. A watch stream that fails keeps
its last answer and reconnects after `retry` seconds. Insecure (plaintext) gRPC channels.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from pylon.gateway import stargate_pb2 as pb
from pylon.gateway import stargate_pb2_grpc as pb_grpc
from pylon.observe import Observer

# Control-plane messages are small; anything larger is a misbehaving peer.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    """One gateway to register with: its key (the authority, `advertise_addr`) and where to dial."""

    key: str
    dial: str


@dataclass(frozen=True, slots=True)
class DiscoveryOptions:
    seeds: tuple[str, ...]
    tls: ControlPlaneTls | None = None  # None: plaintext gRPC
    connect_timeout: float = 5.0
    retry: float = 1.0  # seconds before a failed watch stream reopens
    publish_after: float = 5.0
    max_watched: int = 64
    max_gateways: int = 64


def normalise_address(url: str) -> str:
    """HOST:PORT of a watch URL or address (a scheme and a trailing slash dropped)."""
    for scheme in ("grpc://", "grpcs://", "http://", "https://"):
        if url.startswith(scheme):
            url = url[len(scheme) :]
            break
    return url.rstrip("/")


@dataclass(frozen=True, slots=True)
class ControlPlaneTls:
    """gRPC over TLS to the gateway: its certificate verified against `ca` (a PEM bundle,
    re-read at every channel open, so a rotated bundle is used at the next), or against the
    system's roots when `ca` is None."""

    ca: Path | None = None


def open_channel(
    target: str, tls: ControlPlaneTls | None, authority: str | None
) -> grpc.aio.Channel:
    """A channel to `target` (plaintext, or TLS verifying the gateway); `authority` is the
    HTTP/2 authority and, with TLS, the name the certificate must carry (the gateway's advertise
    address when dialled through a load balancer). `OSError` when the CA cannot be read."""
    options = channel_options(authority)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    roots = tls.ca.read_bytes() if tls.ca is not None else None
    if authority is not None:
        options.append(("grpc.ssl_target_name_override", authority.rpartition(":")[0]))
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc.aio.secure_channel(target, credentials, options=options)


def channel_options(authority: str | None) -> list[tuple[str, Any]]:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
    ]
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    return options


Publish = Callable[[Mapping[str, GatewayAddress]], None]


class _NoChannel(Exception):
    """No channel could be opened (its reason is already set)."""


class Discovery:
    """Watches the seeds and what they name; calls `publish(gateways)` with each new set."""

    def __init__(self, options: DiscoveryOptions, publish: Publish, observer: Observer) -> None:
        self._options = options
        self._publish = publish
        self._observer = observer
        self._seeds = tuple(dict.fromkeys(normalise_address(s) for s in options.seeds))
        self._answers: dict[str, pb.WatchStargatesResponse] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._published: dict[str, GatewayAddress] | None = None
        self._deadline_passed = False
        self._timer: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def watched(self) -> list[str]:
        return list(self._watches)

    async def start(self) -> None:
        self._timer = asyncio.create_task(self._publish_deadline(), name="gateway-discovery-5s")
        self._update()

    async def close(self, timeout: float = 2.0) -> None:
        self._closed = True
        tasks = [*self._watches.values()]
        if self._timer is not None:
            tasks.append(self._timer)
        self._watches.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    async def _publish_deadline(self) -> None:
        await asyncio.sleep(self._options.publish_after)
        self._deadline_passed = True
        self._update()

    # -- the topology ----------------------------------------------------------------------

    def _reachable(self) -> list[str]:
        """The watch URLs reachable from the seeds through answers, breadth first, capped."""
        order: list[str] = []
        seen: set[str] = set()
        queue = list(self._seeds)
        while queue and len(order) < self._options.max_watched:
            url = queue.pop(0)
            if url in seen or not url:
                continue
            seen.add(url)
            order.append(url)
            answer = self._answers.get(url)
            if answer is not None:
                queue.extend(normalise_address(u) for u in answer.watch_stargate_urls)
        return order

    def _update(self) -> None:
        if self._closed:
            return
        reachable = self._reachable()
        for url in [u for u in self._watches if u not in reachable]:
            self._watches.pop(url).cancel()
            self._answers.pop(url, None)
            self._observer.process_event("gateway_watch_retired", url=url)
        for url in reachable:
            if url not in self._watches:
                self._watches[url] = asyncio.create_task(self._watch(url), name=f"watch {url}")
        gateways: dict[str, GatewayAddress] = {}
        for url in reachable:
            answer = self._answers.get(url)
            if answer is None:
                continue
            for info in answer.stargates:
                key = info.advertise_addr
                if not key or key in gateways:
                    continue
                if len(gateways) >= self._options.max_gateways:
                    break
                gateways[key] = GatewayAddress(key, info.grpc_pylon_dial_addr or key)
        if self._published is None:
            everyone = all(url in self._answers for url in reachable)
            if not everyone and not (self._deadline_passed and gateways):
                return
        if gateways != self._published:
            self._published = gateways
            self._publish(dict(gateways))

    # -- one watch stream ------------------------------------------------------------------

    async def _watch(self, url: str) -> None:
        while True:
            reason = "ended"
            try:
                channel = open_channel(url, self._options.tls, None)
            except OSError as exc:  # the CA bundle went unreadable: said, and retried
                channel = None
                reason = f"ca unreadable: {exc}"
            try:
                if channel is None:
                    raise _NoChannel

                async with asyncio.timeout(self._options.connect_timeout):
                    await channel.channel_ready()
                stub = pb_grpc.StargateControlPlaneStub(channel)
                call = stub.WatchStargates(pb.WatchStargatesRequest())
                async for answer in call:
                    self._answers[url] = answer
                    self._observer.process_event(
                        "gateway_watch_answer",
                        url=url,
                        gateways=len(answer.stargates),
                        watch_urls=len(answer.watch_stargate_urls),
                    )
                    self._update()
            except _NoChannel:
                pass
            except TimeoutError:
                reason = "connect timeout"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            finally:
                if channel is not None:
                    with contextlib.suppress(Exception):
                        await channel.close(grace=None)
            self._observer.process_event(
                "gateway_watch_lost", url=url, reason=reason, retry_in=self._options.retry
            )
            await asyncio.sleep(self._options.retry)

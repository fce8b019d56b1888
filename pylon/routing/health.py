"""Active health checks per worker: out of rotation after N failures in a row, back after M passes.

Every `interval` seconds, one round: each `url=` worker gets one `GET <url><path>` (pylon's own
bounded probe, `pylon.upstream.probe.fetch`: never a pool connection, never queued behind
tunnel traffic), all at once, each within `timeout`. `instance-id=` workers share one probe of
the Dynamo frontend: a 2xx that lists `instances` (Dynamo's `/health` does, with each
`instance_id`) passes exactly the listed instances; a 2xx without that list passes them all.

Per worker (`pylon.routing.fleet.Worker`): a 2xx passes, anything else (a status, no connection,
a timeout) fails. A worker starts out of rotation and enters it with its first pass (so the
first round at start decides); afterwards `eject_after` consecutive failures eject it and
`readmit_after` consecutive passes bring it back. Passive health (`pylon.routing.outlier`,
`pylon.routing.passive`) ejects workers from the same rotation by their real answers: a worker
is in rotation while both let it. Routers only choose workers in rotation; a request when none
is in rotation gets 503 `no_worker` (retryable) without touching any engine.

Reported to the `Observer` as process events (their published names): `worker_admitted` (a
worker enters rotation the first time),
`worker_ejected` (warning: `worker`, `failures`, `detail`), `worker_readmitted` (`worker`,
`passes`), and `worker_health_probe` (debug: one failed check).

The workers checked are the fleet's at each round: a worker added by a catalogue reload
(`Fleet.replace`) is checked at once (the reload wakes the loop) and enters rotation with its
first pass, exactly as at start; a check of a removed worker that was in flight is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from pylon.routing.fleet import CatalogueChange, Fleet, Worker
from pylon.upstream.probe import Fetch, FetchError, fetch

if TYPE_CHECKING:
    from pylon.observe import Observer

MAX_HEALTH_BODY = 1024 * 1024  # a Dynamo frontend's /health lists every instance
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class HealthCheckOptions:
    """How each worker is checked, and when it leaves and rejoins the rotation."""

    path: str
    """The path each check asks with `GET` (`--worker-health-path`)."""
    interval: float
    """Seconds between rounds of checks (`--worker-health-interval`)."""
    timeout: float
    """Seconds one check may take (`--worker-health-timeout`)."""
    eject_after: int
    """Failed checks in a row that eject a worker in rotation (`--worker-eject-after`)."""
    readmit_after: int
    """Passed checks in a row that bring an ejected worker back (`--worker-readmit-after`)."""


def listed_instances(body: bytes) -> frozenset[int] | None:
    """The instance ids a Dynamo frontend's `/health` lists (`instances[].instance_id`), or
    None when the body has no such list (then the frontend's status speaks for all)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("instances"), list):
        return None
    ids = set()
    for instance in data["instances"]:
        if not isinstance(instance, dict):
            continue
        endpoint = instance.get("endpoint")
        wid = instance.get("instance_id")
        if endpoint not in (None, "generate"):
            continue  # a frontend lists other endpoints' instances too
        if isinstance(wid, int) and not isinstance(wid, bool) and 0 <= wid < 1 << 64:
            ids.add(wid)
    return frozenset(ids)


class HealthChecker:
    """The health loop over one fleet (see the module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        options: HealthCheckOptions,
        *,
        observer: Observer,
        fetch: Fetch = fetch,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._fleet = fleet
        self._path = options.path
        self._interval = options.interval
        self._timeout = options.timeout
        self._eject_after = options.eject_after
        self._readmit_after = options.readmit_after
        self._observer = observer
        self._fetch = fetch
        self._sleep = sleep
        self._first_round = asyncio.Event()
        self._wake = asyncio.Event()
        self.rounds = 0
        fleet.on_catalogue(self._catalogue_changed)

    def _catalogue_changed(self, change: CatalogueChange) -> None:
        if change.added:
            self._wake.set()  # check the new workers now, not an interval later

    @property
    def fleet(self) -> Fleet:
        return self._fleet

    @property
    def path(self) -> str:
        return self._path

    async def first_round(self) -> None:
        """Wait until the first round of checks has been applied."""
        await self._first_round.wait()

    async def run(self) -> None:
        """Rounds every `interval` seconds, the first at once, until cancelled."""
        while True:
            await self.check_once()
            await self._pause()

    async def _pause(self) -> None:
        """`interval` seconds, or less when a catalogue change added workers meanwhile."""
        if self._wake.is_set():
            self._wake.clear()
            return
        sleep = asyncio.ensure_future(self._sleep(self._interval))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((sleep, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleep.cancel()
            woken.cancel()
        self._wake.clear()

    async def check_once(self) -> None:
        """One round: every worker probed (concurrently), then every result applied."""
        self.rounds += 1
        workers = self._fleet.workers
        probes: list[Awaitable[None]] = [
            self._check_url(w) for w in workers if w.spec.url is not None
        ]
        pinned = tuple(w for w in workers if w.spec.instance_id is not None)
        if pinned:
            probes.append(self._check_pinned(pinned))
        await asyncio.gather(*probes)
        self._first_round.set()

    async def _check_url(self, worker: Worker) -> None:
        try:
            reply = await self._fetch(
                worker.upstream, self._path, timeout=self._timeout, max_body=MAX_HEALTH_BODY
            )
        except FetchError as exc:
            self.apply(worker, False, exc.detail)
            return
        ok = 200 <= reply.status < 300
        self.apply(worker, ok, "ok" if ok else f"status {reply.status}")

    async def _check_pinned(self, pinned: tuple[Worker, ...]) -> None:
        frontend = pinned[0].upstream
        try:
            reply = await self._fetch(
                frontend, self._path, timeout=self._timeout, max_body=MAX_HEALTH_BODY
            )
        except FetchError as exc:
            for worker in pinned:
                self.apply(worker, False, f"frontend: {exc.detail}")
            return
        if not 200 <= reply.status < 300:
            for worker in pinned:
                self.apply(worker, False, f"frontend: status {reply.status}")
            return
        listed = listed_instances(reply.body)
        for worker in pinned:
            if listed is None or worker.spec.instance_id in listed:
                self.apply(worker, True, "ok")
            else:
                self.apply(worker, False, f"not listed in the frontend's {self._path} instances")

    def apply(self, worker: Worker, ok: bool, result: str) -> None:
        """One check's result: count it, and eject or (re-)admit the worker when due."""
        if worker.removed:
            return  # it left the catalogue while the check was in flight
        worker.last_result = result
        fleet = self._fleet
        if ok:
            worker.failures = 0
            worker.passes += 1
            if worker.checks_pass:
                return
            if not worker.ever_in_rotation:
                fleet.set_in_rotation(worker, True)
                self._observer.process_event(
                    "worker_admitted", worker=worker.label, path=self._path
                )
            elif worker.passes >= self._readmit_after:
                fleet.set_in_rotation(worker, True)
                self._observer.process_event(
                    "worker_readmitted", worker=worker.label, passes=worker.passes
                )
            return
        worker.passes = 0
        worker.failures += 1
        self._observer.process_event(
            "worker_health_probe", worker=worker.label, path=self._path, result=result
        )
        if worker.checks_pass and worker.failures >= self._eject_after:
            fleet.set_in_rotation(worker, False)
            self._observer.process_event(
                "worker_ejected",
                worker=worker.label,
                failures=worker.failures,
                detail=f"{worker.failures} health checks failed in a row; last: {result}",
                active=worker.active,
            )

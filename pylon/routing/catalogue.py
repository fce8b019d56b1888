"""The worker catalogue while pylon serves: `--workers-file PATH`, watched and re-read on SIGHUP.

A workers file is TOML holding only `[[worker]]` tables, with the keys of `--worker` (and of the
`[[worker]]` tables of `--config`: `pylon.routing.spec.worker_from_table`). It is the catalogue
for as long as pylon runs: the deployment that restarts engines (and, for Dynamo, learns their
new instance ids) rewrites it, pylon notices (`CatalogueWatch.run` reads it every `interval`
seconds; the content's hash decides, so a rewrite with the same bytes is no change and a change
within one mtime tick is not missed) and applies it with `Fleet.replace`.

A file that cannot be read or parsed, is empty, or breaks a rule the start would refuse
(`check_catalogue`: more than `MAX_WORKERS` workers, a URL or worker id twice, an `instance-id=`
worker without a Dynamo frontend, a `kv` worker without `kv-events=`) changes nothing: the
catalogue in use stays, and one `reload_failed` line names the file and the reason (once per
content; SIGHUP says it again). Never an empty fleet because of a typo.

`read_workers_file` and `check_catalogue` are pure but for the one read; the watch applies and
reports (`workers_reloaded`: added, removed, kept, the new `catalogue_digest`).

`--discover-instances` (`InstanceDiscovery`) takes the catalogue from a Dynamo 1.6.1 frontend
instead: every `generate` instance its `/health` lists is an `instance-id=` worker. The
frontend does not say where an instance publishes its KV events, so discovery serves the modes
that need none (round-robin, least-loaded); for `kv` the deployment writes a workers file
(docs/routing.md says how).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pylon.core.upstream import Upstream
from pylon.routing.fleet import CatalogueChange, Fleet
from pylon.routing.health import MAX_HEALTH_BODY, listed_instances
from pylon.routing.spec import MAX_WORKERS, WorkerSpec, WorkerSpecError, worker_from_table
from pylon.upstream.probe import Fetch, FetchError, fetch

if TYPE_CHECKING:
    from pylon.observe import Observer

# A workers file larger than this is refused unread (a thousand workers take ~200 KiB).
MAX_WORKERS_FILE_BYTES: Final = 1024 * 1024


class CatalogueError(ValueError):
    """A catalogue cannot be used; the message is one line naming where it came from."""


@dataclass(frozen=True, slots=True)
class CatalogueRules:
    """What every catalogue of this pylon must satisfy (what `Settings` checks at start)."""

    mode: str
    """The routing mode (`kv` needs every worker's `kv-events=`)."""
    instance_ids: bool
    """`instance-id=` workers are possible: `--backend dynamo` with an `--upstream` frontend."""


@dataclass(frozen=True, slots=True)
class WorkersFileOptions:
    """`--workers-file` and how often it is read (`--workers-file-interval`)."""

    path: Path
    interval: float
    rules: CatalogueRules


def check_catalogue(specs: Sequence[WorkerSpec], rules: CatalogueRules, where: str) -> None:
    """Refuse a catalogue that pylon could not route by (`CatalogueError`, naming `where`)."""
    if not specs:
        raise CatalogueError(f"{where}: no [[worker]] table (pylon keeps at least one worker)")
    if len(specs) > MAX_WORKERS:
        raise CatalogueError(f"{where}: {len(specs)} workers, at most {MAX_WORKERS}")
    ids: set[int] = set()
    urls: set[str] = set()
    for spec in specs:
        if spec.url is not None:
            if spec.url in urls:
                raise CatalogueError(f"{where}: worker url={spec.url} is given twice")
            urls.add(spec.url)
        elif not rules.instance_ids:
            raise CatalogueError(
                f"{where}: worker {spec.label} needs --backend dynamo and --upstream (the "
                "Dynamo frontend in front of the instance)"
            )
        if spec.worker_id in ids:
            raise CatalogueError(
                f"{where}: worker {spec.label}: worker id {spec.worker_id} is given twice"
            )
        ids.add(spec.worker_id)
        if rules.mode == "kv" and not spec.kv_events:
            raise CatalogueError(
                f"{where}: --routing kv: worker {spec.label} has no kv-events= endpoint"
            )


def parse_workers_file(data: bytes, where: str) -> tuple[WorkerSpec, ...]:
    """A workers file's bytes -> its specs (in file order); `CatalogueError` naming `where`."""
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CatalogueError(f"{where}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogueError(f"{where}: not valid TOML: {' '.join(str(exc).split())}") from None
    unknown = sorted(key for key in document if key != "worker")
    if unknown:
        raise CatalogueError(
            f"{where}: only [[worker]] tables belong in a workers file, not {unknown[0]!r}"
        )
    tables = document.get("worker", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise CatalogueError(f"{where}: worker must be [[worker]] tables")
    try:
        return tuple(worker_from_table(table) for table in tables)
    except WorkerSpecError as exc:
        raise CatalogueError(f"{where}: {exc}") from None


def read_workers_file(path: Path) -> bytes:
    """The file's bytes (bounded); `CatalogueError` naming it."""
    where = f"--workers-file {path}"
    try:
        with path.open("rb") as file:
            data = file.read(MAX_WORKERS_FILE_BYTES + 1)
    except FileNotFoundError:
        raise CatalogueError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise CatalogueError(f"{where}: is a directory, not a file") from None
    except OSError as exc:
        raise CatalogueError(f"{where}: cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_WORKERS_FILE_BYTES:
        raise CatalogueError(f"{where}: larger than {MAX_WORKERS_FILE_BYTES} bytes")
    return data


def load_workers_file(path: Path, rules: CatalogueRules) -> tuple[WorkerSpec, ...]:
    """Read, parse and check the file (at start: its failure refuses the start)."""
    where = f"--workers-file {path}"
    specs = parse_workers_file(read_workers_file(path), where)
    check_catalogue(specs, rules, where)
    return specs


@dataclass(frozen=True, slots=True)
class Reload:
    """One look at the workers file: the change applied (None when the content was the
    catalogue in use already), or why nothing changed (`failed`)."""

    change: CatalogueChange | None = None
    failed: str | None = None


Sleep = Callable[[float], Awaitable[None]]


class CatalogueWatch:
    """The workers file applied to a fleet: read every `interval` seconds and on `reload()`."""

    def __init__(
        self,
        fleet: Fleet,
        options: WorkersFileOptions,
        observer: Observer,
        *,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._fleet = fleet
        self._options = options
        self._observer = observer
        self._sleep = sleep
        self._seen: str | None = None  # the hash of the content last looked at
        self._last_failure: str | None = None  # said once, until another or a success
        self.reloads = 0  # changes applied
        self.failures = 0  # refusals reported (a broken file once, then at every SIGHUP)

    @property
    def path(self) -> Path:
        return self._options.path

    @property
    def source(self) -> str:
        return f"file {self._options.path}"

    @property
    def digest(self) -> str:
        """The catalogue in use's `catalogue_digest`."""
        return self._fleet.digest

    def prime(self, data: bytes) -> None:
        """The content the fleet was built from (at start): not a change."""
        self._seen = hashlib.sha256(data).hexdigest()

    async def run(self) -> None:
        """Look at the file every `interval` seconds until cancelled; report what changed."""
        while True:
            await self._sleep(self._options.interval)
            self.look(trigger="watch", force=False)

    def reload(self) -> Reload:
        """SIGHUP: read the file now and apply it (the caller writes the one line)."""
        return self.look(trigger="signal", force=True)

    def look(self, *, trigger: str, force: bool) -> Reload:
        """Read the file; apply it when its content changed (or `force`). A watch's failure is
        reported here (`reload_failed`, once per content); a signal's by the caller's line."""
        where = f"--workers-file {self._options.path}"
        try:
            data = read_workers_file(self._options.path)
        except CatalogueError as exc:
            return self._refused(str(exc), None, trigger)
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._seen and not force:
            return Reload()
        try:
            specs = parse_workers_file(data, where)
            check_catalogue(specs, self._options.rules, where)
        except CatalogueError as exc:
            return self._refused(str(exc), digest, trigger)
        self._seen = digest
        self._last_failure = None
        change = self._fleet.replace(specs)
        if not change.changed:
            return Reload()
        self.reloads += 1
        self._observer.process_event(
            "workers_reloaded", source=str(self._options.path), trigger=trigger, **change.fields()
        )
        return Reload(change)

    def _refused(self, reason: str, digest: str | None, trigger: str) -> Reload:
        if digest is not None:
            self._seen = digest  # not parsed again until it changes
        repeat = reason == self._last_failure and trigger == "watch"
        self._last_failure = reason
        if repeat:
            return Reload(failed=reason)  # said already: not again at every read
        self.failures += 1
        if trigger == "watch":
            self._observer.process_event(
                "reload_failed",
                signal=None,
                reloaded=[],
                failed={"workers": reason},
                detail="kept the worker catalogue in use",
            )
        return Reload(failed=reason)


# --- Dynamo instances, from the frontend ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DiscoveryOptions:
    """`--discover-instances`: the Dynamo frontend whose `/health` lists the instances."""

    frontend: Upstream
    path: str  # the frontend's instance list (`--worker-health-path`, Dynamo's `/health`)
    interval: float  # seconds between two reads (`--workers-file-interval`)
    timeout: float  # seconds one read may take (`--worker-health-timeout`)


def discovered_specs(body: bytes) -> tuple[WorkerSpec, ...] | None:
    """The `instance-id=` workers a Dynamo frontend's `/health` lists (its `generate`
    instances, in id order), or None when the body lists none that way."""
    ids = listed_instances(body)
    if ids is None:
        return None
    return tuple(WorkerSpec(instance_id=wid) for wid in sorted(ids))


class InstanceDiscovery:
    """`--discover-instances`: the catalogue is the frontend's `generate` instances, read every
    `interval` seconds and at once on `wake()` (SIGHUP). A read that fails, or lists no
    instance, keeps the catalogue in use (one `reload_failed` line per reason)."""

    def __init__(
        self,
        fleet: Fleet,
        options: DiscoveryOptions,
        observer: Observer,
        *,
        fetch: Fetch = fetch,
    ) -> None:
        self._fleet = fleet
        self._options = options
        self._observer = observer
        self._fetch = fetch
        self._wake = asyncio.Event()
        self._last_failure: str | None = None
        self.reloads = 0
        self.failures = 0

    @property
    def source(self) -> str:
        return f"discovery http://{self._options.frontend.label}{self._options.path}"

    @property
    def digest(self) -> str:
        return self._fleet.digest

    def wake(self) -> None:
        """Read the frontend's instances now (SIGHUP)."""
        self._wake.set()

    async def run(self) -> None:
        """Read at once, then every `interval` seconds (or when woken) until cancelled."""
        while True:
            self._wake.clear()
            await self.look("watch")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._options.interval):
                    await self._wake.wait()

    async def look(self, trigger: str) -> Reload:
        options = self._options
        where = f"--discover-instances http://{options.frontend.label}{options.path}"
        try:
            reply = await self._fetch(
                options.frontend, options.path, timeout=options.timeout, max_body=MAX_HEALTH_BODY
            )
        except FetchError as exc:
            return self._refused(f"{where}: {exc.detail}")
        if not 200 <= reply.status < 300:
            return self._refused(f"{where}: status {reply.status}")
        specs = discovered_specs(reply.body)
        if not specs:
            return self._refused(f"{where}: lists no generate instance")
        if len(specs) > MAX_WORKERS:
            return self._refused(f"{where}: {len(specs)} instances, at most {MAX_WORKERS}")
        self._last_failure = None
        change = self._fleet.replace(specs)
        if not change.changed:
            return Reload()
        self.reloads += 1
        self._observer.process_event(
            "workers_reloaded", source=self.source, trigger=trigger, **change.fields()
        )
        return Reload(change)

    def _refused(self, reason: str) -> Reload:
        if reason != self._last_failure:
            self.failures += 1
            self._last_failure = reason
            self._observer.process_event(
                "reload_failed",
                signal=None,
                reloaded=[],
                failed={"workers": reason},
                detail="kept the worker catalogue in use",
            )
        return Reload(failed=reason)

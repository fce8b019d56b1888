"""The router process's admin (role "router"): on its Unix socket in the supervisor's private
runtime directory, for the node's admin listener (`pylon.supervisor.admin`), as a serving
process's own admin is.

- `GET /live`: 200 while it runs.
- `GET /ready`: 200 once the booking authority listens; else 503.
- `GET /metrics`: the routing families of the node's real bookings (the authority's fleet: each
  worker's bookings from every process, its health, passive ejections, decisions, for `kv` the
  selection core's load view and select latencies, the catalogue reloads) and the process
  collector's. The node's scrape labels them `process="router"`.
- `GET /workers`: the authority's catalogue and each worker's state (`Routing.workers_report`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from pylon.metrics.exposition import routing_families

if TYPE_CHECKING:
    from pylon.routing.authority import BookingAuthority

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class RouterAdmin:
    """The router's /live, /ready, /metrics and /workers; `authority` is set once it listens."""

    def __init__(self) -> None:
        self.authority: BookingAuthority | None = None
        self._runner: web.AppRunner | None = None
        self._registry = CollectorRegistry(auto_describe=True)
        self._registry.register(_Collector(self))
        ProcessCollector(namespace="pylon", registry=self._registry)

    async def start(self, path: str) -> None:
        app = web.Application(client_max_size=1024)
        app.router.add_get("/live", self.live)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/workers", self.workers)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.UnixSite(runner, path).start()
        self._runner = runner

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def live(self, _request: web.Request) -> web.Response:
        return _json(200, {"live": True})

    async def ready(self, _request: web.Request) -> web.Response:
        if self.authority is None:
            return _json(503, {"ready": False, "reason": "starting"})
        return _json(200, {"ready": True, "clients": self.authority.clients})

    async def metrics(self, _request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self._registry))
        response.headers["content-type"] = TEXT_FORMAT
        return response

    async def workers(self, _request: web.Request) -> web.Response:
        if self.authority is None:
            return _json(503, {"ready": False, "reason": "starting"})
        return _json(200, self.authority.routing.workers_report())


class _Collector:
    def __init__(self, admin: RouterAdmin) -> None:
        self._admin = admin

    def collect(self) -> Iterator[Metric]:
        authority = self._admin.authority
        return routing_families(authority.routing.snapshot() if authority is not None else None)


def _json(status: int, body: object) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")

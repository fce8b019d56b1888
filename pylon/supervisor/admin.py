"""The supervisor's admin listener (`--admin-listen`): the whole node in one place.

- `GET /live`: 200 while the supervisor runs.
- `GET /ready`: 200 only when every serving process runs and its own `/ready` says ready; else
  503, and the JSON body names the processes that are not (`not_ready`) and why. The booking
  authority's process (`router`) is listed (`router`: its own answer) but does not make the node
  unready: while it is away each serving process books alone, and still serves.
- `GET /metrics`: every process's exposition merged (`pylon.supervisor.metrics`), each sample
  labelled `process="i"` (the booking authority's `process="router"`: the node's real bookings
  and its workers' health), then the supervisor's own families. Text format 0.0.4 only.

Each process serves its own admin (`pylon.admin`) on a Unix socket in the supervisor's private
runtime directory; every request here asks them all at once, each with a deadline
(`pylon.supervisor.scrape`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import orjson
from aiohttp import web

from pylon.settings import split_host_port
from pylon.startup import cannot_listen
from pylon.supervisor.metrics import SupervisorCounts, merge_expositions, supervisor_exposition
from pylon.supervisor.scrape import Scraped, scrape

TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ProcessView:
    """What the admin needs of one process slot, now."""

    process: int | str  # a serving process's index, or "router"
    running: bool
    admin_socket: str | None


class NodeAdmin:
    """The node's /live, /ready and /metrics, over the processes `views` returns."""

    def __init__(
        self,
        views: Callable[[], Sequence[ProcessView]],
        counts: Callable[[Sequence[bool]], SupervisorCounts],
    ) -> None:
        self._views = views
        self._counts = counts
        self._runner: web.AppRunner | None = None
        self.address = ""

    async def start(self, listen: str) -> str:
        app = web.Application(client_max_size=1024)
        app.router.add_get("/live", self.live)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        host, port = split_host_port(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            await runner.cleanup()
            raise cannot_listen("--admin-listen", listen, exc) from None
        await web.SockSite(runner, sock).start()
        self._runner = runner
        bound = sock.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        return self.address

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def live(self, _request: web.Request) -> web.Response:
        return web.Response(body=b'{"live":true}', content_type="application/json")

    async def ready(self, _request: web.Request) -> web.Response:
        views = self._views()
        answers = await asyncio.gather(*(_ask(view, "/ready") for view in views))
        entries = [_readiness(view, answer) for view, answer in zip(views, answers, strict=True)]
        processes = [e for e in entries if e["process"] != "router"]
        not_ready = [entry["process"] for entry in processes if not entry["ready"]]
        body: dict[str, object] = {
            "ready": not not_ready,
            "not_ready": not_ready,
            "processes": processes,
        }
        router = [e for e in entries if e["process"] == "router"]
        if router:
            body["router"] = router[0]
        return web.Response(
            status=503 if not_ready else 200,
            body=orjson.dumps(body),
            content_type="application/json",
        )

    async def metrics(self, _request: web.Request) -> web.Response:
        views = self._views()
        answers = await asyncio.gather(*(_ask(view, "/metrics") for view in views))
        parts = [
            (str(view.process), answer.body.decode("utf-8", "replace"))
            for view, answer in zip(views, answers, strict=True)
            if answer is not None and answer.status == 200
        ]
        scraped = [answer is not None and answer.status == 200 for answer in answers]
        text = merge_expositions(parts) + supervisor_exposition(self._counts(scraped))
        response = web.Response(body=text.encode())
        response.headers["content-type"] = TEXT_FORMAT
        return response


async def _ask(view: ProcessView, path: str) -> Scraped | None:
    if not view.running or view.admin_socket is None:
        return None
    return await scrape(view.admin_socket, path)


def _readiness(view: ProcessView, answer: Scraped | None) -> dict[str, object]:
    entry: dict[str, object] = {"process": view.process, "ready": False}
    if not view.running:
        entry["reason"] = "not_running"
    elif answer is None:
        entry["reason"] = "unreachable"
    else:
        try:
            own = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            own = {}
        entry["ready"] = answer.status == 200
        if not entry["ready"]:
            entry["reason"] = (
                own.get("reason", "not_ready") if isinstance(own, dict) else "not_ready"
            )
    return entry

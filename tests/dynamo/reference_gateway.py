"""A ~minimal stand-in for pylon's Dynamo path, used only to validate the e2e harness.

NOT pylon.  It implements just the behaviour the tests in this directory check, so the tests can
be proven meaningful independently of pylon:

* default mode: strips every ``x-dynamo-*`` header, the worker-pin aliases and ``x-tenant-id``,
  drops body ``nvext`` and top-level ``cache_salt``, and maps ``x-priority: r`` (u32, lower = more
  urgent) to ``x-dynamo-request-priority: 3600 - min(r, 3600)`` (absent -> 0), like pylon;
* ``--passthrough``: forwards everything unchanged (a negative control: tests 1-4 must FAIL).

Selected with ``DYNAMO_E2E_GATEWAY=reference`` / ``=passthrough`` (see conftest.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
from aiohttp import web

PIN_ALIASES = {
    "x-worker-instance-id",
    "x-prefill-instance-id",
    "x-dp-rank",
    "x-data-parallel-rank",
    "x-prefill-dp-rank",
    "x-tenant-id",
}
HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade"}


def build_app(upstream: str, passthrough: bool) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        if not request.headers.get("x-request-id") or not request.headers.get("x-model"):
            return web.json_response({"error": "x-request-id and x-model required"}, status=400)
        body = await request.read()
        headers: list[tuple[str, str]] = []
        for k, v in request.headers.items():
            lk = k.lower()
            if lk in HOP:
                continue
            if not passthrough and (
                lk.startswith("x-dynamo-") or lk in PIN_ALIASES or lk == "x-priority"
            ):
                continue
            headers.append((k, v))
        if not passthrough:
            if body:
                obj = json.loads(body)
                obj.pop("nvext", None)
                obj.pop("cache_salt", None)
                body = json.dumps(obj).encode()
            raw = request.headers.get("x-priority")
            prio = 0 if raw is None else 3600 - min(int(raw), 3600)
            headers.append(("x-dynamo-request-priority", str(prio)))
        async with session.request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as up:
            resp = web.StreamResponse(status=up.status)
            ct = up.headers.get("content-type")
            if ct:
                resp.content_type = ct.split(";")[0]
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
        )

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--passthrough", action="store_true")
    a = ap.parse_args()
    asyncio.set_event_loop(asyncio.new_event_loop())
    web.run_app(build_app(a.upstream, a.passthrough), host="127.0.0.1", port=a.port, print=None)


if __name__ == "__main__":
    main()

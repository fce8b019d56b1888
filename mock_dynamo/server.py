"""Embedding API: run the mock engine inside the caller's event loop."""

from __future__ import annotations

from types import TracebackType

from aiohttp import web

from mock_dynamo.app import STATE_KEY, build_app
from mock_dynamo.config import MockConfig
from mock_dynamo.state import MockState

__all__ = ["MockConfig", "MockServer", "start_mock"]

# In-flight handlers (e.g. stalled streams) get this long before stop()
# cancels them; aiohttp's 60 s default would make every test teardown slow.
_SHUTDOWN_TIMEOUT_S = 0.25


class MockServer:
    """A running mock engine. Create with `start_mock`, end with `stop`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def state(self) -> MockState:
        """Direct access to records, knobs and faults for in-process tests."""
        return self._runner.app[STATE_KEY]

    @property
    def kv_events_endpoint(self) -> str | None:
        """`tcp://127.0.0.1:PORT` of the KV-event socket, None without one."""
        events = self.state.engine.events
        return None if events is None else events.view()["endpoint"]

    @property
    def config(self) -> MockConfig:
        return self.state.config

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> MockServer:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def start_mock(
    config: MockConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> MockServer:
    """Bind and start serving; `port=0` picks a free port (see `.port`)."""
    runner = web.AppRunner(
        build_app(config or MockConfig()),
        # Cancel the handler when the client disconnects: that is how
        # `cancelled_at` is detected, even while a handler sleeps.
        handler_cancellation=True,
        # Keep request bodies as they arrived (recorded byte for byte); like
        # vLLM/SGLang's servers, the mock does not undo a Content-Encoding.
        auto_decompress=False,
        access_log=None,
        shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
    )
    try:
        # Runs the startup hooks: the KV-event socket binds here.
        await runner.setup()
    except BaseException:
        await runner.cleanup()
        raise
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = int(runner.addresses[0][1])
    return MockServer(runner, host, bound_port)

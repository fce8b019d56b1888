"""A raw HTTP/1.1 engine that answers every request with the same bytes, optionally held until the
test releases it: for responses mock_dynamo never sends, and for "the engine has the request and
has not answered yet" without a clock."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class ScriptedEngine:
    reply: bytes
    hold: bool = False
    url: str = ""
    requests: list[bytes] = field(default_factory=list)  # each request's head, as received
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait_request(self, timeout: float = 5.0) -> bytes:
        """The first request's head, once it has arrived."""
        async with asyncio.timeout(timeout):
            await self._arrived.wait()
        return self.requests[0]

    def release(self) -> None:
        """Answer the held request(s), and every later one at once."""
        self._released.set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests.append(head)
                self._arrived.set()
                if self.hold:
                    await self._released.wait()
                writer.write(self.reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def scripted_engine(reply: bytes, hold: bool = False) -> AsyncIterator[ScriptedEngine]:
    engine = ScriptedEngine(reply, hold)
    server = await asyncio.start_server(engine._handle, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield engine
    finally:
        engine.release()
        server.close()

"""A small HTTP/2 test client: the sans-IO `h2` library over an asyncio socket.

Outbound validation is off, so tests can send exactly the malformed header blocks a hostile or
buggy peer would. Responses are collected per stream; the connection's flow control is acked
automatically unless `auto_ack=False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    PingAckReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
)
from h2.settings import SettingCodes, Settings

Header = tuple[bytes, bytes]


@dataclass
class H2Response:
    status: int | None = None
    headers: list[Header] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival time, data)
    reset_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)

    def json(self) -> Any:
        return orjson.loads(bytes(self.body))


class H2Client:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        auto_ack: bool,
        window: int | None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.auto_ack = auto_ack
        self.conn = H2Connection(
            H2Configuration(
                client_side=True,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
                validate_inbound_headers=False,
            )
        )
        if window is not None:
            # Current at once (not pending an ACK), so the client's own window never shrinks.
            self.conn.local_settings = Settings(
                client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: window}
            )
        self.conn.initiate_connection()
        self.responses: dict[int, H2Response] = {}
        self.terminated: ConnectionTerminated | None = None
        self.error: Exception | None = None
        self.closed = asyncio.Event()
        self.settings_received = asyncio.Event()
        self._progress = asyncio.Event()  # set after every batch of frames read, and at close
        self._pings: dict[bytes, asyncio.Future[None]] = {}
        self._flush()
        self._task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(
        cls, address: tuple[str, int], auto_ack: bool = True, window: int | None = None
    ) -> H2Client:
        reader, writer = await asyncio.open_connection(*address)
        client = cls(reader, writer, auto_ack, window)
        async with asyncio.timeout(5):
            await client.settings_received.wait()
        return client

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    async def _read_loop(self) -> None:
        try:
            while data := await self.reader.read(65536):
                for event in self.conn.receive_data(data):
                    self._on_event(event)
                self._flush()
                self._progress.set()
        except (ConnectionError, OSError):
            pass
        except Exception as exc:
            self.error = exc
            raise
        finally:
            self.closed.set()
            for response in self.responses.values():
                response.done.set()
            for waiter in self._pings.values():
                if not waiter.done():
                    waiter.set_exception(ConnectionResetError("the connection closed"))
            self._progress.set()

    def _on_event(self, event: object) -> None:
        loop = asyncio.get_running_loop()
        if isinstance(event, ResponseReceived):
            response = self.responses[event.stream_id]
            response.headers = list(event.headers)
            response.status = int(dict(response.headers)[b":status"])
        elif isinstance(event, DataReceived):
            response = self.responses[event.stream_id]
            response.body += event.data
            response.chunks.append((loop.time(), event.data))
            if self.auto_ack:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, StreamEnded):
            self.responses[event.stream_id].done.set()
        elif isinstance(event, StreamReset):
            response = self.responses[event.stream_id]
            response.reset_code = int(event.error_code)
            response.done.set()
        elif isinstance(event, ConnectionTerminated):
            self.terminated = event
        elif isinstance(event, RemoteSettingsChanged):
            self.settings_received.set()
        elif isinstance(event, PingAckReceived):
            waiter = self._pings.pop(event.ping_data, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def wait_until(
        self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "the condition"
    ) -> None:
        """Return once `predicate()` holds, checked again after each batch of frames from the
        server and at the connection's close, never on a clock."""
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._progress.clear()
                    await self._progress.wait()
        except TimeoutError:
            raise AssertionError(f"{what} did not happen within {timeout:g} s") from None

    async def ping(self, timeout: float = 5.0) -> None:
        """A PING round trip: every frame the server wrote before its ACK has been read."""
        data = os.urandom(8)
        waiter = asyncio.get_running_loop().create_future()
        self._pings[data] = waiter
        self.conn.ping(data)
        self._flush()
        async with asyncio.timeout(timeout):
            await waiter

    def send(self, headers: list[Header], body: bytes | None = None, end: bool = True) -> int:
        """Open a stream with exactly these header fields (no validation, no reordering)."""
        stream_id = self.conn.get_next_available_stream_id()
        self.responses[stream_id] = H2Response()
        self.conn.send_headers(stream_id, headers, end_stream=end and body is None)
        if body is not None:
            self._send_frames(stream_id, body, end)
        self._flush()
        return stream_id

    def send_data(self, stream_id: int, data: bytes, end: bool = False) -> None:
        self._send_frames(stream_id, data, end)
        self._flush()

    def _send_frames(self, stream_id: int, data: bytes, end: bool) -> None:
        """DATA in frames no larger than the peer accepts (the window is the caller's care)."""
        size = self.conn.max_outbound_frame_size
        pieces = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
        for index, piece in enumerate(pieces):
            self.conn.send_data(stream_id, piece, end_stream=end and index == len(pieces) - 1)

    def reset(self, stream_id: int, code: int = 8) -> None:
        self.conn.reset_stream(stream_id, code)
        self._flush()

    def open_window(self, stream_id: int, size: int) -> None:
        """Manual flow control: let the server send `size` more bytes on this stream."""
        self.conn.increment_flow_control_window(size, stream_id)
        self.conn.increment_flow_control_window(size)
        self._flush()

    async def response(self, stream_id: int, timeout: float = 5.0) -> H2Response:
        response = self.responses[stream_id]
        async with asyncio.timeout(timeout):
            await response.done.wait()
        return response

    def ignore_stream_limit(self) -> None:
        """Behave like a client that disregards the server's MAX_CONCURRENT_STREAMS."""
        values = {SettingCodes(code): value for code, value in self.conn.remote_settings.items()}
        values[SettingCodes.MAX_CONCURRENT_STREAMS] = 2**31 - 1
        self.conn.remote_settings = Settings(client=False, initial_values=values)

    def remote_setting(self, code: SettingCodes) -> int | None:
        value = self.conn.remote_settings.get(code)
        return int(value) if value is not None else None

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        self.writer.close()


def request_headers(
    path: str = "/v1/chat/completions",
    method: str = "POST",
    request_id: str = "h2-1",
    model: str = "mock-model",
    extra: list[tuple[str, str]] | None = None,
) -> list[Header]:
    fields = [
        (b":method", method.encode()),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", b"127.0.0.1"),
        (b"x-request-id", request_id.encode()),
        (b"x-model", model.encode()),
        (b"content-type", b"application/json"),
    ]
    fields += [(name.encode(), value.encode()) for name, value in extra or []]
    return fields

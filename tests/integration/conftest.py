"""Integration helpers: raw sockets for malformed input, and record inspection."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.stack import FLAVOR, MODEL, Stack, StackFactory

__all__ = [
    "FLAVOR",
    "MODEL",
    "Stack",
    "StackFactory",
    "header_values",
    "raw_exchange",
    "read_request",
]


async def raw_exchange(host: str, port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout): for malformed input."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        chunks = []
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 request with a Content-Length body (for the tests' tiny scripted engines)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    return head + await reader.readexactly(length)


def header_values(record: dict[str, Any], name: str) -> list[str]:
    return [value for key, value in record["headers"] if key.lower() == name.lower()]

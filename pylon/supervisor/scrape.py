"""Asking one supervised process's admin (on its Unix socket) for a path: one bounded HTTP/1.1
request, with a deadline, on a connection of its own."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

SCRAPE_TIMEOUT = 2.0  # seconds: a process that does not answer by then counts as unreachable
MAX_ANSWER_BYTES = 32 * 1024 * 1024  # a /metrics answer larger than this is refused


@dataclass(frozen=True)
class Scraped:
    status: int
    body: bytes


async def scrape(socket_path: str, path: str, timeout: float = SCRAPE_TIMEOUT) -> Scraped | None:
    """GET `path` from the admin listening on `socket_path`; None when it does not answer in
    time, or not in HTTP."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(socket_path, limit=64 * 1024)
            try:
                writer.write(
                    f"GET {path} HTTP/1.1\r\nhost: pylon\r\naccept: text/plain\r\n"
                    "connection: close\r\n\r\n".encode("ascii")
                )
                data = bytearray()
                while len(data) <= MAX_ANSWER_BYTES:
                    chunk = await reader.read(256 * 1024)
                    if not chunk:
                        break
                    data += chunk
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return None
    return _parse(bytes(data)) if len(data) <= MAX_ANSWER_BYTES else None


def _parse(data: bytes) -> Scraped | None:
    head, sep, body = data.partition(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if not sep or len(parts) < 2 or not parts[1].isdigit():
        return None
    return Scraped(int(parts[1]), body)

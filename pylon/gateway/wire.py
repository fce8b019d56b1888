"""The reverse tunnel's Cap'n Proto messages (`tunnel.capnp`), as typed values and bytes.

pycapnp builds and reads the messages from pylon's own schema file; this module is the only one
that touches it, so the rest of pylon sees frozen dataclasses. On a QUIC stream the messages use
Cap'n Proto's standard stream framing (a segment table, then the segments); `FrameReader` cuts a
stream's bytes into whole messages, bounded (a peer announcing a huge message is refused before
anything is buffered), at a cost proportional to the bytes however they are chopped.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import capnp

capnp.remove_import_hook()
_SCHEMA: Any = capnp.load(str(Path(__file__).with_name("tunnel.capnp")))

WORD = 8
# The gateway's reader allows far more (128 Mi words); pylon's own messages are small, and a
# handshake or ack over this is an attack or a bug, not a message.
MAX_HANDSHAKE_BYTES = 64 * 1024
MAX_SEGMENTS = 64

# The gateway's refusal reasons (HandshakeAck.reason when accepted is false), verbatim.
NACK_EMPTY_ID = "empty inference_server_id"
NACK_AUTHENTICATION = "authentication failed"
NACK_UNAUTHORIZED_ID = "unauthorized inference_server_id"
NACK_ROUTING_KEY = "routing key mismatch"
NACK_DUPLICATE = "duplicate connection"
NACK_REASONS = (
    NACK_EMPTY_ID,
    NACK_AUTHENTICATION,
    NACK_UNAUTHORIZED_ID,
    NACK_ROUTING_KEY,
    NACK_DUPLICATE,
)
# Only a duplicate is worth retrying as is: the gateway keeps a broken path's connection until
# its QUIC idle timeout, then takes the new one.
RETRYABLE_NACKS = frozenset({NACK_DUPLICATE})


class WireError(Exception):
    """Bytes that are not a well-formed message of the expected kind (or too large)."""


@dataclass(frozen=True, slots=True)
class Handshake:
    inference_server_id: str
    auth_token: str | None  # None: the field left unset (no token configured)


@dataclass(frozen=True, slots=True)
class HandshakeAck:
    accepted: bool
    reason: str


@dataclass(frozen=True, slots=True)
class RawHeaders:
    """A raw-QUIC headers (or trailers) message: the map's entries in order."""

    fields: tuple[tuple[str, str], ...]
    trailers: bool = False


@dataclass(frozen=True, slots=True)
class RawBody:
    content: bytes


RawMessage = RawHeaders | RawBody


def _to_bytes(message: Any) -> bytes:
    # pycapnp warns when a builder is serialised twice; each builder here is written once.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return bytes(message.to_bytes())


def encode_handshake(handshake: Handshake) -> bytes:
    message = _SCHEMA.Handshake.new_message(inferenceServerId=handshake.inference_server_id)
    if handshake.auth_token is not None:
        message.authToken = handshake.auth_token
    return _to_bytes(message)


def decode_handshake(data: bytes) -> Handshake:
    with _reader(_SCHEMA.Handshake, data) as message:
        token = str(message.authToken) if message._has("authToken") else None
        return Handshake(str(message.inferenceServerId), token)


def encode_handshake_ack(ack: HandshakeAck) -> bytes:
    return _to_bytes(_SCHEMA.HandshakeAck.new_message(accepted=ack.accepted, reason=ack.reason))


def decode_handshake_ack(data: bytes) -> HandshakeAck:
    with _reader(_SCHEMA.HandshakeAck, data) as message:
        return HandshakeAck(bool(message.accepted), str(message.reason))


def encode_raw(message: RawMessage) -> bytes:
    built = _SCHEMA.Message.new_message()
    if isinstance(message, RawBody):
        built.init("body").content = message.content
    else:
        entries = built.init("trailers" if message.trailers else "headers").init(
            "entries", len(message.fields)
        )
        for entry, (key, value) in zip(entries, message.fields, strict=True):
            entry.key = key
            entry.value = value
    return _to_bytes(built)


def decode_raw(data: bytes) -> RawMessage:
    with _reader(_SCHEMA.Message, data) as message:
        which = str(message.which())
        if which == "body":
            return RawBody(bytes(message.body.content))
        section = message.headers if which == "headers" else message.trailers
        fields = tuple((str(e.key), str(e.value)) for e in section.entries)
        return RawHeaders(fields, trailers=which == "trailers")


class _reader:
    """`from_bytes` as a context manager whose failures are `WireError`."""

    def __init__(self, kind: Any, data: bytes) -> None:
        self._kind = kind
        self._data = data
        self._cm: Any = None

    def __enter__(self) -> Any:
        try:
            self._cm = self._kind.from_bytes(self._data)
            return self._cm.__enter__()
        except capnp.KjException as exc:
            raise WireError(f"not a well-formed message: {exc.description}") from None

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)


def framed_size(head: bytes | bytearray, max_bytes: int) -> int | None:
    """The whole size of the standard-framed message starting `head`, or None while the segment
    table is incomplete. `WireError` when the table is malformed or announces over `max_bytes`."""
    if len(head) < 4:
        return None
    (count_minus_one,) = struct.unpack_from("<I", head, 0)
    count: int = count_minus_one + 1
    if count > MAX_SEGMENTS:
        raise WireError(f"{count} segments (at most {MAX_SEGMENTS})")
    table = 4 + 4 * count
    table += (-table) % WORD
    if len(head) < 4 + 4 * count:
        return None
    words: int = sum(struct.unpack_from(f"<{count}I", head, 4))
    size = table + words * WORD
    if size > max_bytes:
        raise WireError(f"a message of {size} bytes (at most {max_bytes})")
    return size


class FrameReader:
    """Cuts a stream's bytes into whole standard-framed messages, each at most `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._buffer = bytearray()
        self._need: int | None = None

    @property
    def pending(self) -> int:
        """Bytes held of a message not yet complete."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        out: list[bytes] = []
        while True:
            if self._need is None:
                self._need = framed_size(self._buffer, self._max)
                if self._need is None:
                    return out
            if len(self._buffer) < self._need:
                return out
            out.append(bytes(self._buffer[: self._need]))
            del self._buffer[: self._need]
            self._need = None

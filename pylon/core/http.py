"""HTTP vocabulary every layer shares: raw header pairs, tokens, and what is safe on the wire.

A leaf module: it imports nothing from pylon, so the pure core, the transports and the upstream
client can all depend on it without depending on each other.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

Header = tuple[bytes, bytes]
Headers = Sequence[Header]

OWS = b" \t"
# RFC 9110 5.6.2 tchar.
TOKEN_CHARS = rb"!#$%&'*+\-.^_`|~0-9A-Za-z"
TOKEN = re.compile(rb"[" + TOKEN_CHARS + rb"]+")
_TCHARS = bytes(byte for byte in range(256) if TOKEN.fullmatch(bytes([byte])))
# RFC 9110 5.5: a field value is VCHAR, obs-text, SP and HTAB. NUL, CR and LF would split or end
# an HTTP/1.1 header line on the engine hop; the other controls are forbidden outright.
_UNSAFE_VALUE_BYTES = bytes([*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F])
_SAFE_VALUE_BYTES = bytes(byte for byte in range(256) if byte not in _UNSAFE_VALUE_BYTES)


def field_names(headers: Headers) -> list[bytes]:
    """Each field name as every rule compares it: without surrounding whitespace, lower case.

    Computed once per message where the names are needed more than once (the request's head,
    the engine's response head) and passed along, so no name is lower-cased twice.
    """
    return [name.strip(OWS).lower() for name, _ in headers]


def wire_unsafe(headers: Headers) -> str | None:
    """Why these fields cannot be written on an HTTP/1.1 wire as they are; None when they can.

    The last check before a head is admitted, on every transport: whatever HPACK, QPACK or llhttp
    let through, the engine must parse exactly the fields pylon inspected. Each check is one C
    pass over the joined names or values (`translate` deleting every allowed byte must leave
    nothing), so the cost does not grow with the number of fields; a regex took ~3x as long.
    """
    if not headers:
        return None
    names = [name for name, _ in headers]
    if b"" in names or b"".join(names).translate(None, _TCHARS):
        return "a field name is not an RFC 9110 token"
    if b"".join([value for _, value in headers]).translate(None, _SAFE_VALUE_BYTES):
        return "a field value contains a control character"
    return None

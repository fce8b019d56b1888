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
# Names joined by LF: one regex call checks them all (LF is not a tchar, so it cannot hide one).
_TOKEN_LINES = re.compile(rb"[" + TOKEN_CHARS + rb"]+(?:\n[" + TOKEN_CHARS + rb"]+)*")
# RFC 9110 5.5: a field value is VCHAR, obs-text, SP and HTAB. NUL, CR and LF would split or end
# an HTTP/1.1 header line on the engine hop; the other controls are forbidden outright.
_UNSAFE_VALUE_BYTE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def field_names(headers: Headers) -> list[bytes]:
    """Each field name as every rule compares it: without surrounding whitespace, lower case.

    Computed once per message where the names are needed more than once (the request's head,
    the engine's response head) and passed along, so no name is lower-cased twice.
    """
    return [name.strip(OWS).lower() for name, _ in headers]


def wire_unsafe(headers: Headers) -> str | None:
    """Why these fields cannot be written on an HTTP/1.1 wire as they are; None when they can.

    The last check before a head is admitted, on every transport: whatever HPACK, QPACK or llhttp
    let through, the engine must parse exactly the fields pylon inspected. Two regex passes over
    the joined names and values, so the cost does not grow with the number of fields.
    """
    if not headers:
        return None
    if not _TOKEN_LINES.fullmatch(b"\n".join([name for name, _ in headers])):
        return "a field name is not an RFC 9110 token"
    # HTAB is allowed inside a value, so joining on it cannot create a false alarm.
    if _UNSAFE_VALUE_BYTE.search(b"\t".join([value for _, value in headers])):
        return "a field value contains a control character"
    return None

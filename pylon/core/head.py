"""One request head for every transport: the framing's fields in, a `RequestHead` out.

HTTP/2 and HTTP/3 carry the request line as pseudo-header fields and share one rule set
(RFC 9113 8.2-8.3, RFC 9114 4.2-4.3), so one function maps both. HTTP/1.1 heads come from llhttp,
which already parsed the request line; `http1_head` adds what llhttp lets through. Both end in
the same wire-safety check (`pylon.core.http.wire_unsafe`), so a head pylon admits on any
transport is one the engine's HTTP/1.1 parser reads exactly as pylon did.

Pure: no I/O, no clock, no settings. A malformed head raises `ContractError` with the code
`malformed_request`, and every transport answers it the same way: a 400 problem on that request
only (RFC 9113 8.1.1 and RFC 9114 4.1.2 allow a response before the stream is closed).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pylon.core.errors import ContractError, ErrorCode
from pylon.core.http import TOKEN, Header, Headers, wire_unsafe
from pylon.core.values import static_frozen

# Field names in HTTP/2 and HTTP/3 are lowercase tokens (RFC 9113 8.2.1, RFC 9114 4.2).
_LOWER_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+")
# Origin-form only, visible ASCII: a space or CR/LF here is request-line injection upstream.
_PATH = re.compile(rb"/[\x21-\x7e]*")
_SCHEME = re.compile(rb"[a-z][a-z0-9+.\-]*")
# RFC 9113 8.2.1 / RFC 9114 4.2: no leading or trailing whitespace in a field value.
_EDGE_WHITESPACE = re.compile(rb"\A[ \t]|[ \t]\Z")
# RFC 9113 8.2.2 / RFC 9114 4.2: connection-specific fields make a message malformed.
_CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":path", b":authority"})
# Schemes whose URIs have a mandatory authority (RFC 9113 8.3.1, RFC 9114 4.3.1).
_AUTHORITY_SCHEMES = frozenset({b"http", b"https"})


# One per request: frozen for mypy, no run-time freeze (see `pylon.core.values`).
@static_frozen
class RequestHead:
    """A request line and its fields as the engine will read them (Host included)."""

    method: bytes
    target: bytes
    headers: list[Header]
    content_length: int | None  # declared body length; None = not declared
    expects_continue: bool = False  # `expect: 100-continue`
    content_coding: bytes | None = None  # a `content-encoding` other than identity
    # The field names lower-cased, one per entry of `headers`: computed once by the normaliser,
    # so that the contract and the strip never lower-case a name again. None: not computed.
    names: list[bytes] | None = None


def malformed(reason: str) -> ContractError:
    return ContractError(f"malformed request: {reason}", code=ErrorCode.MALFORMED_REQUEST)


def pseudo_head(fields: Headers) -> RequestHead:
    """An HTTP/2 or HTTP/3 request header block -> `RequestHead`; raises `ContractError`."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[Header] = []
    for name, value in fields:
        if _EDGE_WHITESPACE.search(value):
            raise malformed("a field value has leading or trailing whitespace")
        if name[:1] == b":":
            _add_pseudo(pseudo, name, value, after_regular=bool(regular))
        else:
            _check_regular(name, value)
            regular.append((name, value))
    method, scheme, path = (pseudo.get(n) for n in (b":method", b":scheme", b":path"))
    if method is None or scheme is None or path is None:
        raise malformed(":method, :scheme and :path are required")
    if not TOKEN.fullmatch(method):
        raise malformed(":method is not a token")
    if not _SCHEME.fullmatch(scheme):
        raise malformed(":scheme is not a URI scheme")
    if not _PATH.fullmatch(path):
        raise malformed(":path is not an origin-form path")
    headers = _with_host(pseudo.get(b":authority"), scheme, _join_cookies(regular))
    # Regular names were checked to be lowercase tokens above: they are their own lower case.
    return _finish(method, path, headers, [name for name, _ in headers])


def http1_head(method: bytes, target: bytes, fields: Headers, http10: bool) -> RequestHead:
    """An HTTP/1.1 head as llhttp parsed it -> `RequestHead`; raises `ContractError`.

    llhttp already refuses CL with TE, invalid or repeated Content-Length, invalid
    Transfer-Encoding, obs-fold, whitespace before the colon, bare CR/LF and NUL; this adds
    what RFC 9112 forbids and llhttp lets through.
    """
    # llhttp refuses whitespace in a name, and the wire check below refuses anything but a
    # token, so lower-casing is the whole normalisation.
    names = [name.lower() for name, _ in fields]
    if http10 and b"transfer-encoding" in names:
        # RFC 9112 6.1: HTTP/1.0 framing with Transfer-Encoding is faulty by definition.
        raise malformed("Transfer-Encoding is not allowed in an HTTP/1.0 request")
    # RFC 9112 3.2: exactly one Host on HTTP/1.1; HTTP/1.0 clients may omit it.
    hosts = names.count(b"host")
    if hosts > 1 or (hosts == 0 and not http10):
        raise malformed("an HTTP/1.1 request needs exactly one Host header")
    return _finish(method, target, list(fields), names)


def declared_length(headers: Headers) -> int | None:
    """The one Content-Length parser: all values equal and decimal, else malformed."""
    found: bytes | None = None
    for name, value in headers:
        if len(name) == 14 and name.lower() == b"content-length":
            value = value.strip(b" \t")
            if not value.isdigit() or (found is not None and value != found):
                raise malformed("invalid content-length")
            found = value
    return None if found is None else int(found)


# The fields `_finish` reads (all three rare but content-length).
_FRAMING_FIELDS = frozenset({b"content-length", b"expect", b"content-encoding"})


def _finish(method: bytes, target: bytes, headers: list[Header], names: list[bytes]) -> RequestHead:
    reason = wire_unsafe(headers)
    if reason is not None:
        raise malformed(reason)
    # One pass for the fields later steps ask about.
    length: bytes | None = None
    expects = False
    coding: bytes | None = None
    for index, name in enumerate(names):
        if name not in _FRAMING_FIELDS:
            continue
        value = headers[index][1].strip(b" \t")
        if name == b"content-length":
            if not value.isdigit() or (length is not None and value != length):
                raise malformed("invalid content-length")
            length = value
        elif name == b"expect":
            expects = expects or value.lower() == b"100-continue"
        else:
            declared = value.lower()
            if declared and declared != b"identity":
                coding = declared
    # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
    return RequestHead(
        method,
        target,
        headers,
        None if length is None else int(length),  # content_length
        expects,  # expects_continue
        coding,  # content_coding
        names,
    )


def _add_pseudo(pseudo: dict[bytes, bytes], name: bytes, value: bytes, after_regular: bool) -> None:
    if after_regular:
        raise malformed("pseudo-header after a regular field")
    if name not in _REQUEST_PSEUDO:
        # Includes :protocol: pylon offers no extended CONNECT (RFC 8441, RFC 9220).
        raise malformed(f"pseudo-header {name.decode('latin-1')!r} is not allowed")
    if name in pseudo:
        raise malformed("repeated pseudo-header")
    pseudo[name] = value


def _check_regular(name: bytes, value: bytes) -> None:
    if not _LOWER_TOKEN.fullmatch(name):
        raise malformed("field name is not a lowercase token")
    if name in _CONNECTION_SPECIFIC:
        raise malformed(f"connection-specific field {name.decode('ascii')}")
    if name == b"te" and value != b"trailers":
        raise malformed("te other than trailers")


def _with_host(authority: bytes | None, scheme: bytes, regular: list[Header]) -> list[Header]:
    hosts = [value for name, value in regular if name == b"host"]
    if authority is None:
        if len(hosts) > 1:
            raise malformed("repeated host")
        if not hosts and scheme in _AUTHORITY_SCHEMES:
            raise malformed(":authority or host is required")
        return regular
    if not authority or authority.find(b"@") >= 0:
        raise malformed(":authority is empty or carries userinfo")
    if any(host != authority for host in hosts):
        raise malformed("host differs from :authority")
    if hosts:
        return regular
    # RFC 9113 8.3.1 / RFC 9114 4.3.1: a proxy converting to HTTP/1.1 builds Host from it.
    return [(b"host", authority), *regular]


def _join_cookies(regular: list[Header]) -> list[Header]:
    """RFC 9113 8.2.3 / RFC 9114 4.2.1: cookie crumbs become one field toward HTTP/1.1."""
    crumbs = [value for name, value in regular if name == b"cookie"]
    if len(crumbs) < 2:
        return regular
    joined: list[Header] = []
    for name, value in regular:
        if name != b"cookie":
            joined.append((name, value))
        elif crumbs:
            joined.append((b"cookie", b"; ".join(crumbs)))
            crumbs = []
    return joined


def trailers_unsafe(fields: Sequence[Header]) -> str | None:
    """Trailers are never forwarded, but a pseudo-header there makes the message malformed."""
    if any(name[:1] == b":" for name, _ in fields):
        return "pseudo-header in trailers"
    return None

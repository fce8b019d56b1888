"""Every golden control in one request, over HTTP/1.1, HTTP/2 (h2c) and HTTP/3, to mock_dynamo.

Thin on purpose: only the `pylon` fixture of test_contract_every_protocol.py and `Stack.send`, so
a change to how that fixture builds pylon does not touch this file. What reached the engine is
read from mock_dynamo's /test-control record and judged against tests/golden.py.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.golden import (
    ALL_BODY_FIELDS,
    BENIGN_NVEXT_FIELDS,
    HOP_BY_HOP,
    PYLON_OWNED,
    REQUEST_HEADER_PREFIXES,
    REQUEST_HEADERS,
    TUNNEL_HEADERS,
    enforced,
)
from tests.stack import MODEL, PROTOCOLS, StackFactory
from tests.transport.test_contract_every_protocol import CHAT, pylon  # noqa: F401 (the fixture)

SENTINEL = "golden-sentinel"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
RANK = 7
NAMES = [e.name for e in enforced(REQUEST_HEADERS)]
NAMES += [p.name + "golden-suffix" for p in enforced(REQUEST_HEADER_PREFIXES)]
TWINS = [
    n.replace("-", "_")
    for n in [*NAMES, *TUNNEL_HEADERS, *(e.name for e in PYLON_OWNED)]
    if "-" in n
]
PREFIXES = tuple(p.name for p in enforced(REQUEST_HEADER_PREFIXES))
HOP = {e.name for e in HOP_BY_HOP}
# What pylon itself writes toward the engine, per backend (besides the pylon-owned headers).
OWN_HEADERS = {
    "dynamo": {
        "x-dynamo-request-priority": [str(3600 - RANK)],
        "x-dynamo-request-strict-priority": ["0"],
    },
    "vllm": {},
}
OWN_BODY = {"dynamo": {}, "vllm": {"priority": RANK}}


def golden_headers(protocol: str) -> list[tuple[str, str]]:
    headers = [
        ("x-request-id", "req-golden"),
        ("x-model", MODEL),
        ("x-priority", str(RANK)),
        ("traceparent", TRACEPARENT),
        ("tracestate", "a=1"),
        ("tracestate", "b=2"),
        ("expect", "100-continue"),
        ("te", "trailers"),
    ]
    for name in NAMES + TWINS:
        headers.append((name, SENTINEL))
        # HTTP/2 and HTTP/3 forbid upper-case names on the wire; case variety is HTTP/1.1's.
        headers.append((name.upper() if protocol == "http1" else name, SENTINEL))
    if protocol == "http1":  # connection-specific fields are malformed in HTTP/2 and HTTP/3
        headers += [
            ("Connection", "keep-alive, X-Golden-Listed"),
            ("x-golden-listed", SENTINEL),
            ("Keep-Alive", "timeout=5"),
            ("proxy-connection", SENTINEL),
            ("proxy-authorization", SENTINEL),
            ("proxy-authenticate", SENTINEL),
            ("trailer", "x-golden-listed"),
        ]
    return headers


def golden_body() -> bytes:
    """Every golden body path with the sentinel, a repeated `nvext` and an escaped key."""
    tree: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    tree.update(max_tokens=4, seed=2**70, nvext={"greed_sampling": True})
    for entry in sorted(enforced(ALL_BODY_FIELDS), key=lambda e: -len(e.path)):  # deepest first
        node = tree
        for name in entry.path[:-1]:
            node = node.setdefault(name, {})
            assert isinstance(node, dict)
        node.setdefault(entry.path[-1], SENTINEL)
    text = json.dumps(tree).encode()
    hidden = b'"nvext": {"dp_rank": "%s"}, "cache\\u005fsalt": "%s", ' % ((SENTINEL.encode(),) * 2)
    return b"{" + hidden + text[1:]


def all_paths(raw: bytes) -> list[tuple[str, ...]]:
    """Every object-key path in the bytes, each occurrence of a repeated key included."""
    found: list[tuple[str, ...]] = []

    def walk(node: Any, prefix: tuple[str, ...]) -> None:
        for name, value in node if isinstance(node, Members) else ():
            found.append((*prefix, name))
            walk(value, (*prefix, name))

    walk(json.loads(raw, object_pairs_hook=Members), ())
    return found


class Members(list[tuple[str, Any]]):
    """A JSON object as its list of members."""


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("backend", ["dynamo", "vllm"])
async def test_no_golden_control_reaches_the_engine(
    pylon: StackFactory,  # noqa: F811 (the imported fixture)
    protocol: str,
    backend: str,
) -> None:
    stack = await pylon(backend, max_headers=2000, max_header_bytes=256 * 1024)
    reply = await stack.send(protocol, CHAT, golden_headers(protocol), golden_body())
    assert reply.status == 200, reply.body
    record = (await stack.records())[-1]
    assert SENTINEL not in json.dumps(record), "a client value reached the engine"

    headers = [(name.lower(), value) for name, value in record["headers"]]
    arrived = {name for name, _ in headers}
    own = OWN_HEADERS[backend]

    def values(name: str) -> list[str]:
        return [value for key, value in headers if key == name]

    leaked = {
        name
        for name in arrived - own.keys()
        if name in NAMES or name.startswith(PREFIXES) or "_" in name or name in HOP
    }
    assert leaked == set()
    assert "x-golden-listed" not in arrived
    for name, expected in own.items():
        assert values(name) == expected, name
    # Pylon-owned: exactly one each, pylon's value (host and content-length: the transport's).
    assert values("x-request-id") == ["req-golden"]
    assert values("traceparent") == [TRACEPARENT]
    assert values("tracestate") == ["a=1,b=2"]
    assert values("host") == [stack.mock.base_url.removeprefix("http://")]
    raw = base64.b64decode(record["body_b64"])  # the bytes as forwarded, repeats and all
    assert values("content-length") == [str(len(raw))]
    assert values("expect") == []

    body = record["body"]
    golden_paths = [e.path for e in enforced(ALL_BODY_FIELDS)]
    assert SENTINEL.encode() not in raw
    paths = all_paths(raw)
    assert len(paths) == len(set(paths)), "a repeated key reached the engine"
    assert [p for p in paths if any(p[: len(g)] == g for g in golden_paths)] == [
        (name,) for name in OWN_BODY[backend]
    ]
    for name, value in OWN_BODY[backend].items():
        assert body[name] == value
    assert body["seed"] == 2**70 and "vllm_xargs" not in body
    assert body["nvext"] == {"greed_sampling": True}
    assert set(body["nvext"]) <= set(BENIGN_NVEXT_FIELDS)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_repeated_container_hides_nothing(
    pylon: StackFactory,  # noqa: F811 (the imported fixture)
    protocol: str,
) -> None:
    # Nothing else to strip, so only the repeated-key check stands between the first `nvext`
    # and an engine that reads the first of repeated keys.
    stack = await pylon("dynamo")
    body = b'{"nvext":{"dp_rank":"%s"},"model":"%s","max_tokens":4,"messages":[],' % (
        SENTINEL.encode(),
        MODEL.encode(),
    )
    body += b'"\\u006evext":{"greed_sampling":true}}'
    reply = await stack.send(protocol, CHAT, [("x-request-id", "r"), ("x-model", MODEL)], body)
    assert reply.status == 200, reply.body
    raw = base64.b64decode((await stack.records())[-1]["body_b64"])
    assert SENTINEL.encode() not in raw
    assert [p for p in all_paths(raw) if p[0] == "nvext"] == [
        ("nvext",),
        ("nvext", "greed_sampling"),
    ]

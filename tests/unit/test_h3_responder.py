"""The HTTP/3 response sink on its own: it frames the head and the content it is given, and
the answer to a HEAD request carries a head only (RFC 9110 9.3.2), pylon's own problems
included. (aioquic's client cannot check the latter: it waits for a HEAD answer's declared
content, so this runs against a stand-in of the connection.)"""

from __future__ import annotations

from typing import Any

import pytest

from pylon.core.errors import ClientError, ErrorCode
from pylon.proxy.sink import send_problem
from pylon.server.http3 import H3Responder


class Layer:
    """What `H3Responder.flush` sends through (the connection's request layer)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, bool]] = []

    def send_headers(self, sid: int, headers: list[tuple[bytes, bytes]], end_stream: bool) -> None:
        self.sent.append(("headers", dict(headers), end_stream))

    def send_data(self, sid: int, data: bytes, end_stream: bool) -> None:
        self.sent.append(("data", data, end_stream))

    def forget(self, sid: int) -> None:
        self.sent.append(("forget", sid, True))


class Connection:
    def __init__(self) -> None:
        self.scheduled: list[H3Responder] = []

    def schedule(self, responder: H3Responder) -> None:
        self.scheduled.append(responder)

    def backlog(self, sid: int) -> int:
        return 0


def answer(is_head: bool) -> list[tuple[str, Any, bool]]:
    responder = H3Responder(Connection(), 0, is_head)  # type: ignore[arg-type]
    send_problem(responder, ClientError("no x-model", code=ErrorCode.MISSING_MODEL))
    layer = Layer()
    responder.flush(layer)  # type: ignore[arg-type]
    return layer.sent


@pytest.mark.interpreted
def test_a_problem_answer_has_its_content() -> None:
    sent = answer(is_head=False)
    assert [kind for kind, _, _ in sent] == ["headers", "data", "forget"]
    headers, content = sent[0][1], sent[1][1]
    assert headers[b":status"] == b"400" and int(headers[b"content-length"]) == len(content)
    assert sent[1][2] is True  # the data ends the stream


@pytest.mark.interpreted
def test_the_answer_to_a_head_request_is_a_head_only() -> None:
    sent = answer(is_head=True)
    assert [kind for kind, _, _ in sent] == ["headers", "forget"]
    headers, ended = sent[0][1], sent[0][2]
    assert headers[b":status"] == b"400" and ended  # the head ends the stream
    assert headers[b"content-length"] == str(len(answer(False)[1][1])).encode()

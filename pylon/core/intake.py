"""One request's way in, the same for HTTP/1.1, HTTP/2 and HTTP/3: a sans-I/O state machine.

A transport's framing turns bytes into a few inputs (a head, body pieces, trailers, the end, a
reset, the clock) and feeds them to one `RequestIntake` per request. The intake applies the
ingress limits and the stall clock to what admission decided about the head, and answers each
input with at most one decision: `Forward` (the whole request, ready for the proxy) or `Reject`
(pylon answers with its own problem; the engine never sees the request). It does no I/O and
never reads a clock: `now` is passed in, as in aioquic's and h2's cores; admission (contract,
tunnel auth, lifecycle, published models: it reads the lifecycle and the token file) is the
caller's, which hands its outcome in with the head (`receive_head`).

The state machine is a table, as in h11 and h2: a (state, input) pair that is not in
`_TRANSITIONS` is a framing bug or a peer breaking its protocol, raises `IntakeError`, and leaves
the intake CLOSED.

    AWAITING_HEAD --head ok, body follows--> RECEIVING --end/trailers--> FORWARDED
         |    \\--head ok, ended------------------------------------------^
         |     \\--malformed / refused--> REJECTED <--limit, stall, malformed--RECEIVING
         any state --reset--> CLOSED
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pylon.core.contract import HealthRequest, TunnelRequest, check_header_block
from pylon.core.errors import ClientError, ErrorCode, LimitError, PylonError
from pylon.core.head import RequestHead, malformed, trailers_unsafe
from pylon.core.http import Header
from pylon.core.values import static_frozen

AdmittedRequest = TunnelRequest | HealthRequest


@dataclass(frozen=True, slots=True)
class IngressLimits:
    """Every limit a transport applies to a client, built once from Settings."""

    max_header_bytes: int
    max_headers: int
    max_body_bytes: int
    max_connection_body_bytes: int  # request bodies one connection may hold at once
    stall_timeout: float  # seconds a started head or body may go without progress (408)
    idle_timeout: float  # seconds a connection may sit with nothing in flight
    max_streams: int  # concurrent request streams per HTTP/2 connection
    max_quic_streams: int  # concurrent request streams per QUIC connection
    h2_stream_window: int
    max_stream_resets: int  # client stream resets per flood window (0 = no limit)
    max_control_frames: int  # HTTP/2 PING/SETTINGS per flood window (0 = no limit)
    flood_window: float


class Admission(Protocol):
    """What the intake's caller runs on a head before handing it in: contract, tunnel auth,
    lifecycle and published models; raises `PylonError` to refuse."""

    def admit(self, head: RequestHead) -> AdmittedRequest: ...


def admit(admission: Admission, head: RequestHead) -> AdmittedRequest | PylonError:
    """`admission`'s outcome for `head`, a refusal as a value (what `receive_head` takes)."""
    try:
        return admission.admit(head)
    except PylonError as error:
        return error


# Decisions: one per request, frozen for mypy, no run-time freeze (see `pylon.core.values`).
@static_frozen
class Forward:
    """The whole request arrived and was admitted: hand it to the proxy."""

    request: AdmittedRequest
    body: bytes


@static_frozen
class Reject:
    """Pylon answers with its own problem; the rest of the request is not read."""

    error: PylonError


Decision = Forward | Reject | None


# IntEnum, not Enum: the transition table is consulted on every input, and an IntEnum hashes in
# C (a plain Enum's __hash__ is Python code, a measurable cost per request).
class State(enum.IntEnum):
    AWAITING_HEAD = 0
    RECEIVING = 1
    FORWARDED = 2
    REJECTED = 3
    CLOSED = 4


class Input(enum.IntEnum):
    HEAD = 0
    MALFORMED = 1
    DATA = 2
    TRAILERS = 3
    END = 4
    TICK = 5
    RESET = 6


# The members as plain globals for the code that runs on every input: on Python 3.11,
# `State.RECEIVING` is looked up through EnumType.__getattr__, ten times a global's cost.
AWAITING_HEAD, RECEIVING, FORWARDED = State.AWAITING_HEAD, State.RECEIVING, State.FORWARDED
REJECTED, CLOSED = State.REJECTED, State.CLOSED
_HEAD, _MALFORMED, _DATA, _TRAILERS = Input.HEAD, Input.MALFORMED, Input.DATA, Input.TRAILERS
_END, _TICK, _RESET = Input.END, Input.TICK, Input.RESET


class IntakeError(Exception):
    """An input the current state cannot take; the intake is now CLOSED."""


_S, _I = State, Input
# (state, input) -> the states the input may lead to. The handlers pick one; anything missing is
# an `IntakeError`. REJECTED swallows the rest of a request pylon already answered.
_TRANSITIONS: dict[tuple[State, Input], frozenset[State]] = {
    (_S.AWAITING_HEAD, _I.HEAD): frozenset({_S.RECEIVING, _S.FORWARDED, _S.REJECTED}),
    (_S.AWAITING_HEAD, _I.MALFORMED): frozenset({_S.REJECTED}),
    (_S.RECEIVING, _I.MALFORMED): frozenset({_S.REJECTED}),
    (_S.REJECTED, _I.MALFORMED): frozenset({_S.REJECTED}),
    (_S.AWAITING_HEAD, _I.TICK): frozenset({_S.AWAITING_HEAD}),
    (_S.RECEIVING, _I.DATA): frozenset({_S.RECEIVING, _S.FORWARDED, _S.REJECTED}),
    (_S.RECEIVING, _I.TRAILERS): frozenset({_S.FORWARDED, _S.REJECTED}),
    (_S.RECEIVING, _I.END): frozenset({_S.FORWARDED}),
    (_S.RECEIVING, _I.TICK): frozenset({_S.RECEIVING, _S.REJECTED}),
    (_S.FORWARDED, _I.TICK): frozenset({_S.FORWARDED}),
    (_S.REJECTED, _I.DATA): frozenset({_S.REJECTED}),
    (_S.REJECTED, _I.TRAILERS): frozenset({_S.REJECTED}),
    (_S.REJECTED, _I.END): frozenset({_S.REJECTED}),
    (_S.REJECTED, _I.TICK): frozenset({_S.REJECTED}),
    **{(state, _I.RESET): frozenset({_S.CLOSED}) for state in State},
    (_S.CLOSED, _I.TICK): frozenset({_S.CLOSED}),
}


def body_too_large(limit: int, request_id: str | None) -> LimitError:
    return LimitError(
        f"request body exceeds {limit} bytes", code=ErrorCode.BODY_TOO_LARGE, request_id=request_id
    )


class RequestIntake:
    """One request from its head to a decision. See the module docstring for the states."""

    __slots__ = ("_body", "_limits", "_size", "progress", "request", "state")

    def __init__(self, limits: IngressLimits, now: float) -> None:
        self._limits = limits
        self.state = AWAITING_HEAD
        self.request: AdmittedRequest | None = None
        self.progress = now  # when the request last moved: the stall clock counts from here
        # The first piece is kept as it came (the common single-piece body costs no copy); more
        # pieces go into one bytearray, so memory and time follow bytes, not how they were cut.
        self._body: bytes | bytearray = b""
        self._size = 0

    @property
    def request_id(self) -> str | None:
        return self.request.request_id if self.request is not None else None

    # --- inputs ---
    def receive_head(
        self, head: RequestHead, admitted: AdmittedRequest | PylonError, ended: bool, now: float
    ) -> Decision:
        """The head, and what admission made of it (the request, or its refusal)."""
        self._expect(_HEAD)
        self.progress = now
        if isinstance(admitted, PylonError):
            return self._reject(admitted)
        self.request = admitted
        declared = head.content_length
        if declared is not None and declared > self._limits.max_body_bytes:
            return self._reject(body_too_large(self._limits.max_body_bytes, self.request_id))
        if ended:
            return self._forward()
        self.state = RECEIVING
        return None

    def receive_malformed(self, error: PylonError) -> Decision:
        """The framing found the message malformed: no usable head (bad fields, over the header
        limits) or a body that breaks its framing (content-length disagreeing with the data)."""
        self._expect(_MALFORMED)
        if self.state is REJECTED:
            return None
        self._body = b""
        return self._reject(error)

    def receive_data(self, data: bytes, ended: bool, now: float) -> Decision:
        self._expect(_DATA)
        if self.state is REJECTED:
            return None
        self.progress = now
        if data:
            size = self._size + len(data)
            if size > self._limits.max_body_bytes:
                self._body = b""
                return self._reject(body_too_large(self._limits.max_body_bytes, self.request_id))
            self._append(data, size)
        return self._forward() if ended else None

    def receive_trailers(self, fields: Sequence[Header], now: float) -> Decision:
        """Trailers end the body; they are never forwarded, but count against the limits."""
        self._expect(_TRAILERS)
        if self.state is REJECTED:
            return None
        self.progress = now
        limits = self._limits
        try:
            check_header_block(fields, limits.max_headers, limits.max_header_bytes)
        except LimitError as error:
            return self._reject(error)
        reason = trailers_unsafe(fields)
        if reason is not None:
            return self._reject(malformed(reason))
        return self._forward()

    def receive_end(self, now: float) -> Decision:
        self._expect(_END)
        if self.state is REJECTED:
            return None
        self.progress = now
        return self._forward()

    def tick(self, now: float) -> Decision:
        """The stall clock: a body that stops arriving for `stall_timeout` gets 408."""
        self._expect(_TICK)
        if self.state is not RECEIVING:
            return None
        if now - self.progress < self._limits.stall_timeout:
            return None
        self._body = b""
        return self._reject(
            ClientError(
                f"the request body did not arrive within {self._limits.stall_timeout} s",
                code=ErrorCode.REQUEST_TIMEOUT,
                request_id=self.request_id,
            )
        )

    def deadline(self) -> float | None:
        """When `tick` could next reject; None when no clock runs for this request."""
        if self.state is not RECEIVING:
            return None
        return self.progress + self._limits.stall_timeout

    def reset(self) -> None:
        """The peer reset the stream, or the connection went away. Idempotent."""
        self._expect(_RESET)
        self.state = CLOSED
        self._body = b""

    # --- internals ---
    def _expect(self, event: Input) -> None:
        if (self.state, event) not in _TRANSITIONS:
            state, self.state = self.state, CLOSED
            self._body = b""
            raise IntakeError(f"{event.name.lower()} is not valid in state {state.name.lower()}")

    def _append(self, data: bytes, size: int) -> None:
        if not self._size:
            self._body = data
        elif isinstance(self._body, bytearray):
            self._body += data
        else:
            self._body = bytearray(self._body) + data
        self._size = size

    def _forward(self) -> Forward:
        assert self.request is not None
        self.state = FORWARDED
        body, self._body = self._body, b""
        return Forward(self.request, bytes(body) if isinstance(body, bytearray) else body)

    def _reject(self, error: PylonError) -> Reject:
        if error.request_id is None:
            error.request_id = self.request_id
        self.state = REJECTED
        return Reject(error)


def allowed_transitions() -> dict[tuple[State, Input], frozenset[State]]:
    """The transition table, for tests that walk every (state, input) pair."""
    return dict(_TRANSITIONS)

"""The request intake as a state machine, tested the h2 way: every (state, input) pair ends in a
valid state or a typed error, and a Hypothesis state machine drives random input sequences.

The expected outcomes below are written out by hand (not read from the table under test), so
deleting or loosening a transition fails a test.
"""

from __future__ import annotations

import dataclasses
import itertools
import tracemalloc

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pylon.core.contract import TunnelRequest, parse_request
from pylon.core.errors import ClientError, ContractError, ErrorCode, PylonError
from pylon.core.head import RequestHead
from pylon.core.intake import (
    Admission,
    Decision,
    Forward,
    IngressLimits,
    Input,
    IntakeError,
    Reject,
    RequestIntake,
    State,
    admit,
    allowed_transitions,
)

LIMITS = IngressLimits(
    max_header_bytes=4096,
    max_headers=20,
    max_body_bytes=100,
    max_connection_body_bytes=400,
    stall_timeout=10.0,
    idle_timeout=60.0,
    max_streams=8,
    max_quic_streams=8,
    h2_stream_window=65535,
    max_stream_resets=10,
    max_control_frames=10,
    flood_window=1.0,
)
GOOD = [(b"host", b"gw"), (b"x-request-id", b"r-1"), (b"x-model", b"m")]


class Admit:
    """Admission that runs the real contract, and refuses when told to (auth, lifecycle)."""

    def __init__(self, refuse: PylonError | None = None) -> None:
        self.refuse = refuse

    def admit(self, head: RequestHead) -> TunnelRequest:
        request = parse_request(head.method, head.target, head.headers)
        assert isinstance(request, TunnelRequest)
        if self.refuse is not None:
            raise self.refuse
        return request


def receive_head(
    intake: RequestIntake,
    head: RequestHead,
    *,
    ended: bool,
    now: float,
    admission: Admission | None = None,
) -> Decision:
    """What the stream table does: admit the head, then hand the outcome to the intake."""
    return intake.receive_head(head, admit(admission or Admit(), head), ended, now)


def head(content_length: int | None = None) -> RequestHead:
    return RequestHead(b"POST", b"/v1/chat/completions", list(GOOD), content_length)


def intake_in(state: State, now: float = 0.0) -> RequestIntake:
    """An intake driven into `state` through its public inputs only."""
    intake = RequestIntake(LIMITS, now)
    if state is State.AWAITING_HEAD:
        return intake
    if state is State.REJECTED:
        intake.receive_malformed(ContractError("bad"))
    elif state is State.CLOSED:
        intake.reset()
    else:
        receive_head(intake, head(), ended=state is State.FORWARDED, now=now)
    assert intake.state is state
    return intake


def feed(intake: RequestIntake, event: Input, now: float = 1.0) -> object:
    if event is Input.HEAD:
        return receive_head(intake, head(), ended=False, now=now)
    if event is Input.MALFORMED:
        return intake.receive_malformed(ContractError("bad"))
    if event is Input.DATA:
        return intake.receive_data(b"{}", ended=False, now=now)
    if event is Input.TRAILERS:
        return intake.receive_trailers([(b"x-t", b"1")], now)
    if event is Input.END:
        return intake.receive_end(now)
    if event is Input.TICK:
        return intake.tick(now)
    intake.reset()
    return None


# (state, input) -> the state after it; None = IntakeError (the intake is then CLOSED).
EXPECTED: dict[tuple[State, Input], State | None] = {
    (State.AWAITING_HEAD, Input.HEAD): State.RECEIVING,
    (State.AWAITING_HEAD, Input.MALFORMED): State.REJECTED,
    (State.AWAITING_HEAD, Input.DATA): None,
    (State.AWAITING_HEAD, Input.TRAILERS): None,
    (State.AWAITING_HEAD, Input.END): None,
    (State.AWAITING_HEAD, Input.TICK): State.AWAITING_HEAD,
    (State.AWAITING_HEAD, Input.RESET): State.CLOSED,
    (State.RECEIVING, Input.HEAD): None,
    (State.RECEIVING, Input.MALFORMED): State.REJECTED,
    (State.RECEIVING, Input.DATA): State.RECEIVING,
    (State.RECEIVING, Input.TRAILERS): State.FORWARDED,
    (State.RECEIVING, Input.END): State.FORWARDED,
    (State.RECEIVING, Input.TICK): State.RECEIVING,
    (State.RECEIVING, Input.RESET): State.CLOSED,
    (State.FORWARDED, Input.HEAD): None,
    (State.FORWARDED, Input.MALFORMED): None,
    (State.FORWARDED, Input.DATA): None,
    (State.FORWARDED, Input.TRAILERS): None,
    (State.FORWARDED, Input.END): None,
    (State.FORWARDED, Input.TICK): State.FORWARDED,
    (State.FORWARDED, Input.RESET): State.CLOSED,
    (State.REJECTED, Input.HEAD): None,
    (State.REJECTED, Input.MALFORMED): State.REJECTED,
    (State.REJECTED, Input.DATA): State.REJECTED,
    (State.REJECTED, Input.TRAILERS): State.REJECTED,
    (State.REJECTED, Input.END): State.REJECTED,
    (State.REJECTED, Input.TICK): State.REJECTED,
    (State.REJECTED, Input.RESET): State.CLOSED,
    (State.CLOSED, Input.HEAD): None,
    (State.CLOSED, Input.MALFORMED): None,
    (State.CLOSED, Input.DATA): None,
    (State.CLOSED, Input.TRAILERS): None,
    (State.CLOSED, Input.END): None,
    (State.CLOSED, Input.TICK): State.CLOSED,
    (State.CLOSED, Input.RESET): State.CLOSED,
}


def test_the_expectation_covers_every_pair() -> None:
    assert set(EXPECTED) == set(itertools.product(State, Input))


@pytest.mark.parametrize(("state", "event"), sorted(EXPECTED, key=str))
def test_every_state_and_input_ends_in_a_valid_state_or_a_typed_error(
    state: State, event: Input
) -> None:
    intake = intake_in(state)
    expected = EXPECTED[(state, event)]
    if expected is None:
        with pytest.raises(IntakeError):
            feed(intake, event)
        assert intake.state is State.CLOSED
        assert (state, event) not in allowed_transitions()
    else:
        feed(intake, event)
        assert intake.state is expected
        assert expected in allowed_transitions()[(state, event)]


def test_a_whole_request_is_forwarded_with_its_body_in_order() -> None:
    intake = RequestIntake(LIMITS, 0.0)
    assert receive_head(intake, head(), ended=False, now=0.0) is None
    for piece in (b'{"a"', b":", b"1}"):
        assert intake.receive_data(piece, ended=False, now=1.0) is None
    decision = intake.receive_end(2.0)
    assert isinstance(decision, Forward)
    assert decision.body == b'{"a":1}'
    assert decision.request.request_id == "r-1"


def test_a_head_that_ends_the_request_is_forwarded_at_once() -> None:
    decision = receive_head(RequestIntake(LIMITS, 0.0), head(), ended=True, now=0.0)
    assert isinstance(decision, Forward) and decision.body == b""


def test_admission_refusal_is_a_rejection_with_the_request_id() -> None:
    refusal = ClientError("no", code=ErrorCode.UNAUTHORIZED)
    intake = RequestIntake(LIMITS, 0.0)
    decision = receive_head(intake, head(), ended=False, now=0.0, admission=Admit(refusal))
    assert isinstance(decision, Reject) and decision.error.code is ErrorCode.UNAUTHORIZED
    assert intake.state is State.REJECTED


def test_contract_errors_are_rejections() -> None:
    bad = RequestHead(b"POST", b"/v1/chat/completions", [(b"x-model", b"m")], None)
    decision = receive_head(RequestIntake(LIMITS, 0.0), bad, ended=True, now=0.0)
    assert isinstance(decision, Reject)
    assert decision.error.code is ErrorCode.MISSING_REQUEST_ID


def test_declared_length_over_the_limit_is_413_before_any_body() -> None:
    intake = RequestIntake(LIMITS, 0.0)
    decision = receive_head(intake, head(content_length=101), ended=False, now=0.0)
    assert isinstance(decision, Reject)
    assert decision.error.code is ErrorCode.BODY_TOO_LARGE
    assert decision.error.request_id == "r-1"


def test_body_over_the_limit_is_413_and_later_data_is_swallowed() -> None:
    intake = intake_in(State.RECEIVING)
    assert intake.receive_data(b"x" * 100, ended=False, now=1.0) is None
    decision = intake.receive_data(b"x", ended=False, now=1.0)
    assert isinstance(decision, Reject) and decision.error.status == 413
    assert intake.receive_data(b"x" * 1000, ended=True, now=2.0) is None
    assert intake.state is State.REJECTED


def test_stall_clock_counts_from_the_last_progress() -> None:
    intake = intake_in(State.RECEIVING, now=0.0)
    assert intake.deadline() == 10.0
    intake.receive_data(b"{", ended=False, now=8.0)
    assert intake.tick(17.9) is None
    decision = intake.tick(18.0)
    assert isinstance(decision, Reject) and decision.error.code is ErrorCode.REQUEST_TIMEOUT
    assert intake.deadline() is None


def test_trailers_over_the_limits_or_with_pseudo_headers_are_rejected() -> None:
    many = [(b"x-t%d" % i, b"v") for i in range(21)]
    decision = intake_in(State.RECEIVING).receive_trailers(many, now=1.0)
    assert isinstance(decision, Reject) and decision.error.status == 431
    decision = intake_in(State.RECEIVING).receive_trailers([(b":path", b"/")], now=1.0)
    assert isinstance(decision, Reject) and decision.error.code is ErrorCode.MALFORMED_REQUEST


def test_cost_follows_bytes_not_pieces() -> None:
    """A body cut into one-byte pieces is held as one buffer, not a list of tiny objects."""
    intake = RequestIntake(LIMITS, 0.0)
    receive_head(intake, head(), ended=False, now=0.0)
    for _ in range(100):
        intake.receive_data(b"x", ended=False, now=0.0)
    decision = intake.receive_end(0.0)
    assert isinstance(decision, Forward) and decision.body == b"x" * 100


def test_a_body_in_two_byte_pieces_costs_its_bytes_not_its_pieces() -> None:
    """Memory follows bytes: 131,072 separate 2-byte pieces are held in one growing buffer. (A
    list of the pieces would cost over 5x the body in references alone, ~70x in bytes objects.)"""
    limits = dataclasses.replace(LIMITS, max_body_bytes=1 << 20, max_connection_body_bytes=1 << 20)
    intake = RequestIntake(limits, 0.0)
    receive_head(intake, head(), ended=False, now=0.0)
    pieces = [bytes([120, 120]) for _ in range(131_072)]  # distinct objects, made beforehand
    tracemalloc.start()
    try:
        for piece in pieces:
            intake.receive_data(piece, ended=False, now=0.0)
        decision = intake.receive_end(0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(decision, Forward) and len(decision.body) == 262_144
    assert peak < 3 * 262_144, f"peak {peak} bytes for a 256 KiB body"


class IntakeMachine(RuleBasedStateMachine):
    """Random input sequences: the intake never crashes, never forwards twice, never keeps a
    body beyond the limit, and every refusal is a typed `PylonError`."""

    def __init__(self) -> None:
        super().__init__()
        self.intake = RequestIntake(LIMITS, 0.0)
        self.now = 0.0
        self.forwarded = 0
        self.body = b""

    def _apply(self, step: object) -> None:
        try:
            decision = step() if callable(step) else step
        except IntakeError:
            assert self.intake.state is State.CLOSED
            return
        if isinstance(decision, Forward):
            self.forwarded += 1
            assert len(decision.body) <= LIMITS.max_body_bytes
            assert decision.body == self.body
        elif isinstance(decision, Reject):
            assert isinstance(decision.error, PylonError)

    @rule(ended=st.booleans(), declared=st.one_of(st.none(), st.integers(0, 200)))
    def receive_head(self, ended: bool, declared: int | None) -> None:
        self._apply(lambda: receive_head(self.intake, head(declared), ended=ended, now=self.now))

    @rule(data=st.binary(max_size=40), ended=st.booleans())
    def receive_data(self, data: bytes, ended: bool) -> None:
        receiving = self.intake.state is State.RECEIVING
        if receiving:
            self.body += data
        self._apply(lambda: self.intake.receive_data(data, ended, self.now))

    @rule()
    def receive_trailers(self) -> None:
        self._apply(lambda: self.intake.receive_trailers([(b"x-t", b"1")], self.now))

    @rule()
    def receive_end(self) -> None:
        self._apply(lambda: self.intake.receive_end(self.now))

    @rule()
    def receive_malformed(self) -> None:
        self._apply(lambda: self.intake.receive_malformed(ContractError("bad")))

    @rule(seconds=st.floats(0, 20))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self._apply(lambda: self.intake.tick(self.now))

    @precondition(lambda self: self.intake.state is not State.CLOSED)
    @rule()
    def reset(self) -> None:
        self.intake.reset()

    @invariant()
    def forwarded_at_most_once(self) -> None:
        assert self.forwarded <= 1
        if self.forwarded:
            assert self.intake.state in (State.FORWARDED, State.CLOSED)

    @invariant()
    def state_is_a_state(self) -> None:
        assert isinstance(self.intake.state, State)


TestIntakeMachine = IntakeMachine.TestCase

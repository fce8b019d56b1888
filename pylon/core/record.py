"""What one request is observed as (`RequestRecord`) and the moments its exchange goes through
(`pylon.core.hooks.ExchangeHooks`): the one hook set every per-request part subscribes to.

A request's `pylon.proxy.exchange.Exchange` owns its record and is its only writer. It emits
each moment once, in this order, to every subscriber (the queue entry, the booking, the span,
the observers: logs and metrics):

    dispatched -> response_head -> first_output -> output(n)* -> complete
          \\--------------- rejected (instead of complete) ----------/

- `dispatched`: the first attempt's request was written to the engine (a stale-connection
  retry is a second attempt of the same exchange, not a second dispatch: `record.attempts`;
  a request moved from a worker it could not reach is dispatched once, to the second);
- `response_head`: the engine's response head arrived (`record.status`);
- `first_output`: prefill is over: the first output event of a stream, or the head of a whole
  response (`record.ends_prefill`: it ended a successful prefill, so it measures throughput);
- `output(n)`: n more output events were relayed from the first output on (told only to the
  subscribers that asked for it: counting costs the relay per block);
- `complete`: the exchange is over, however it ended (`record.outcome`); the terminal moment of
  every exchange that reached the engine or was booked;
- `rejected`: pylon answered with its own problem before any engine saw the request (the
  terminal moment instead of `complete`); a booking also hears it when its worker could not
  be reached and the exchange moves to another worker's booking (`Exchange.rebooked`).

Any moment after `dispatched` may be skipped (an engine that never answers has no head), but
none repeats, none comes out of order, and exactly one terminal moment ends every exchange. A
subscriber joins when it exists (the queue entry at the queue gate, the booking once booked, the
span once started) and hears the moments from then on. Hooks run inside the event loop on the
hot path: they must be cheap and never raise. Pure: no I/O, no clock (the exchange writes the
loop-clock readings into the record before each moment).
"""

from __future__ import annotations


class RequestRecord:
    """One request as observed: who it is, where it went, and when each step happened."""

    __slots__ = (
        "attempts",
        "bytes_received",
        "bytes_sent",
        "dispatched_at",
        "done_at",
        "ends_prefill",
        "engine_priority",
        "first_byte_at",
        "first_output_at",
        "head_at",
        "input_tokens",
        "input_tokens_source",
        "method",
        "model",
        "outcome",
        "output_tokens",
        "output_tokens_source",
        "path",
        "request_id",
        "status",
        "stream_id",
        "stripped",
        "transport",
        "worker",
    )

    def __init__(self, transport: str, stream_id: int, head_at: float) -> None:
        self.transport = transport  # "http1", "h2", "h3" or "raw-quic"
        self.stream_id = stream_id
        self.head_at = head_at  # the request head was received
        self.dispatched_at: float | None = None  # the first attempt was written to the engine
        self.first_byte_at: float | None = None  # the engine's response head went to the client
        self.first_output_at: float | None = None  # the first output (event or body) arrived
        self.done_at: float | None = None
        # Attempts made (2: a stale-connection retry, or a move from a worker that could not be
        # reached at all to another).
        self.attempts = 0
        self.ends_prefill = False  # the first output ended a successful prefill
        # Body bytes: of the request as the client sent it (0 when refused at its head, before
        # the body was taken in), and of the response as the client got it (pylon's own
        # problem body included); headers and framing not counted.
        self.bytes_received = 0
        self.bytes_sent = 0
        self.request_id: str | None = None
        self.model: str | None = None
        self.method = ""
        self.path = ""
        self.status = 0
        self.outcome = ""
        self.worker: str | None = None
        self.stripped: tuple[str, ...] = ()  # header names and body paths the strip removed
        self.engine_priority: int | None = None  # the priority pylon wrote for the engine
        # Token counts (see `pylon.core.usage`), and where each came from: "usage" (the engine's
        # report), "gateway" (x-input-tokens), "estimate" (streamed data events); "" = unknown.
        self.input_tokens: int | None = None
        self.input_tokens_source = ""
        self.output_tokens: int | None = None
        self.output_tokens_source = ""

    def duration_ms(self) -> float | None:
        if self.done_at is None:
            return None
        return round((self.done_at - self.head_at) * 1000, 3)

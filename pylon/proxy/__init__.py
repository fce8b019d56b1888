"""The proxy: admission (contract, auth, lifecycle, published model), the per-request
`Exchange`, forwarding (plan, queue gate, book, attempt) and the relays.

- `admission`: `ProxyAdmission`, which the stream table runs on a head before the intake.
- `exchange`: `Exchange`, one per request: its record and the record's only writer, which tells
  the queue entry, booking, span and observers each moment once, in order; `Watchdog`, its
  engine-side clock.
- `forwarding`: `Proxy.handle(exchange, request, body)`, the way out as one short script.
- `relay`: the SSE relay and the raw one, each taking the exchange.
- `sink`: what a transport offers for one response (`ResponseSink`), pylon's problem answers.

Transports reach it through the stream table: admission at headers time, `Exchange.reject` for
pylon's own answers, `Proxy.handle` once the whole request arrived.
"""

from pylon.proxy.admission import ProxyAdmission
from pylon.proxy.forwarding import Proxy
from pylon.proxy.relay import RelayLimits
from pylon.proxy.sink import ResponseSink, send_problem

__all__ = ["Proxy", "ProxyAdmission", "RelayLimits", "ResponseSink", "send_problem"]

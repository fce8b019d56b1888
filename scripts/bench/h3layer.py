"""Micro-benchmark: CPU per request of pylon's H3Layer vs aioquic's H3Connection, server side.

Each request is HEADERS (10 fields) + 200-byte DATA + FIN; each response is HEADERS (3 fields) +
one 200-byte DATA frame with FIN. Two measurements:

- `layer`: synthetic `StreamDataReceived` events (one per request, as a small request arrives
  in one packet) fed to each HTTP/3 layer on a stub connection whose send_stream_data does
  nothing: the HTTP/3 layer's own cost. aioquic's H3Connection also validates every header
  byte in Python; pylon leaves that to its shared normaliser, so the layer is also timed with
  aioquic's `validate_request_headers` added, as an upper bound for "layer + validation".
- `quic`: a real in-memory QuicConnection pair (tests/unit/quic_pair.py), an aioquic client
  H3Connection sending `--concurrency` requests at a time; only the server side is timed
  (receive_datagram, events, HTTP/3 layer, responses, datagrams_to_send), QUIC included.

    .venv/bin/python scripts/bench/h3layer.py                  # both, default sizes
    .venv/bin/python scripts/bench/h3layer.py --requests 50000 --mode layer
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pylsqpack
from aioquic.h3 import events as h3_events
from aioquic.h3.connection import H3Connection, validate_request_headers
from aioquic.quic.events import StreamDataReceived

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pylon.server import h3layer  # noqa: E402
from tests.unit.quic_pair import QuicPair  # noqa: E402

REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"pylon.local:8443"),
    (b":path", b"/v1/chat/completions"),
    (b"content-type", b"application/json"),
    (b"accept", b"text/event-stream"),
    (b"x-request-id", b"0af7651916cd43dd8448eb211c80319c"),
    (b"x-model", b"mock-model"),
    (b"user-agent", b"bench/1.0"),
    (b"content-length", b"200"),
]
BODY = b"{" + b"x" * 198 + b"}"
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/json"), (b"server", b"pylon")]
ANSWER = b"[" + b"y" * 198 + b"]"


class StubQuic:
    """The few QuicConnection members both layers use, doing nothing."""

    def __init__(self) -> None:
        self.configuration = SimpleNamespace(is_client=False)
        self._quic_logger = None
        self._uni = 3

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        self._uni += 4
        return self._uni - 4

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        pass

    def stop_stream(self, stream_id: int, error_code: int) -> None:
        pass

    def reset_stream(self, stream_id: int, error_code: int) -> None:
        pass

    def close(self, **kwargs: Any) -> None:
        raise AssertionError(f"connection closed: {kwargs}")


def request_wire() -> bytes:
    block = pylsqpack.Encoder().encode(0, REQUEST)[1]
    return h3layer._frame(0x1, block) + h3layer._frame(0x0, BODY)


def run_pylon(requests: int, validate: bool) -> float:
    layer = h3layer.H3Layer(StubQuic(), max_field_section_size=16384, max_header_block=9216)  # type: ignore[arg-type]
    wire = request_wire()
    events = [StreamDataReceived(wire, True, 4 * i) for i in range(requests)]
    got = 0
    started = time.perf_counter()
    for event in events:
        sid = event.stream_id
        for out in layer.handle_event(event):
            if isinstance(out, h3layer.HeadersReceived):
                if validate:
                    validate_request_headers(out.headers)
            elif isinstance(out, h3layer.DataReceived) and out.stream_ended:
                got += 1
                layer.send_headers(sid, RESPONSE)
                layer.send_data(sid, ANSWER, True)
                layer.forget(sid)
    elapsed = time.perf_counter() - started
    assert got == requests
    return elapsed


def run_aioquic(requests: int, validate: bool) -> float:
    http = H3Connection(StubQuic())  # type: ignore[arg-type]
    wire = request_wire()
    events = [StreamDataReceived(wire, True, 4 * i) for i in range(requests)]
    got = 0
    started = time.perf_counter()
    for event in events:
        sid = event.stream_id
        for out in http.handle_event(event):
            if isinstance(out, h3_events.DataReceived) and out.stream_ended:
                got += 1
                http.send_headers(sid, RESPONSE)
                http.send_data(sid, ANSWER, True)
    elapsed = time.perf_counter() - started
    assert got == requests
    return elapsed


def run_quic(requests: int, concurrency: int, use_layer: bool) -> float:
    """Server-side seconds for `requests` over one real in-memory QUIC connection."""
    pair = QuicPair().connect()
    client, server = pair.client.quic, pair.server.quic
    client_http = H3Connection(client)
    if use_layer:
        layer = h3layer.H3Layer(server, max_field_section_size=16384, max_header_block=9216)
        handle: Callable[[Any], list[Any]] = layer.handle_event
    else:
        server_http = H3Connection(server)
        handle = server_http.handle_event
    busy = 0.0
    done = 0
    while done < requests:
        batch = min(concurrency, requests - done)
        for _ in range(batch):
            sid = client.get_next_available_stream_id()
            client_http.send_headers(sid, REQUEST)
            client_http.send_data(sid, BODY, end_stream=True)
        inbound = client.datagrams_to_send(now=pair.now)
        started = time.perf_counter()
        for datagram, _ in inbound:
            server.receive_datagram(datagram, ("10.0.0.1", 4433), now=pair.now)
        while (event := server.next_event()) is not None:
            for out in handle(event):
                if out.__class__.__name__ == "DataReceived" and out.stream_ended:
                    if use_layer:
                        layer.send_headers(out.stream_id, RESPONSE)
                        layer.send_data(out.stream_id, ANSWER, True)
                        layer.forget(out.stream_id)
                    else:
                        server_http.send_headers(out.stream_id, RESPONSE)
                        server_http.send_data(out.stream_id, ANSWER, True)
                    done += 1
        outbound = server.datagrams_to_send(now=pair.now)
        busy += time.perf_counter() - started
        for datagram, _ in outbound:
            client.receive_datagram(datagram, ("10.0.0.2", 443), now=pair.now)
        while (event := client.next_event()) is not None:
            client_http.handle_event(event)
        pair.pump()  # ACKs both ways, outside the timed part
        pair.client.take_events()
        pair.server.take_events()
    return busy


def best_of(repeats: int, run: Callable[[], float]) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        times.append(run())
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--quic-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", choices=["layer", "quic", "both"], default="both")
    args = parser.parse_args()
    n, repeats = args.requests, args.repeats

    def per_request(seconds: float, count: int) -> str:
        return f"{seconds / count * 1e6:7.2f} us/request"

    if args.mode in ("layer", "both"):
        print(f"HTTP/3 layer only (stub QUIC), {n} requests, best of {repeats}:")
        pylon_s = best_of(repeats, lambda: run_pylon(n, False))
        pylon_v = best_of(repeats, lambda: run_pylon(n, True))
        aioquic_s = best_of(repeats, lambda: run_aioquic(n, False))
        print(f"  aioquic H3Connection       {per_request(aioquic_s, n)}")
        print(f"  pylon H3Layer              {per_request(pylon_s, n)}")
        print(f"  pylon H3Layer + validation {per_request(pylon_v, n)}")
    if args.mode in ("quic", "both"):
        q, c = args.quic_requests, args.concurrency
        print(f"Server side with QUIC (in-memory pair), {q} requests, {c} at a time:")
        samples: dict[str, list[float]] = {"aioquic H3Connection": [], "pylon H3Layer": []}
        for _ in range(repeats):  # interleaved, so drift hits both alike
            samples["aioquic H3Connection"].append(run_quic(q, c, False))
            samples["pylon H3Layer"].append(run_quic(q, c, True))
        for name, times in samples.items():
            spread = statistics.pstdev(times) / q * 1e6
            print(f"  {name:26} {per_request(min(times), q)} (spread {spread:.2f})")


if __name__ == "__main__":
    main()

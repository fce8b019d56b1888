"""What tracing costs per request: nothing measurable when off, a few microseconds when on.

    .venv/bin/python scripts/bench_tracing.py                    # against the merge base b967910
    .venv/bin/python scripts/bench_tracing.py --baseline main --repeat 9

Off (no `--otel-endpoint`): no tracer is built, so the only per-request code tracing added is
the proxy's `self._tracer is None` check and `ForwardPlan.routed`'s `trace is None` one. The
script times `routed` as it is at `--baseline` (its `pylon/core/plan.py` loaded into a separate
module) and in this tree, interleaved, on the same plan; and the check itself.

On: the event-loop hold of `OtelTracer.start` plus `OtelExchange.end` (span creation with its
attributes, the traceparent for the engine, events, status, end; exported to an exporter that
drops the spans), for a sampled caller and for one that did not sample (the default sampler
follows the caller's decision: the span is not recorded, the engine still gets a context); and,
separately, the CPU the batch exporter's thread spends encoding one span to OTLP protobuf.

Every figure is the median of `--repeat` runs of `--number` calls, in ns per request.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.contract import TunnelRequest, parse_request
from pylon.core.plan import Planner
from pylon.core.record import RequestRecord
from pylon.core.upstream import Upstream
from pylon.observe import LogObserver
from pylon.otel import OtelTracer, TracingOptions

ROOT = Path(__file__).resolve().parent.parent
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def plan_module_at(ref: str) -> ModuleType:
    """`pylon/core/plan.py` as it is at git ref `ref`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{ref}:pylon/core/plan.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spec = importlib.util.spec_from_loader("baseline_plan", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_plan"] = module
    exec(compile(source, f"{ref}:pylon/core/plan.py", "exec"), module.__dict__)
    return module


def request(traceparent: bytes = TRACEPARENT) -> TunnelRequest:
    headers = [
        (b"x-request-id", b"bench-1"),
        (b"x-model", b"mock-model"),
        (b"x-priority", b"100"),
        (b"traceparent", traceparent),
        (b"tracestate", b"gw=1"),
        (b"content-type", b"application/json"),
        (b"accept", b"text/event-stream"),
    ]
    parsed = parse_request(b"POST", b"/v1/chat/completions", headers)
    assert isinstance(parsed, TunnelRequest)
    return parsed


def per_call_ns(call: Callable[[], Any], number: int, repeat: int) -> float:
    runs = timeit.repeat(call, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e9


class Dropping(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class Keeping(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="b967910", help="git ref before tracing")
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    tunnel = request()
    body = b'{"model":"mock-model","messages":[{"role":"user","content":"hi"}],"stream":true}'
    adapter = build_adapter("dynamo", AdapterOptions(3600), derive=True)
    target = Upstream.from_url("http://127.0.0.1:8000")
    before_plan = plan_module_at(args.baseline).Planner(adapter).plan(tunnel, body)
    after_plan = Planner(adapter).plan(tunnel, body)

    class Holder:
        __slots__ = ("_tracer",)

        def __init__(self) -> None:
            self._tracer = None

    holder = Holder()
    rows: list[tuple[str, float]] = []
    before: list[float] = []
    after: list[float] = []
    for _ in range(3):  # interleaved, so drift hits both alike
        before.append(per_call_ns(lambda: before_plan.routed(target), args.number, args.repeat))
        after.append(per_call_ns(lambda: after_plan.routed(target), args.number, args.repeat))
    rows.append((f"off: ForwardPlan.routed at {args.baseline}", statistics.median(before)))
    rows.append(("off: ForwardPlan.routed now (trace=None)", statistics.median(after)))
    rows.append(
        (
            "off: the proxy's `self._tracer is None` check",
            per_call_ns(lambda: holder._tracer is None, args.number, args.repeat)
            - per_call_ns(lambda: None, args.number, args.repeat),
        )
    )

    options = TracingOptions("pylon", "http://127.0.0.1:4318/v1/traces", backend="dynamo")
    loop = asyncio.new_event_loop()  # its clock only: the readings' clock, as in pylon
    clock = loop.time
    tracer = OtelTracer.build(options, loop, LogObserver(), Dropping())
    record = RequestRecord("h2", 1, clock())
    record.request_id, record.model, record.method = "bench-1", "mock-model", "POST"
    record.path, record.worker = "/v1/chat/completions", target.label

    def traced_exchange(tunnel: TunnelRequest = tunnel) -> None:
        span = tracer.start(tunnel, after_plan, record)
        after_plan.routed(target, (), span.trace)
        record.dispatched_at = record.first_byte_at = record.done_at = clock()
        record.status, record.outcome = 200, "ok"
        span.end(record)

    rows.append(
        (
            "on: span start + routed with its traceparent + end (loop hold)",
            per_call_ns(traced_exchange, args.number // 10, args.repeat),
        )
    )
    unsampled = request(TRACEPARENT[:-2] + b"00")
    rows.append(
        (
            "on, the caller did not sample (flags 00): the same, nothing recorded",
            per_call_ns(lambda: traced_exchange(unsampled), args.number // 10, args.repeat),
        )
    )
    keeping = Keeping()
    keeper = OtelTracer.build(options, loop, LogObserver(), keeping)
    for _ in range(1000):
        keeper.start(tunnel, after_plan, record).end(record)
    spans = keeping.spans
    rows.append(
        (
            "on: OTLP protobuf encoding, per span (exporter thread, batches of 512)",
            per_call_ns(lambda: encode_spans(spans[:512]).SerializeToString(), 20, args.repeat)
            / 512,
        )
    )
    tracer.close()
    keeper.close()
    loop.close()

    print("| what | ns per request |")
    print("|---|---|")
    for label, value in rows:
        print(f"| {label} | {value:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

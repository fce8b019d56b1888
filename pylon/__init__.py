"""pylon: the node-local inference tunnel daemon, the last trusted hop before the engines.

How a request flows (each layer only knows the one below it):

- Transports (`pylon.server`): thin framings. HTTP/1.1 on httptools, HTTP/2 on h2 (one TCP
  port), HTTP/3 on aioquic's QUIC with pylon's own request layer (`h3layer`). Each turns bytes
  into a request head (HTTP/2 and HTTP/3: a header block), body pieces, trailers, an end or a
  reset, and feeds its connection's `StreamTable`.
- Intake (`pylon.core.intake`, `pylon.core.head`): sans-I/O, time passed in. One head
  normaliser with a final wire-safety check, the ingress limits and the stall clock, the same
  for every transport, on what admission (`pylon.proxy.admission`, run by the stream table)
  made of the head; `Forward` or `Reject`.
- Contract (`pylon.core.contract`): the tunnel headers, parsed once into a frozen request.
- Planner (`pylon.core.plan`, `pylon.core.sanitize`, `pylon.adapters`): refuse a route the
  backend does not serve, strip every client steering control, derive the engine priority per
  backend; a `ForwardPlan` that is exactly what goes to the engine.
- Exchange (`pylon.proxy.exchange`, `pylon.core.record`): one object per request, its record
  and the record's only writer; it emits the request's moments once each, in order, to the
  queue entry, the booking, the span and the observers.
- Proxy (`pylon.proxy`): assembled from injected parts: planner, queue gate (`pylon.core.queue`:
  a live per-model request table; a request clearly slower here than the gateway expected gets
  a retryable 429 before the engine sees it), router (`pylon.routing`: a booking per exchange),
  upstream pool (`pylon.upstream`: connections per upstream, capped, one attempt at a time),
  relay limits and tracer. Relays SSE event by event with output timeouts, marks retries.
- Process (`pylon.assemble`, `pylon.listeners`, `pylon.run`, `pylon.lifecycle`,
  `pylon.settings`, `pylon.preflight`, `pylon.cli`): Settings built once (a setting that cannot
  take effect refuses the start, one line, exit 2); `assemble` turns them into each component's
  frozen options and builds the parts; files are checked before any listener opens; `run`
  starts the listeners and drains on SIGTERM (a second signal ends the drain at once).
- Bring-up (`pylon.bringup`, `pylon.models`, `pylon.upstream.probe`): with the listeners up, the
  engine's health gate, then the published model set (static, or `/v1/models` polled, with a
  generation per appearance); `Lifecycle.readiness()` says whether and why pylon is ready (the
  engine and the fleet in rotation included, after start-up).
- Operations (`pylon.admin`, `pylon.metrics`): the admin listener (`/metrics`, `/live`,
  `/ready` from `Lifecycle.readiness()`), and the Prometheus metrics, an observer beside the
  log lines.

Glossary (one word per concept, in code, logs and docs):

- request: what the client sent, as pylon parsed it (`TunnelRequest`, or the unauthenticated
  `HealthRequest`) and its body.
- stream: one request's life on a client connection (`pylon.server.streams.Stream`: its intake,
  its task, its sink); HTTP/1.1 has one stream per request, in order.
- intake: the sans-I/O machine from a stream's head to a decision: `Forward` (the whole request
  arrived and was admitted) or `Reject` (pylon answers with its own problem).
- admission: the head checks only: contract, tunnel auth, lifecycle, published model
  (`ProxyAdmission`). Not the queue gate, not a worker's health.
- exchange: one request's way out, from the stream's head to its end (`Exchange`): plan,
  booking, queue entry, span, attempts, relay. It is the request's record.
- record: what observers read about one request (`RequestRecord`: ids, clock readings, status,
  outcome, tokens); the exchange is its only writer.
- moment: one step of an exchange told to its subscribers (`ExchangeHooks`): dispatched,
  response head, first output, output, then complete or rejected.
- route: a request's method and percent-decoded path. Each backend serves a fixed table of
  them (`PriorityAdapter.route`: scheduled, scheduled with no model field, or not scheduled;
  and whether its request type reads a body `stream`);
  any other is refused (`route_not_served`), never forwarded unsteered.
- plan: `ForwardPlan`, exactly what goes to the engine (method, request-target, fields, body)
  and, once routed, where.
- upstream: where an attempt goes (`Upstream`: host, port, base path); the target is only the
  request-target (path and query).
- attempt: one try of an exchange on one upstream connection (`pylon.upstream.Attempt`); a
  stale-connection retry is a second attempt of the same exchange, and so is a move: a request
  whose worker could not be reached at all, sent to another worker.
- dispatch: the moment the exchange's first attempt is written to the engine.
- queue gate: the check that refuses (429) a request that would queue here longer than the
  gateway expected (`QueueGate`); queue entry: an exchange's place in its model's queue table
  (`QueueEntry`).
- booking: a router's claim on a worker for one exchange (`Booking`), released by the
  exchange's terminal moment; reservation: the native selection core's own claim, which a `kv`
  booking holds (`router_ffi.Reservation`).
- worker: an engine instance pylon routes to (`--worker`, `pylon.routing.fleet.Worker`); worker
  in rotation: one whose health checks pass now and whose real answers have not ejected it
  (passive health, `pylon.routing.outlier`), the only ones routers choose from.
"""

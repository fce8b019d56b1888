"""pylon: the node-local inference tunnel daemon, the last trusted hop before the engines.

How a request flows (each layer only knows the one below it):

- Transports (`pylon.server`): thin framings. HTTP/1.1 on httptools, HTTP/2 on h2 (one TCP
  port), HTTP/3 on aioquic's QUIC with pylon's own request layer (`h3layer`). Each turns bytes
  into a request head, body pieces, trailers, an end or a reset, and feeds its connection's
  `StreamTable`.
- Intake (`pylon.core.intake`, `pylon.core.head`): sans-I/O, time passed in. One head
  normaliser with a final wire-safety check, the ingress limits, admission (contract, tunnel
  auth, lifecycle) and the stall clock, the same for every transport; `Dispatch` or `Reject`.
- Contract (`pylon.core.contract`): the tunnel headers, parsed once into a frozen request.
- Planner (`pylon.core.plan`, `pylon.core.sanitize`, `pylon.adapters`): strip every client
  steering control, derive the engine priority per backend; a `ForwardPlan` that is exactly what
  goes to the engine.
- Proxy (`pylon.proxy`): assembled from injected parts: planner, queue admission
  (`pylon.core.queue`: a live per-model request table; a request clearly slower here than the
  gateway expected gets a retryable 429 before the engine sees it), router (`pylon.routing`: a
  booking per request, released when the exchange ends), upstream pool (`pylon.upstream`:
  connections per target, capped), observer (`pylon.observe`) and relay limits. Relays SSE event
  by event with output timeouts, marks retries.
- Process (`pylon.settings`, `pylon.preflight`, `pylon.assemble`, `pylon.listeners`,
  `pylon.run`, `pylon.lifecycle`, `pylon.cli`): Settings built once (a setting that cannot take
  effect refuses the start with a `pylon.startup.StartupError`, one line, exit 2), files checked
  before any listener opens, each component's frozen options and the parts built in one place
  (nothing below it reads Settings), listeners started, drained on SIGTERM (a second signal ends
  the drain at once).
- Bring-up (`pylon.bringup`, `pylon.models`, `pylon.upstream.probe`): with the listeners up, the
  engine's health gate, then the published model set (static, or `/v1/models` polled, with a
  generation per appearance); `Lifecycle.readiness()` says whether and why pylon is ready.
- Operations (`pylon.admin`, `pylon.metrics`): the admin listener (`/metrics`, `/live`,
  `/ready` from `Lifecycle.readiness()`), and the Prometheus metrics, an observer beside the
  log lines.
"""

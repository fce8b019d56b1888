"""The pure core: no sockets, no clock, no settings. Values in, decisions and plans out.

`http` (header vocabulary, wire safety), `head` (one request head for every transport), `intake`
(one request's way in), `contract` (tunnel headers), `sanitize` and `plan` (what reaches the
engine; the engine's response head as the client gets it), `priority` (what an adapter may
write), `queue` (the queue gate: the live request table, its estimates and the queue entries),
`record` (what a request is observed as, and its exchange's moments: `RequestRecord`), `hooks`
(those moments as a subscriber hears them: `ExchangeHooks`), `upstream` (where an attempt goes),
`retry`, `sse`, `errors` (one taxonomy), `flood`, `kv_events` (engines' KV-cache events on ZMQ: the
one codec, decode and encode; sequence gaps), `blocks` (Dynamo's block and sequence hashes, the one
implementation; xxhash imported on first use), `values` (`static_frozen`: the per-request values,
frozen for mypy at no run-time cost).
"""

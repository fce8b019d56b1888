"""The pure core: no sockets, no clock, no settings. Values in, decisions and plans out.

`http` (header vocabulary, wire safety), `head` (one request head for every transport), `intake`
(one request's way in), `contract` (tunnel headers), `sanitize` and `plan` (what reaches the
engine), `priority` (what an adapter may write), `queue` (queue-mismatch admission: the live
request table and its estimates), `retry`, `sse`, `errors` (one taxonomy), `flood`, `kv_events`
(engines' KV-cache events on ZMQ: the one codec, decode and encode; sequence gaps), `blocks`
(Dynamo's block and sequence hashes, the one implementation; xxhash imported on first use),
`values` (`static_frozen`: the per-request values, frozen for mypy at no run-time cost).
"""

"""Mock OpenAI-compatible LLM engine (Dynamo / vLLM / SGLang flavors) that
records every request that reached it, for pylon's tests and benchmarks.

Embed with `mock_dynamo.server.start_mock`, or run the `mock-dynamo` CLI.
Inspect and steer it through `/test-control` (see `mock_dynamo.app`).

An optional engine model makes KV-aware routing testable without GPUs (`mock_dynamo.engine`;
needs the `mock-kv` extra): `--tokenizer DIR` tokenizes prompts like the engine (`tokens`),
`--kv-cache-blocks N` / `--kv-block-size B` keep an LRU prefix cache with Dynamo-exact block ids
(`kvcache`), `--prefill-tokens-per-s R` makes TTFT grow with uncached prompt tokens, and
`--kv-events-port P` publishes BlockStored / BlockRemoved / AllBlocksCleared on 127.0.0.1 in
vLLM's ZMQ wire format (`kv_publisher`; `--kv-events-encoding map` for the SGLang / Dynamo form).
"""

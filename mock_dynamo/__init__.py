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

mock_dynamo ships in the same distribution as pylon and imports pylon's pure core for what must
match the router bit for bit: Dynamo's block hashing (`pylon.core.blocks`) and the KV-event codec
(`pylon.core.kv_events`), and pylon's one tokenization (`pylon.tokenize`, which imports only
msgspec and the standard library until a model dir is loaded). That pair is checked
independently of pylon: against Dynamo 1.6.1 itself (`tests/dynamo/test_mock_kv.py`) and against
golden bytes; the tokenization against `transformers` and the Dynamo 1.6.1 frontend
(`tests/unit/test_tokenize.py`, `tests/dynamo/test_tokenize_frontend.py`).
"""

"""Mock OpenAI-compatible LLM engine (Dynamo / vLLM / SGLang flavors) that
records every request that reached it, for pylon's tests and benchmarks.

Embed with `mock_dynamo.server.start_mock`, or run the `mock-dynamo` CLI.
Inspect and steer it through `/test-control` (see `mock_dynamo.app`).
"""

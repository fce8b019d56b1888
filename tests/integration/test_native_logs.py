"""`pylon serve --routing kv`: Dynamo's native core writes its own JSON lines to stderr; pylon's
log shows them as its own `dynamo_native_log` lines, so every line on stderr has an `event`."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from tests.integration.test_cli import KV, KV_ROUTING, start_pylon


@KV
def test_the_native_cores_lines_are_pylon_lines(tokenizer_models: dict[str, Path]) -> None:
    args = ["--listen", "127.0.0.1:0", *KV_ROUTING, "--tokenizer", str(tokenizer_models["chatml"])]
    with start_pylon(*args) as proc:
        try:
            assert proc.stderr is not None
            lines: list[dict[str, Any]] = []
            while not any(line.get("event") == "listening" for line in lines):
                text = proc.stderr.readline()
                assert text, f"pylon exited: {lines}"
                lines.append(json.loads(text))
            proc.send_signal(signal.SIGTERM)
            _, rest = proc.communicate(timeout=20)
            lines += [json.loads(text) for text in rest.splitlines()]
        finally:
            proc.kill()
            proc.wait()
    assert any(line["event"] == "drained" for line in lines)
    assert all("event" in line and "timestamp" in line for line in lines), [
        line for line in lines if "event" not in line
    ]
    native = [line for line in lines if line["event"] == "dynamo_native_log"]
    # ai-dynamo-runtime 1.6.1 warns as the catalog takes each worker (DYN_LOG=warn by default).
    assert native, [line["event"] for line in lines]
    first = native[0]
    assert first["level"] == "warning" and first["target"].startswith("dynamo_")
    assert "Adding worker" in first["message"] and "native_time" in first

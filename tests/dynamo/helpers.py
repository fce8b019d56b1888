"""Helpers for the Dynamo e2e tests: tunnel headers, pins, TTFT bursts, worker attribution."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Any

import httpx

MODEL = "tiny"
REQUEST_TIMEOUT_S = 60.0
BURST_TIMEOUT_S = 90.0

_WORDS = [
    *("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda"),
    *("sigma", "omega", "import", "return", "class", "def", "while", "yield", "value"),
    *("index", "table", "buffer", "socket", "thread"),
]

HeaderList = list[tuple[str, str]]


def prompt(seed: str, words: int) -> str:
    """A prompt unique from its first token (no shared prefix with other prompts)."""
    rng = random.Random(seed)
    return f"{seed}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def tunnel_headers(extra: Sequence[tuple[str, str]] = ()) -> HeaderList:
    """The headers pylon requires on every request (fresh x-request-id), plus ``extra``."""
    return [("x-request-id", str(uuid.uuid4())), ("x-model", MODEL), *extra]


def pin_headers(worker_id: int) -> HeaderList:
    """Every worker-pinning header and alias, mixed case, several duplicated."""
    w = str(worker_id)
    return [
        ("X-Dynamo-Worker-Instance-Id", w),
        ("x-dynamo-worker-instance-id", w),
        ("X-WORKER-INSTANCE-ID", w),
        ("x-Worker-Instance-Id", w),
        ("x-Dynamo-Prefill-Instance-Id", w),
        ("X-Prefill-Instance-Id", w),
        ("x-prefill-instance-id", w),
        ("X-Dynamo-DP-Rank", "0"),
        ("x-dp-rank", "0"),
        ("X-DP-RANK", "0"),
        ("X-Data-Parallel-Rank", "0"),
        ("x-data-parallel-rank", "0"),
    ]


def body(content: str, max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


@dataclass
class Reply:
    status: int
    text: str
    ttft_s: float | None = None
    e2e_s: float = 0.0

    def json(self) -> Any:
        return json.loads(self.text)


async def post_chat(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: HeaderList
) -> Reply:
    """POST /v1/chat/completions; for streams, TTFT = first chunk carrying generated text."""
    t0 = time.monotonic()
    if not payload.get("stream"):
        r = await client.post(url + "/v1/chat/completions", json=payload, headers=headers)
        return Reply(r.status_code, r.text, None, time.monotonic() - t0)
    ttft = None
    lines: list[str] = []
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=payload, headers=headers
    ) as r:
        if r.status_code != 200:
            return Reply(r.status_code, (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            lines.append(line)
            if ttft is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        ttft = time.monotonic() - t0
                        break
    return Reply(200, "\n".join(lines), ttft, time.monotonic() - t0)


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S,
        limits=httpx.Limits(max_connections=200, max_keepalive_connections=200),
    )


@dataclass
class Burst:
    burst: list[Reply]
    late: list[Reply]

    @property
    def burst_ttft_ms(self) -> float:
        return 1000 * mean(r.ttft_s for r in self.burst if r.ttft_s is not None)

    @property
    def late_ttft_ms(self) -> float:
        return 1000 * mean(r.ttft_s for r in self.late if r.ttft_s is not None)

    @property
    def head_start(self) -> float:
        """Mean TTFT of the burst / mean TTFT of the late requests (>1: the late ones jumped)."""
        return self.burst_ttft_ms / self.late_ttft_ms

    def summary(self) -> str:
        return (
            f"burst n={len(self.burst)} mean TTFT {self.burst_ttft_ms:.0f} ms, "
            f"late n={len(self.late)} mean TTFT {self.late_ttft_ms:.0f} ms, "
            f"ratio {self.head_start:.2f}"
        )


async def _burst(
    url: str,
    late_extra_headers: HeaderList,
    late_body_extra: dict[str, Any],
    tag: str,
    n_burst: int,
    n_late: int,
    words: int,
    max_tokens: int,
    late_delay_s: float,
) -> Burst:
    async with new_client() as client:
        early = [
            asyncio.create_task(
                post_chat(
                    client,
                    url,
                    body(prompt(f"{tag}-b{i}", words), max_tokens, stream=True),
                    tunnel_headers(),
                )
            )
            for i in range(n_burst)
        ]
        await asyncio.sleep(late_delay_s)
        late = [
            asyncio.create_task(
                post_chat(
                    client,
                    url,
                    body(prompt(f"{tag}-l{i}", words), max_tokens, stream=True, **late_body_extra),
                    tunnel_headers(late_extra_headers),
                )
            )
            for i in range(n_late)
        ]
        return Burst(list(await asyncio.gather(*early)), list(await asyncio.gather(*late)))


def run_burst(
    url: str,
    late_extra_headers: HeaderList,
    late_body_extra: dict[str, Any] | None = None,
    *,
    tag: str,
    n_burst: int = 56,
    n_late: int = 6,
    words: int = 1000,
    max_tokens: int = 32,
    late_delay_s: float = 0.3,
) -> Burst:
    """A burst of long streaming requests without priority, then a few late ones (bounded)."""
    return asyncio.run(
        asyncio.wait_for(
            _burst(
                url,
                late_extra_headers,
                late_body_extra or {},
                f"{tag}-{uuid.uuid4().hex[:8]}",
                n_burst,
                n_late,
                words,
                max_tokens,
                late_delay_s,
            ),
            BURST_TIMEOUT_S,
        )
    )


async def _concurrent(
    url: str, payloads: list[dict[str, Any]], headers: list[HeaderList]
) -> list[Reply]:
    async with new_client() as client:
        return list(
            await asyncio.gather(
                *(post_chat(client, url, p, h) for p, h in zip(payloads, headers, strict=True))
            )
        )


def run_concurrent(
    url: str, payloads: list[dict[str, Any]], headers: list[HeaderList]
) -> list[Reply]:
    return asyncio.run(asyncio.wait_for(_concurrent(url, payloads, headers), BURST_TIMEOUT_S))


_RECEIVED = re.compile(r'request received request_id=([0-9a-f-]{36}).*endpoint="generate"')


def generate_request_ids(worker_log: str) -> set[str]:
    """Ids of the `generate` requests a mocker received (its log, ANSI already stripped)."""
    return set(_RECEIVED.findall(worker_log))

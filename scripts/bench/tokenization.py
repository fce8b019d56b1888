"""Micro-benchmark: what tokenizing and hashing one request costs KV-aware routing.

`pylon.tokenize.Tokenizer.prompt_tokens(path, body)` (strict JSON read, chat template, encode)
followed by `pylon.core.blocks` (content hashes of the full blocks, then their prefix chain):
everything routing does to a request before it asks the selection core. Prompts of about 1,000
tokens, block size 16. Prints median and p99 in microseconds for:

- cold chat: every request a different 1,000-token user message (nothing to reuse), with the
  segment cache and without it (`cache_tokens=0`);
- warm chat: a multi-turn conversation whose system prompt and earlier turns (about 900 tokens)
  were seen before, plus a new turn of about 100 tokens (what KV-aware routing exists for);
- cold completion (vllm dialect: one encode with the special tokens, no segment cache);
- the parts of a cold chat: the body read, the template render, the encode, the hashing.

The model dir is scripts/dynamo_stack.py's tiny offline BPE (trained here in about a second)
unless `--model-dir` names another local Hugging Face model dir.

    PYTHONPATH=. .venv/bin/python scripts/bench/tokenization.py
    PYTHONPATH=. .venv/bin/python scripts/bench/tokenization.py --iterations 3000 --model-dir DIR
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from pylon.core.blocks import block_hashes, sequence_hashes  # noqa: E402
from pylon.tokenize import CHAT_PATH, COMPLETIONS_PATH, Tokenizer  # noqa: E402

BLOCK = 16
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "request",
    "token",
    "cache",
    "block",
    "hash",
    "route",
    "worker",
    "engine",
    "prompt",
    "model",
    "server",
    "client",
    "stream",
    "value",
    "return",
    "import",
    "class",
    "def",
    "self",
    "data",
    "list",
    "dict",
    "time",
    "path",
    "file",
    "error",
    "result",
    "state",
    "event",
    "queue",
    "batch",
    "node",
    "shard",
    "table",
    "index",
    "search",
    "query",
    "weather",
    "river",
    "mountain",
    "city",
    "music",
    "paper",
    "window",
    "garden",
    "coffee",
    "bridge",
    "signal",
]


def summary(name: str, samples: list[float]) -> float:
    us = sorted(s * 1e6 for s in samples)
    p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
    median = statistics.median(us)
    print(f"{name:<62} median {median:8.1f} us   p99 {p99:8.1f} us")
    return median


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def text_of(tokenizer: Tokenizer, rng: random.Random, tokens: int) -> str:
    """Random words until the text encodes to about `tokens` tokens."""
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(32))
        text = " ".join(words)
        if len(tokenizer.encode_chat([{"role": "user", "content": text}])) >= tokens:
            return text


def chat(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 64, "messages": messages}).encode()


def route_cost(tokenizer: Tokenizer, path: str, bodies: list[bytes]) -> Callable[[], object]:
    feed: Iterator[bytes] = iter(bodies)

    def one() -> object:
        ids = tokenizer.prompt_tokens(path, next(feed))
        assert ids is not None
        return sequence_hashes(block_hashes(ids, BLOCK))

    return one


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--model-dir", type=Path, default=None)
    args = parser.parse_args()
    n = args.iterations

    with tempfile.TemporaryDirectory() as scratch:
        if args.model_dir is None:
            from dynamo_stack import build_model_dir

            model_dir = build_model_dir(Path(scratch) / "model")
        else:
            model_dir = args.model_dir
        cached = Tokenizer(model_dir, dialect="dynamo")
        uncached = Tokenizer(model_dir, dialect="dynamo", cache_tokens=0)
        vllm = Tokenizer(model_dir, dialect="vllm")
        rng = random.Random(7)

        cold = [chat([{"role": "user", "content": text_of(cached, rng, args.tokens)}])]
        # Distinct prompts of the same size: shuffled words of the first (no piece repeats).
        base: Any = json.loads(cold[0])["messages"][0]["content"].split()
        for _ in range(n - 1):
            rng.shuffle(base)
            cold.append(chat([{"role": "user", "content": " ".join(base)}]))
        sample = cached.prompt_tokens(CHAT_PATH, cold[0])
        assert sample is not None

        system = {"role": "system", "content": text_of(cached, rng, args.tokens * 3 // 10)}
        history = [
            {"role": "user", "content": text_of(cached, rng, args.tokens * 3 // 10)},
            {"role": "assistant", "content": text_of(cached, rng, args.tokens * 3 // 10)},
        ]
        turn = text_of(cached, rng, args.tokens // 10).split()
        warm = []
        for _ in range(n):
            rng.shuffle(turn)
            warm.append(chat([system, *history, {"role": "user", "content": " ".join(turn)}]))
        warm_sample = cached.prompt_tokens(CHAT_PATH, warm[0])
        assert warm_sample is not None

        completions = []
        for body in cold:
            content = json.loads(body)["messages"][0]["content"]
            completions.append(json.dumps({"model": "m", "prompt": content}).encode())

        print(
            f"model dir {model_dir}; cold chat {len(sample)} tokens, warm chat "
            f"{len(warm_sample)} tokens; block size {BLOCK}; {n} iterations"
        )
        summary(
            "cold chat: tokenize + hash, segment cache on",
            timed(route_cost(cached, CHAT_PATH, cold), n),
        )
        summary(
            "cold chat: tokenize + hash, segment cache off",
            timed(route_cost(uncached, CHAT_PATH, cold), n),
        )
        summary(
            "warm chat (new 100-token turn): tokenize + hash",
            timed(route_cost(cached, CHAT_PATH, warm), n),
        )
        summary(
            "cold completion (vllm dialect): tokenize + hash",
            timed(route_cost(vllm, COMPLETIONS_PATH, completions), n),
        )

        from pylon.tokenize.shapes import CHAT_DECODER  # the strict body read alone

        body = cold[0]
        messages = [{"role": "user", "content": json.loads(body)["messages"][0]["content"]}]
        rendered = uncached.render_chat(messages)
        summary(
            "  part: read the body (msgspec, strict)", timed(lambda: CHAT_DECODER.decode(body), n)
        )
        summary(
            "  part: render the chat template", timed(lambda: uncached.render_chat(messages), n)
        )
        summary("  part: encode (tokenizers)", timed(lambda: uncached.encode_text(rendered), n))
        summary(
            "  part: block hashes + sequence hashes",
            timed(lambda: sequence_hashes(block_hashes(sample, BLOCK)), n),
        )
        print("segment cache:", cached.segment_cache)


if __name__ == "__main__":
    main()

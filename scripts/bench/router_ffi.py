"""Micro-benchmark: what one KV-aware selection costs through router_ffi (Dynamo 1.6.1 native core).

Four workers, each with a ZMQ KV-event PUB on 127.0.0.1 and some cached prompts published to
it (so the native radix index is not empty), and 1,000-token prompts that share a prefix with
what is cached. Prints median and p99 in microseconds for:

- hashing a 1,000-token prompt: the native `compute_block_hash_for_seq`, pylon.core.blocks
  `block_hashes`, and `hash_prompt` (content hashes + prefix chain + i64, what a HashedPrompt
  carries);
- `SelectionCore.select_and_reserve`, blocking, called from a thread that runs a uvloop loop
  (how pylon's synchronous `Router.book` would call it), with a token prompt and a hashed one;
  this whole time is time that loop is stalled;
- `SelectionCore.select_and_reserve_async` awaited from a uvloop loop (the loop keeps running);
- the raw native `select_and_reserve` awaited directly in the caller's own loop (no owner
  thread): its latency and the synchronous part of the call (argument conversion + spawn), the
  part that would stall that loop;
- CPU per selection, all threads together (process CPU time over a run of blocking selections).

    PYTHONPATH=. .venv/bin/python scripts/bench/router_ffi.py
    PYTHONPATH=. .venv/bin/python scripts/bench/router_ffi.py --iterations 5000 --tokens 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402

from pylon.core.blocks import block_hashes  # noqa: E402
from pylon.core.kv_events import BlockStored, KvEventBatch, encode_message  # noqa: E402
from router_ffi import CoreWorker, SelectionCore, SelectRequest, TokenPrompt  # noqa: E402
from router_ffi.hashing import hash_prompt  # noqa: E402

BLOCK = 16
WORKERS = 4
BASE_ID = 2**63 + 77


def summary(name: str, samples: list[float]) -> None:
    us = sorted(s * 1e6 for s in samples)
    p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
    print(f"{name:<58} median {statistics.median(us):8.1f} us   p99 {p99:8.1f} us")


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def prompt(group: int, turn: int, tokens: int) -> list[int]:
    """A shared-prefix prompt: 3/4 of it is the group's prefix, the rest differs per turn."""
    prefix = (tokens * 3) // 4
    return [(group * 7919 + i) % 50_000 for i in range(prefix)] + [
        (group * 31 + turn * 131 + i) % 50_000 + 50_000 for i in range(tokens - prefix)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--cached-groups", type=int, default=64)
    args = parser.parse_args()
    n, tokens = args.iterations, args.tokens

    import zmq
    from dynamo import _core

    tok = prompt(0, 0, tokens)
    print(f"# {WORKERS} workers, {tokens}-token prompts, block size {BLOCK}, {n} iterations")
    summary(
        "hash: native compute_block_hash_for_seq",
        timed(lambda: _core.compute_block_hash_for_seq(tok, BLOCK), n),
    )
    summary("hash: pylon.core.blocks.block_hashes", timed(lambda: block_hashes(tok, BLOCK), n))
    summary(
        "hash: router_ffi.hashing.hash_prompt (chain, i64)",
        timed(lambda: hash_prompt(tok, BLOCK), n),
    )

    ctx = zmq.Context()
    pubs = []
    for _ in range(WORKERS):
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
        pubs.append(sock)
    core = SelectionCore(indexer_threads=2)
    for i, sock in enumerate(pubs):
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        core.upsert_worker(
            CoreWorker(BASE_ID + i, f"http://127.0.0.1:{9001 + i}", BLOCK, (endpoint,))
        )
    for sock in pubs:
        assert sock.poll(20_000) and sock.recv()[:1] == b"\x01"
    # Cache each group's prompt on one worker (engine block ids are arbitrary but stable).
    for group in range(args.cached_groups):
        t = prompt(group, 0, tokens)
        nb = len(t) // BLOCK
        ids = tuple(group * 10_000 + b for b in range(nb))
        event = BlockStored(ids, None, tuple(t[: nb * BLOCK]), BLOCK)
        pubs[group % WORKERS].send_multipart(
            encode_message(KvEventBatch(group // WORKERS, time.time(), (event,), 0))
        )
    last = prompt(args.cached_groups - 1, 0, tokens)
    deadline = time.monotonic() + 30
    while not any(w.device_blocks for w in core.overlap(TokenPrompt(last)).workers):
        assert time.monotonic() < deadline, "KV events never indexed"
        time.sleep(0.01)

    prompts = [
        prompt(i % args.cached_groups, 1 + i // args.cached_groups, tokens) for i in range(256)
    ]
    hashed = [hash_prompt(p, BLOCK) for p in prompts]
    probes = [core.select_and_reserve(SelectRequest(TokenPrompt(p))) for p in prompts[:32]]
    overlap = statistics.mean(r.selection.overlap_tokens for r in probes)
    for r in probes:
        r.free()
    core.quiesce()
    print(f"# mean cached overlap of the chosen worker: {overlap:.0f} of {tokens} tokens")

    async def in_loop() -> None:
        k = 0

        def select_tokens() -> None:
            nonlocal k
            k += 1
            core.select_and_reserve(SelectRequest(TokenPrompt(prompts[k % 256]))).free()

        def select_hashed() -> None:
            nonlocal k
            k += 1
            core.select_and_reserve(SelectRequest(hashed[k % 256])).free()

        timed(select_tokens, 200)  # warm-up
        summary("select_and_reserve, blocking (token prompt)", timed(select_tokens, n))
        summary("select_and_reserve, blocking (hashed prompt)", timed(select_hashed, n))
        cpu0, wall0 = time.process_time(), time.perf_counter()
        timed(select_tokens, n)
        cpu = (time.process_time() - cpu0) / n
        wall = (time.perf_counter() - wall0) / n
        label = "CPU per blocking select+free, all threads (token prompt)"
        print(f"{label:<58} {cpu * 1e6:8.1f} us   (wall {wall * 1e6:.1f} us)")

        lat = []
        cpu0 = time.thread_time()
        for i in range(n):
            t0 = time.perf_counter()
            res = await core.select_and_reserve_async(SelectRequest(TokenPrompt(prompts[i % 256])))
            lat.append(time.perf_counter() - t0)
            res.free()
        loop_cpu = (time.thread_time() - cpu0) / n
        summary("select_and_reserve_async, awaited (token prompt)", lat)
        label = "  CPU of the awaiting loop's thread per select+free"
        print(f"{label:<58} {loop_cpu * 1e6:8.1f} us")
        core.quiesce()

    uvloop.run(in_loop())
    core.shutdown()

    async def raw_native() -> None:
        service: Any = _core.SelectionService(indexer_threads=2)
        for i, sock in enumerate(pubs):
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            await service.upsert_worker(
                {
                    "worker_id": BASE_ID + i,
                    "endpoint": f"w{i}",
                    "block_size": BLOCK,
                    "kv_events_endpoint": endpoint,
                }
            )
        lat, sync = [], []
        cpu0 = time.thread_time()
        for i in range(n):
            sid = f"raw-{i}"
            t0 = time.perf_counter()
            fut = service.select_and_reserve({"token_ids": prompts[i % 256], "selection_id": sid})
            t1 = time.perf_counter()
            await fut
            lat.append(time.perf_counter() - t0)
            sync.append(t1 - t0)
            await service.free_reservation(sid)
        loop_cpu = (time.thread_time() - cpu0) / n
        summary("raw native select_and_reserve awaited in the caller's loop", lat)
        summary("  of which the synchronous call (stalls that loop)", sync)
        label = "  CPU of the awaiting loop's thread per select+free"
        print(f"{label:<58} {loop_cpu * 1e6:8.1f} us")
        service.shutdown()

    uvloop.run(raw_native())
    for sock in pubs:
        sock.close()
    ctx.term()


if __name__ == "__main__":
    main()

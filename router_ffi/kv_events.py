"""The engines' KV-event wire format (vLLM's ZMQ PUB), encoded and decoded as typed values.

The native core does not take event bytes: `SelectionService` connects its own ZMQ SUB to each
worker's PUB endpoint (`WorkerSpec.kv_events`) and reads this format itself. This module is for
whatever publishes or inspects those events on pylon's side (the mock engine's publisher, gap
detection, tests), so that they speak exactly what the native core reads.

- Three frames: `[topic, seq, payload]`; `seq` is an 8-byte big-endian u64 (gap detection);
  the topic is ignored by the reader (Dynamo subscribes to everything).
- Payload: msgpack `[ts: float, events: [...], dp_rank: int | None]`.
- Each event is either vLLM's positional array (the tag string first) or a map with a `"type"`
  tag (SGLang and the Dynamo 1.6.1 mocker). `decode` accepts both; `encode` writes either.

- `BlockStored`: positional `[tag, block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, ...]`; map fields `block_hashes`, `parent_block_hash`,
  `token_ids`, `block_size`, `medium`, `lora_name`, `cache_salt`, ...
- `BlockRemoved`: positional `[tag, block_hashes, medium, ...]`; map `block_hashes`, `medium`.
- `AllBlocksCleared`: `[tag]`; map `{"type": "AllBlocksCleared"}`.

Block hashes are the engine's own ids (full 64-bit; decoded as unsigned); the native core
rehashes `token_ids` with the event's LoRA name and cache salt, so an engine that salts its
cache must say so (`cache_salt`, which only the map form can carry).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from router_ffi.errors import RouterFfiError

U64 = 1 << 64
_seq = struct.Struct(">Q")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()

Form = Literal["array", "map"]


class KvEventError(RouterFfiError, ValueError):
    """Bytes that are not a well-formed KV-event message; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]  # engine block ids, u64
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # u32, len(block_hashes) * block_size of them
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None  # map form only
    medium: str | None = None  # GPU, CPU_PINNED, DISK, ...


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None = None


# -- encode ----------------------------------------------------------------------------------


def _event_array(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        if event.cache_salt:
            raise ValueError("a salted BlockStored needs the map form (no positional slot)")
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,  # lora_id (legacy, ignored by readers)
            event.medium,
            event.lora_name,
            None,  # extra_keys
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def _event_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
        }
        for key, value in (
            ("lora_name", event.lora_name),
            ("cache_salt", event.cache_salt),
            ("medium", event.medium),
        ):
            if value is not None:
                out[key] = value
        return out
    if isinstance(event, BlockRemoved):
        removed: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        if event.medium is not None:
            removed["medium"] = event.medium
        return removed
    return {"type": "AllBlocksCleared"}


def encode(batch: KvEventBatch, *, topic: bytes = b"", form: Form = "array") -> list[bytes]:
    """The three frames of one message (send them with `send_multipart`)."""
    if not 0 <= batch.seq < U64:
        raise ValueError(f"seq must be a u64, got {batch.seq}")
    one = _event_array if form == "array" else _event_map
    payload = _encoder.encode([batch.ts, [one(e) for e in batch.events], batch.dp_rank])
    return [topic, _seq.pack(batch.seq), payload]


# -- decode ----------------------------------------------------------------------------------


def _fail(what: str) -> KvEventError:
    return KvEventError(f"malformed KV-event message: {what}")


def _hashes(value: object, field: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _fail(f"{field} must be an array")
    out = []
    for h in value:
        if not isinstance(h, int) or isinstance(h, bool) or not -(1 << 63) <= h < U64:
            raise _fail(f"{field} must hold 64-bit integers, got {h!r}")
        out.append(h % U64)
    return tuple(out)


def _opt_hash(value: object, field: str) -> int | None:
    return None if value is None else _hashes([value], field)[0]


def _tokens(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (1 << 32) for t in value
    ):
        raise _fail("token_ids must be an array of u32")
    return tuple(value)


def _block_size(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(f"block_size must be a positive integer, got {value!r}")
    return value


def _opt_str(value: object, field: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _fail(f"{field} must be a string or null")
    return value


def _from_array(raw: list[Any]) -> KvEvent:
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 5:
            raise _fail("a positional BlockStored needs at least 5 elements")
        slot = raw + [None] * (8 - len(raw))
        return BlockStored(
            block_hashes=_hashes(raw[1], "block_hashes"),
            parent_block_hash=_opt_hash(raw[2], "parent_block_hash"),
            token_ids=_tokens(raw[3]),
            block_size=_block_size(raw[4]),
            medium=_opt_str(slot[6], "medium"),
            lora_name=_opt_str(slot[7], "lora_name"),
        )
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise _fail("a positional BlockRemoved needs its block_hashes")
        medium = raw[2] if len(raw) > 2 else None
        return BlockRemoved(_hashes(raw[1], "block_hashes"), _opt_str(medium, "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise _fail(f"unknown event tag {tag!r}")


def _from_map(raw: Mapping[str, Any]) -> KvEvent:
    tag = raw.get("type")
    if tag == "BlockStored":
        for key in ("block_hashes", "token_ids", "block_size"):
            if key not in raw:
                raise _fail(f"BlockStored without {key}")
        return BlockStored(
            block_hashes=_hashes(raw["block_hashes"], "block_hashes"),
            parent_block_hash=_opt_hash(raw.get("parent_block_hash"), "parent_block_hash"),
            token_ids=_tokens(raw["token_ids"]),
            block_size=_block_size(raw["block_size"]),
            lora_name=_opt_str(raw.get("lora_name"), "lora_name"),
            cache_salt=_opt_str(raw.get("cache_salt"), "cache_salt"),
            medium=_opt_str(raw.get("medium"), "medium"),
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in raw:
            raise _fail("BlockRemoved without block_hashes")
        return BlockRemoved(
            _hashes(raw["block_hashes"], "block_hashes"), _opt_str(raw.get("medium"), "medium")
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise _fail(f"unknown event type {tag!r}")


def decode(frames: Sequence[bytes]) -> KvEventBatch:
    """One received message (its frames) as a typed batch; `KvEventError` if malformed."""
    if len(frames) != 3:
        raise _fail(f"expected 3 frames, got {len(frames)}")
    _, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise _fail(f"the sequence frame must be 8 bytes, got {len(seq_frame)}")
    try:
        body = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise _fail(f"payload is not msgpack ({exc})") from None
    if not isinstance(body, list) or len(body) < 2:
        raise _fail("payload must be an array [ts, events, dp_rank]")
    ts, raw_events = body[0], body[1]
    dp_rank = body[2] if len(body) > 2 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise _fail("ts must be a number")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
        raise _fail("dp_rank must be an integer or null")
    if not isinstance(raw_events, list):
        raise _fail("events must be an array")
    events: list[KvEvent] = []
    for raw in raw_events:
        if isinstance(raw, list) and raw and isinstance(raw[0], str):
            events.append(_from_array(raw))
        elif isinstance(raw, dict):
            events.append(_from_map(raw))
        else:
            raise _fail("an event must be a tagged array or a map with a type")
    return KvEventBatch(
        seq=_seq.unpack(seq_frame)[0], ts=float(ts), events=tuple(events), dp_rank=dp_rank
    )

"""The engines' KV-cache events on ZMQ (vLLM's wire format), decoded and encoded, sans-I/O.

The one codec for this format: pylon decodes engines' events with it (KV-aware routing: gap
detection, its own view of the caches); mock_dynamo's publisher encodes its prefix cache's events
with it; router_ffi's tests and benchmark publish with it to Dynamo's native core (which reads the
sockets itself and takes no event bytes).

The envelope is vLLM's, which Dynamo's router also reads: exactly three frames
`[topic, seq, payload]`. `topic` is ignored (routers subscribe to everything), `seq` is an 8-byte
big-endian u64 that grows by one per message, and `payload` is msgpack
`[ts, events, data_parallel_rank]` (the rank may be absent or nil).

Each event comes in either of two encodings (`Form`); both are decoded, either is encoded:
- `array`: positional arrays, tag first (vLLM, msgspec `array_like`):
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, block_mm_infos, group_idx, ...]`,
  `["BlockRemoved", block_hashes, medium, group_idx, ...]`, `["AllBlocksCleared"]`;
  an array may end early. There is no slot for a cache salt;
- `map`: maps with a `"type"` tag (SGLang, the Dynamo 1.6.1 mocker): `{"type": "BlockStored",
  "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "lora_name",
  "cache_salt", "group_idx", ...}`; unknown keys are ignored.

Block hashes are the engine's own ids, full 64-bit values. They arrive as msgpack ints, signed
(i64) or unsigned (u64), and are returned unsigned: a negative i64 is its two's-complement u64
(Dynamo's `sequence_hashes` print the same ids as i64). vLLM with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends the digest as bytes instead; those become the
integer vLLM would have sent, the last 8 bytes read big-endian. Events with an unknown tag are
skipped and counted (`KvEventBatch.ignored`), so an engine that adds event kinds does not stop
the router.

Decoding: anything malformed raises `KvEventDecodeError` (and nothing else), with a
machine-readable `reason`. Work per message is bounded: the payload size, the event count and the
list lengths are checked against `DecodeLimits` before anything is built.

Encoding (`encode_message`, `encode_event`): hashes are written unsigned. The array form writes
a `BlockStored` through `extra_keys` (9 elements, as Dynamo's reader expects), plus
`block_mm_infos` (nil) and `group_idx` only when `group_idx` is set; a `BlockRemoved` as
`[tag, block_hashes, medium]`, plus `group_idx` when set. The map form writes the required keys
and each optional one that is not None. A salted `BlockStored` has no array form (`ValueError`).

`SequenceTracker` checks the per-worker sequence: a gap (or a restart, the sequence going back)
is returned as a `SequenceCheck` whose `stale` is true; the caller logs and counts it and treats
that worker's cache view as stale. It is one small object per worker subscription.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeLimits",
    "Form",
    "KvEvent",
    "KvEventBatch",
    "KvEventDecodeError",
    "SequenceCheck",
    "SequenceTracker",
    "decode_message",
    "decode_payload",
    "encode_event",
    "encode_message",
    "normalize_hash",
    "read_sequence",
]

U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_U32_MAX = (1 << 32) - 1
SEQ_BYTES = 8

# The two event encodings inside the envelope (see the module docstring).
Form = Literal["array", "map"]
FORMS: tuple[str, ...] = get_args(Form)


class KvEventDecodeError(ValueError):
    """A KV-event message that is not in the wire format. `reason` is a short stable code:
    `frames`, `seq`, `too_large`, `msgpack`, `batch`, `event`, `field`, `hash`, `limit`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Upper bounds on one message; anything larger is a `KvEventDecodeError` (`too_large` for
    the payload bytes, `limit` for the counts)."""

    max_payload_bytes: int = 16 * 1024 * 1024
    max_events: int = 65_536
    # Per event: block hashes, and token ids (a BlockStored carries block_size ids per block).
    max_hashes: int = 65_536
    max_token_ids: int = 1 << 22


DEFAULT_LIMITS = DecodeLimits()


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks the engine now holds. `block_hashes` are chained ids in prefix order; the first
    block's parent is `parent_hash` (None: the blocks start a sequence). `token_ids` are the
    blocks' tokens (`block_size` per block), from which a router computes content hashes."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...] | None
    block_size: int | None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the engine evicted, by the ids it announced them with."""

    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One ZMQ message: its sequence number, timestamp, DP rank and events in order."""

    seq: int
    ts: float
    events: tuple[KvEvent, ...]
    dp_rank: int | None
    topic: bytes = b""
    # Events with a tag this decoder does not know, skipped.
    ignored: int = 0


# --- decode ---------------------------------------------------------------------------------

_decoder = msgspec.msgpack.Decoder()


def decode_message(frames: Sequence[bytes], limits: DecodeLimits = DEFAULT_LIMITS) -> KvEventBatch:
    """Decode one multipart message, `[topic, seq, payload]`."""
    seq = read_sequence(frames)
    topic, _, payload = frames
    return decode_payload(payload, seq=seq, topic=bytes(topic), limits=limits)


def read_sequence(frames: Sequence[bytes]) -> int:
    """The sequence number of one multipart message, `[topic, seq, payload]`, without decoding
    its payload (what following a stream's order needs)."""
    if len(frames) != 3:
        raise KvEventDecodeError("frames", f"expected 3 frames, got {len(frames)}")
    seq_frame = frames[1]
    if len(seq_frame) != SEQ_BYTES:
        raise KvEventDecodeError(
            "seq", f"sequence frame must be {SEQ_BYTES} bytes, got {len(seq_frame)}"
        )
    return int.from_bytes(seq_frame, "big")


def decode_payload(
    payload: bytes, *, seq: int = 0, topic: bytes = b"", limits: DecodeLimits = DEFAULT_LIMITS
) -> KvEventBatch:
    """Decode the msgpack payload frame alone (`[ts, events, dp_rank]`)."""
    if len(payload) > limits.max_payload_bytes:
        raise KvEventDecodeError(
            "too_large", f"payload of {len(payload)} bytes exceeds {limits.max_payload_bytes}"
        )
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError itself for a str that is not UTF-8 (0xa1 0x80).
        raise KvEventDecodeError("msgpack", f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 3:
        raise KvEventDecodeError("batch", "payload must be an array [ts, events, dp_rank]")
    ts, events = raw[0], raw[1]
    if not _is_number(ts):
        raise KvEventDecodeError("batch", "ts must be a number")
    dp_rank = raw[2] if len(raw) == 3 else None
    if dp_rank is not None and not (_is_int(dp_rank) and 0 <= dp_rank <= _U32_MAX):
        raise KvEventDecodeError("batch", "dp_rank must be a non-negative integer or nil")
    if not isinstance(events, list):
        raise KvEventDecodeError("batch", "events must be an array")
    if len(events) > limits.max_events:
        raise KvEventDecodeError("limit", f"{len(events)} events exceed {limits.max_events}")
    decoded: list[KvEvent] = []
    ignored = 0
    for index, raw_event in enumerate(events):
        try:
            event = _decode_event(raw_event, limits)
        except KvEventDecodeError as exc:
            raise KvEventDecodeError(exc.reason, f"event {index}: {exc}") from None
        if event is None:
            ignored += 1
        else:
            decoded.append(event)
    return KvEventBatch(
        seq=seq, ts=float(ts), events=tuple(decoded), dp_rank=dp_rank, topic=topic, ignored=ignored
    )


# Positional slots (after the tag) of vLLM's array_like events.
_STORED_SLOTS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "block_mm_infos",
    "group_idx",
)
_REMOVED_SLOTS = ("block_hashes", "medium", "group_idx")


def _decode_event(raw: object, limits: DecodeLimits) -> KvEvent | None:
    tag: object
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KvEventDecodeError("event", "an array event must start with its tag string")
        tag = raw[0]
        slots = _STORED_SLOTS if tag == "BlockStored" else _REMOVED_SLOTS
        fields: dict[Any, Any] = dict(zip(slots, raw[1:], strict=False))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventDecodeError("event", "a map event must have a string 'type'")
        fields = raw
    else:
        raise KvEventDecodeError("event", "an event must be an array or a map")
    if tag == "BlockStored":
        return _stored(fields, limits)
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_hashes(fields.get("block_hashes"), limits),
            medium=_opt_str(fields, "medium"),
            group_idx=_opt_uint(fields, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _stored(fields: dict[Any, Any], limits: DecodeLimits) -> BlockStored:
    parent = fields.get("parent_block_hash")
    block_size = _opt_uint(fields, "block_size")
    if block_size == 0:
        raise KvEventDecodeError("field", "block_size must be > 0")
    return BlockStored(
        block_hashes=_hashes(fields.get("block_hashes"), limits),
        parent_hash=None if parent is None else normalize_hash(parent),
        token_ids=_token_ids(fields.get("token_ids"), limits),
        block_size=block_size,
        medium=_opt_str(fields, "medium"),
        lora_name=_opt_str(fields, "lora_name"),
        cache_salt=_opt_str(fields, "cache_salt"),
        group_idx=_opt_uint(fields, "group_idx"),
    )


def normalize_hash(value: object) -> int:
    """An engine block id as an unsigned 64-bit int (see the module docstring)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not _I64_MIN <= value <= U64_MASK:
            raise KvEventDecodeError("hash", "block hash out of the 64-bit range")
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        if len(value) < 8:
            raise KvEventDecodeError("hash", f"a bytes block hash needs 8+ bytes, got {len(value)}")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise KvEventDecodeError("hash", "a block hash must be an integer or bytes")


def _hashes(raw: object, limits: DecodeLimits) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise KvEventDecodeError("field", "block_hashes must be an array")
    if len(raw) > limits.max_hashes:
        raise KvEventDecodeError("limit", f"{len(raw)} block hashes exceed {limits.max_hashes}")
    return tuple(normalize_hash(h) for h in raw)


def _token_ids(raw: object, limits: DecodeLimits) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise KvEventDecodeError("field", "token_ids must be an array")
    if len(raw) > limits.max_token_ids:
        raise KvEventDecodeError("limit", f"{len(raw)} token ids exceed {limits.max_token_ids}")
    for token in raw:
        if not (_is_int(token) and 0 <= token <= _U32_MAX):
            raise KvEventDecodeError("field", "token ids must be integers in the u32 range")
    return tuple(raw)


def _opt_str(fields: dict[Any, Any], name: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise KvEventDecodeError("field", f"{name} must be a string or nil")


def _opt_uint(fields: dict[Any, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if _is_int(value) and 0 <= value <= _U32_MAX:
        return int(value)
    raise KvEventDecodeError("field", f"{name} must be a non-negative integer or nil")


def _is_int(value: object) -> bool:
    # msgpack has a boolean type; `true` is never a count or a hash.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return _is_int(value) or isinstance(value, float)


# --- encode ---------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()


def encode_message(batch: KvEventBatch, *, form: Form = "array") -> list[bytes]:
    """The three frames of one message, `[batch.topic, seq, payload]` (for `send_multipart`).

    `batch.ignored` is not written. `ValueError` for a seq or dp_rank out of range, or a salted
    `BlockStored` in the array form."""
    if not 0 <= batch.seq <= U64_MASK:
        raise ValueError(f"seq must be a u64, got {batch.seq}")
    if batch.dp_rank is not None and not 0 <= batch.dp_rank <= _U32_MAX:
        raise ValueError(f"dp_rank must be a u32 or None, got {batch.dp_rank}")
    one = _event_array if form == "array" else _event_map
    payload = _encoder.encode([batch.ts, [one(e) for e in batch.events], batch.dp_rank])
    return [batch.topic, batch.seq.to_bytes(SEQ_BYTES, "big"), payload]


def encode_event(event: KvEvent, form: Form = "array") -> list[Any] | dict[str, Any]:
    """One event as the msgpack-ready value of `form` (see the module docstring)."""
    return _event_array(event) if form == "array" else _event_map(event)


def _event_array(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        if event.cache_salt:
            raise ValueError("a salted BlockStored needs the map form (no positional slot)")
        out: list[Any] = [
            "BlockStored",
            list(event.block_hashes),
            event.parent_hash,
            None if event.token_ids is None else list(event.token_ids),
            event.block_size,
            None,  # lora_id (legacy, ignored by readers)
            event.medium,
            event.lora_name,
            None,  # extra_keys
        ]
        if event.group_idx is not None:
            out += [None, event.group_idx]  # block_mm_infos, group_idx
        return out
    if isinstance(event, BlockRemoved):
        removed: list[Any] = ["BlockRemoved", list(event.block_hashes), event.medium]
        if event.group_idx is not None:
            removed.append(event.group_idx)
        return removed
    return ["AllBlocksCleared"]


def _event_map(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_hash,
            "token_ids": None if event.token_ids is None else list(event.token_ids),
            "block_size": event.block_size,
        }
        for key, value in (
            ("medium", event.medium),
            ("lora_name", event.lora_name),
            ("cache_salt", event.cache_salt),
            ("group_idx", event.group_idx),
        ):
            if value is not None:
                out[key] = value
        return out
    if isinstance(event, BlockRemoved):
        removed: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
        if event.medium is not None:
            removed["medium"] = event.medium
        if event.group_idx is not None:
            removed["group_idx"] = event.group_idx
        return removed
    return {"type": "AllBlocksCleared"}


# --- sequence numbers -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SequenceCheck:
    """What one message's sequence number says about the stream.

    `first`: the first message seen; `in_order`: the expected next one; `gap`: `missed` messages
    were lost between `expected` and `received`; `regressed`: the sequence went back or repeated
    (the publisher restarted, or a duplicate). `stale` is true for a gap or a regression: the
    router's view of that worker's cache may be wrong until it is rebuilt.
    """

    kind: Literal["first", "in_order", "gap", "regressed"]
    received: int
    expected: int | None
    missed: int = 0

    @property
    def stale(self) -> bool:
        return self.kind in ("gap", "regressed")


class SequenceTracker:
    """The last sequence number seen on one worker's KV-event stream (one per subscription;
    with DP ranks on one socket, one per rank)."""

    __slots__ = ("gaps", "last", "missed", "regressions")

    def __init__(self) -> None:
        self.last: int | None = None
        self.gaps = 0
        self.missed = 0
        self.regressions = 0

    def observe(self, seq: int) -> SequenceCheck:
        last = self.last
        self.last = seq
        if last is None:
            return SequenceCheck("first", seq, None)
        expected = (last + 1) & U64_MASK
        if seq == expected:
            return SequenceCheck("in_order", seq, expected)
        if seq > expected:
            missed = seq - expected
            self.gaps += 1
            self.missed += missed
            return SequenceCheck("gap", seq, expected, missed)
        self.regressions += 1
        return SequenceCheck("regressed", seq, expected)

    def reset(self) -> None:
        """Forget the last number (after a reconnect, when the next message starts afresh)."""
        self.last = None

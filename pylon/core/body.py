"""A request body, read in time linear in its size: what pylon needs from it, and the rewrite.

Pure and synchronous like the rest of `pylon.core`, but it runs on the event loop that relays
every stream of the node, so nothing here may cost more than a few ms per MiB, for any body:

* `inspect_body` validates the whole document with msgspec, decoding only the top-level members
  pylon reads (every denied field, `nvext`, `vllm_xargs`, `stream`) and skipping the rest without
  building it: a 20 MiB message string or a million `[]` costs a scan, not a Python object each.
  A second scan counts the top-level keys, repeats included (see `_top_level_keys`), so a repeated
  `nvext` or `vllm_xargs` is seen however its name is spelt.
* `rewrite_body` re-emits only the top level (and `nvext` / `vllm_xargs`): every other value is
  copied as the client's own bytes, so integers beyond 64 bits, float spellings and escapes
  survive exactly, and nothing is re-encoded recursively.
* `with_token_data` adds pylon's own `nvext.token_data` (the prompt's token ids, for a Dynamo
  frontend) to a body the planner produced, the same way: other values keep their bytes.

Limits (docs/api-contract.md, "Body limits"): an object pylon reads member by member (the top
level, `nvext`, `vllm_xargs`) holds at most `MAX_OBJECT_MEMBERS` members, repeats included; nesting
is bounded by msgspec's recursion guard (CPython's recursion limit, about 1,000 levels by default).
Both are answered 400 `body_too_complex`; no LLM request comes near either.
"""

from __future__ import annotations

import builtins
import codecs
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, cast

import msgspec

from pylon.core.errors import BodyError, BodyFieldError, ErrorCode
from pylon.core.sanitize import DENIED_BODY_FIELDS, DENIED_NESTED_FIELDS, sanitize_body
from pylon.core.values import static_frozen

MAX_OBJECT_MEMBERS = 1024

# Top-level objects sanitize_body looks into: a repeat of one could hide a denied key from pylon
# (it reads the last of repeated keys) while an engine reads the first.
CONTAINER_KEYS: tuple[str, ...] = ("nvext", *sorted({parent for parent, _ in DENIED_NESTED_FIELDS}))

_ABSENT = msgspec.Raw()  # a present value is never empty


def _raw_fields(name: str, keys: list[str]) -> type[msgspec.Struct]:
    """A Struct reading `keys` as raw JSON text and skipping every other member unbuilt."""
    slots = [f"f{i}" for i in range(len(keys))]
    return msgspec.defstruct(
        name,
        [(slot, msgspec.Raw, _ABSENT) for slot in slots],
        rename=dict(zip(slots, keys, strict=True)),
        gc=False,
    )


# Top-level fields that choose the model the engine serves besides `model`: SGLang's `lora_path`
# picks a LoRA adapter on chat, completions and `/generate`.
MODEL_SELECTORS: tuple[str, ...] = ("lora_path",)

# Everything sanitize_body can remove or look into, `stream` and the model's fields: nothing
# else is built.
_TOP_KEYS = sorted({*DENIED_BODY_FIELDS, *CONTAINER_KEYS, *MODEL_SELECTORS, "stream", "model"})
_TOP_SLOT = {key: f"f{index}" for index, key in enumerate(_TOP_KEYS)}
_TOP_DECODER = msgspec.json.Decoder(_raw_fields("_TopLevel", _TOP_KEYS))
_RAW_DECODER = msgspec.json.Decoder(msgspec.Raw)
_ANY_DECODER = msgspec.json.Decoder()
_MEMBERS_DECODER = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENCODER = msgspec.json.Encoder()

# The key census: `{"a":1,"b":{"c":[]}}` read as the array `["a",1,"b",["c",[]]]`. Mapping the
# bytes `{ } :` to `[ ] ,` keeps every string a string of the same length (UTF-8 never uses ASCII
# bytes inside a multi-byte character) and turns each object into an array of alternating keys
# and values, so one msgspec pass over an `array_like` Struct yields the top-level keys in order,
# repeats included, decoding at most MAX_OBJECT_MEMBERS + 1 of them and skipping the rest. Only
# keys containing `{`, `}` or `:` read differently, and no name pylon looks for contains them.
_OBJECT_AS_ARRAY = bytes.maketrans(b"{}:", b"[],")


def _census_decoder(members: int) -> msgspec.json.Decoder[Any]:
    """Reads the first `members` + 1 keys of an object read as an array (one past, to see more)."""
    fields = [
        pair
        for i in range(members + 1)
        for pair in ((f"k{i}", str | None, None), (f"v{i}", msgspec.Raw, _ABSENT))
    ]
    return msgspec.json.Decoder(
        msgspec.defstruct(f"_KeyCensus{members}", fields, array_like=True, gc=False)
    )


# A Struct of 2,050 fields costs ~10 us to build: a small object (an LLM request's top level
# has a dozen members) is counted by a small census first; a large one, where ~10 us is noise and
# a second scan is not, by the full census at once.
_SMALL_CENSUS = (32, _census_decoder(32))
_FULL_CENSUS = (MAX_OBJECT_MEMBERS, _census_decoder(MAX_OBJECT_MEMBERS))
_SMALL_OBJECT_BYTES = 64 * 1024

_UTF8_CHUNK = 1 << 20


@static_frozen  # one per request: no run-time freeze (see `pylon.core.values`)
class BodyView:
    """What pylon read from a JSON object body."""

    stream: bool  # `"stream": true`; anything but true, false or null is refused (`read_stream`)
    # `builtins.object`, not `object`: the same type, spelt so that a mypyc build (see
    # docs/mypyc-notes.md) can load it for the class's __annotations__.
    model: builtins.object  # the (last) top-level `model` value, decoded; None when absent
    model_count: int  # how many top-level `model` members the body has
    stripped: tuple[str, ...]  # dotted paths the strip removes, e.g. "nvext.backend_instance_id"
    repeated: tuple[str, ...]  # CONTAINER_KEYS given more than once at the top level
    # The decoded members of `nvext` / `vllm_xargs` where they are objects (for rewrite_body).
    containers: Mapping[str, dict[str, msgspec.Raw]] = field(repr=False)
    # MODEL_SELECTORS the body sets (not null), each with its decoded value.
    selectors: tuple[tuple[str, object], ...] = ()

    @property
    def verbatim(self) -> bool:
        """Can the client's bytes go to the engine as they are (at most a member appended)?"""
        return not self.stripped and not self.repeated


def inspect_body(body: bytes) -> BodyView:
    """Validate a body that must be a JSON object; raises `BodyError` (400) otherwise."""
    if not body:
        raise BodyError("request body must be a JSON object; it is empty")
    top = _decode(_TOP_DECODER, body)
    _check_utf8(body)  # msgspec checks the strings it decodes, not the ones it skips
    plain = _plain_view(body, top)
    if plain is not None:
        return plain
    keys = _top_level_keys(body)
    fields: dict[str, Any] = {}
    for key in dict.fromkeys(keys):  # the client's order, so `stripped` lists paths as sent
        slot = _TOP_SLOT.get(key)
        if slot is not None:
            fields[key] = getattr(top, slot)  # only the few present: no tuple of all fields
    containers: dict[str, dict[str, msgspec.Raw]] = {}
    repeated: list[str] = []
    for key in CONTAINER_KEYS:
        raw = fields.get(key)
        if raw is None:
            continue
        if keys.count(key) > 1:
            repeated.append(key)
        first = memoryview(raw)[:1].tobytes()
        if first == b"{":
            fields[key] = containers[key] = object_members(bytes(raw))
        elif key == "nvext" and first != b"n":
            raise BodyError("nvext must be a JSON object", code=ErrorCode.BODY_NOT_JSON_OBJECT)
    stream = fields.get("stream")
    model = fields.get("model")
    return BodyView(
        stream=stream is not None and read_stream(bytes(stream)),
        model=None if model is None else _decode(_ANY_DECODER, bytes(model)),
        model_count=keys.count("model"),
        stripped=sanitize_body(fields).stripped,
        repeated=tuple(repeated),
        containers=containers,
        selectors=_selectors(fields, keys),
    )


def _selectors(fields: dict[str, Any], keys: list[str]) -> tuple[tuple[str, object], ...]:
    """The MODEL_SELECTORS the body sets (not null), decoded; a repeated one is refused like a
    repeated `model` (engines differ in which copy they read)."""
    found: list[tuple[str, object]] = []
    for key in MODEL_SELECTORS:
        raw = fields.get(key)
        if raw is None:
            continue
        if keys.count(key) > 1:
            raise BodyError(f"body {key} is given more than once", code=ErrorCode.MODEL_MISMATCH)
        value = _decode(_ANY_DECODER, bytes(raw))
        if value is not None:  # null: none chosen, the engine serves what `model` says
            found.append((key, value))
    return tuple(found)


_MODEL_SLOT = _TOP_SLOT["model"]
_STREAM_SLOT = _TOP_SLOT["stream"]


def _plain_view(body: bytes, top: msgspec.Struct) -> BodyView | None:
    """The view of the common body (a small object with no field pylon strips or looks into, at
    most one `model`) without the key census; None when the body may be anything else.

    Each screen below is a C scan, and each proves what the census would have found: without a
    backslash every key is spelt literally, so a `model` key repeated at the top level would put
    `"model"` in the body twice; every member, at any depth, has a colon, so the top level is
    within MAX_OBJECT_MEMBERS; and the top-level decode says no other member pylon reads is there.
    """
    if (
        len(body) >= _SMALL_OBJECT_BYTES
        or body.find(b"\\") >= 0
        or body.count(b":") > MAX_OBJECT_MEMBERS
    ):
        return None
    if body.count(b'"model"') > 1:
        return None
    model: msgspec.Raw = getattr(top, _MODEL_SLOT)
    stream: msgspec.Raw = getattr(top, _STREAM_SLOT)
    present = len(_TOP_KEYS) - msgspec.structs.astuple(top).count(_ABSENT)
    if present != bool(model) + bool(stream):
        return None  # a denied field or a container: the full reading
    # Positional, in field order (test_field_order.py pins it): keywords build a dict on 3.11.
    return BodyView(
        bool(stream) and read_stream(bytes(stream)),  # stream
        _decode(_ANY_DECODER, bytes(model)) if model else None,  # model
        1 if model else 0,  # model_count
        (),  # stripped
        (),  # repeated
        {},  # containers
    )


# The JSON texts of `stream` every engine reads as pylon does: pydantic-based engines (vLLM,
# SGLang) read it in lax mode, where `1`, `"true"`, `"on"` or `1.0` are a stream too, and
# serde-based Dynamo refuses anything but a boolean. Only these three mean the same everywhere
# (null: vLLM's default, non-streaming; SGLang refuses it itself).
_STREAM_TEXTS: dict[bytes, bool] = {b"true": True, b"false": False, b"null": False}


def read_stream(raw: bytes) -> bool:
    """Pylon's reading of a body `stream` (raw JSON text), which is the engine's reading: a
    stream only for `true`; refused (400 `body_field_invalid`) where an engine could read the
    value otherwise, since pylon times and samples a stream differently from an answer."""
    value = _STREAM_TEXTS.get(raw)
    if value is None:
        raise BodyFieldError(
            "stream", "body field stream must be true, false or null (a JSON boolean)"
        )
    return value


def rewrite_body(body: bytes, view: BodyView, priority: int | None) -> bytes:
    """The body without its denied fields (and repeated keys), other values byte for byte.

    `body` has passed `inspect_body` (which returned `view`): it is valid, and its top level is
    within MAX_OBJECT_MEMBERS. Repeated keys keep their last value, as pylon read them.
    """
    members: dict[str, Any] = _decode(_MEMBERS_DECODER, body)
    for key, value in view.containers.items():
        members[key] = value  # the same (last) occurrence msgspec gave inspect_body
    exact = sanitize_body(members).body
    if priority is not None:
        exact["priority"] = priority
    return _ENCODER.encode(exact)


def with_token_data(body: bytes, token_ids: Sequence[int]) -> bytes | None:
    """`body` (a planned JSON object) with `nvext.token_data` set to `token_ids`; every other
    value keeps its bytes. Without an `nvext`, the member is appended to the body as it is;
    with one, the top level is re-emitted, so None when that would change what else the engine
    reads: a repeated top-level key (only one copy would be kept), or an `nvext` that is not an
    object (or null). Never for an empty list (the frontend would take it as an empty
    prompt)."""
    if not token_ids:
        return None
    ids = _ENCODER.encode(token_ids)
    members: dict[str, Any] = _decode(_MEMBERS_DECODER, body)
    if "nvext" not in members:
        return append_raw_member(body, "nvext", b'{"token_data":' + ids + b"}")
    # The census counts every member, repeats included, however a name is spelt.
    if len(_top_level_keys(body)) != len(members):
        return None
    nvext = bytes(members["nvext"])
    if nvext == b"null":
        members["nvext"] = {"token_data": msgspec.Raw(ids)}
    elif nvext[:1] == b"{":
        inner: dict[str, Any] = object_members(nvext)
        inner["token_data"] = msgspec.Raw(ids)  # a client's copy never gets this far
        members["nvext"] = inner
    else:
        return None
    return _ENCODER.encode(members)


_JSON_WHITESPACE = b" \t\r\n"


def append_raw_member(body: bytes, key: str, raw: bytes) -> bytes:
    """Add `"key": <raw JSON text>` to a JSON object the caller knows has no such key."""
    # Offsets, then one join: a large body is copied once, not once per step. (`rstrip` returns
    # the body itself when nothing trails it.)
    end = len(body.rstrip(_JSON_WHITESPACE))
    assert body[end - 1 : end] == b"}", "caller passes a validated JSON object"
    inner = end - 1
    if inner and body[inner - 1] in _JSON_WHITESPACE:  # pretty-printed: space before the `}`
        inner = len(body[:inner].rstrip(_JSON_WHITESPACE))
    separator = b"" if body[inner - 1 : inner] == b"{" else b","
    member = _ENCODER.encode(key) + b":" + raw
    return b"".join((memoryview(body)[:inner], separator, member, b"}"))


def object_members(text: bytes) -> dict[str, msgspec.Raw]:
    """The members of a validated JSON object (last of repeated keys), values as raw text."""
    _top_level_keys(text)  # bound the member count before building a dict of them
    members: dict[str, msgspec.Raw] = _decode(_MEMBERS_DECODER, text)
    return members


def has_top_level_key(text: bytes, keys: tuple[str, ...]) -> bool:
    """Whether a validated JSON object has a top-level member named one of `keys` (however
    spelt: escapes decoded)."""
    return not set(keys).isdisjoint(_top_level_keys(text))


def _top_level_keys(text: bytes) -> list[str]:
    """Every key of a validated JSON object, in order and with repeats; see `_OBJECT_AS_ARRAY`."""
    array = text.translate(_OBJECT_AS_ARRAY)
    small = len(text) < _SMALL_OBJECT_BYTES
    for limit, decoder in (_SMALL_CENSUS, _FULL_CENSUS) if small else (_FULL_CENSUS,):
        try:
            census = decoder.decode(array)
        except (msgspec.MsgspecError, RecursionError):
            # Cannot happen for a validated object (the array is as valid and as deep, and
            # msgspec ignores elements past the last field); were it to, refuse, never guess.
            raise BodyError(
                "request body could not be read", code=ErrorCode.BODY_TOO_COMPLEX
            ) from None
        keys: tuple[str | None, ...] = msgspec.structs.astuple(census)[0::2]
        if keys[limit] is None:
            # A key is a string wherever the object has a member: the Nones are the tail.
            return cast(list[str], list(keys[: keys.index(None)]))
    raise BodyError(
        f"a JSON object in the request body has more than {MAX_OBJECT_MEMBERS} members",
        code=ErrorCode.BODY_TOO_COMPLEX,
    )


def _decode(decoder: msgspec.json.Decoder[Any], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError:
        # Valid JSON of another kind (it is validated first, so `[1,` still reads as invalid).
        raise BodyError(f"request body must be a JSON object, not {_json_kind(data)}") from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError("request body nests too deeply", code=ErrorCode.BODY_TOO_COMPLEX) from None


def _json_kind(data: bytes) -> str:
    first = memoryview(_decode(_RAW_DECODER, data))[:1].tobytes()
    if first == b"[":
        return "an array"
    if first == b'"':
        return "a string"
    if first == b"n":
        return "null"
    return "a scalar"


def _check_utf8(body: bytes) -> None:
    if body.isascii():
        return
    # In chunks: the decoded text is thrown away, so memory stays bounded whatever the size.
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    try:
        for start in range(0, len(body), _UTF8_CHUNK):
            decoder.decode(view[start : start + _UTF8_CHUNK])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise BodyError("request body is not valid JSON: it is not valid UTF-8") from None

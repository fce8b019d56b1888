"""pylon.core.body: the skim accepts exactly the JSON objects orjson accepted, within its limits."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import orjson
import pydantic
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core import body as body_module
from pylon.core.body import (
    _OBJECT_AS_ARRAY,
    _UTF8_CHUNK,
    CONTAINER_KEYS,
    MAX_OBJECT_MEMBERS,
    _top_level_keys,
    inspect_body,
    rewrite_body,
    with_token_data,
)
from pylon.core.errors import BodyError, BodyFieldError, ErrorCode
from pylon.core.plan import Planner, has_duplicate_keys
from pylon.core.sanitize import sanitize_body

from .helpers import tunnel
from .test_sanitize_body import body_text, json_values, key_text, planner

# --- validity: the same verdict as orjson (the parser before msgspec) ------------------------

_NOISE = [
    b'"',
    b"\\",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b" ",
    b"\\u",
    b"\\ud800",
    b"\\udc00",
    b"\\ud83d\\ude00",
    b"u",
    b"0",
    b"1",
    b"-",
    b".",
    b"e",
    b"E+",
    b"n",
    b"null",
    b"true",
    b"\x00",
    b"\x1f",
    b"\x7f",
    b"\xff",
    b"\xc3",
    b"\xc3\xa9",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xc0\x80",
    b"\xef\xbb\xbf",
    b"\t",
    b"\x0b",
]


@st.composite
def near_json(draw: st.DrawFn) -> bytes:
    """A JSON text (object or not) with a few bytes inserted, deleted or replaced."""
    value = draw(json_values | st.dictionaries(st.text(max_size=4), json_values, max_size=4))
    text = bytearray(json.dumps(value, ensure_ascii=draw(st.booleans())).encode())
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        noise = draw(st.sampled_from(_NOISE))
        if action == "insert":
            text[at:at] = noise
        elif action == "delete":
            del text[at : at + draw(st.integers(1, 3))]
        else:
            text[at : at + len(noise)] = noise
    return bytes(text)


def orjson_verdict(body: bytes) -> bool:
    """What pylon accepted before msgspec: orjson parses it to a dict, `nvext` an object or null."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        # orjson refuses numbers beyond the float range; they are valid JSON (RFC 8259 section 6)
        # and pylon now forwards them as written, the engine deciding what to make of them.
        assume("infinity" not in str(exc))
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("nvext", {}), dict | None)


def verdict(body: bytes) -> bool:
    try:
        inspect_body(body)
    except BodyError as error:
        assert error.code is ErrorCode.BODY_NOT_JSON_OBJECT, error.detail
        assert error.status == 400
        return False
    return True


@settings(max_examples=1500, deadline=None)
@given(near_json())
def test_accepts_exactly_what_orjson_accepted(body: bytes) -> None:
    assert verdict(body) == orjson_verdict(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":"\\ud800"}',
        b'{"a":["x",{"b":"\\udc00"}]}',
        b'{"a":"\\ud800\\ud800"}',
        b'{"a":{"b":"\xff"}}',
        b'{"a":["\xc3"]}',
        b'{"a":"\xed\xa0\x80"}',  # a surrogate written as UTF-8
        b'{"a":"\xc0\x80"}',  # overlong
        b'{"a":"\xf4\x90\x80\x80"}',  # beyond U+10FFFF
        b'{"a":"\x01"}',
        b'{"a":[1,]}',
        b'{"a":01}',
        b'{"a":NaN}',
        b'{"a":Infinity}',
        b'\xef\xbb\xbf{"a":1}',
        b'{"a":1}\x0b',
    ],
)
def test_invalid_anywhere_is_400(body: bytes) -> None:
    with pytest.raises(BodyError) as info:
        planner().plan(tunnel(), body)
    assert info.value.code is ErrorCode.BODY_NOT_JSON_OBJECT


def test_utf8_checked_across_chunk_boundaries() -> None:
    for shift in range(4):
        pad = b"x" * (_UTF8_CHUNK - 10 - shift)
        body = b'{"a":"' + pad + "é😀€".encode() * 4 + b'"}'
        assert planner().plan(tunnel(), body).body == body
        broken = b'{"a":"' + pad + "😀".encode()[:3] + b'"}'
        with pytest.raises(BodyError):
            planner().plan(tunnel(), broken)


def test_out_of_range_numbers_are_forwarded_as_written() -> None:
    body = b'{"temperature":1e999,"x":[-1E400]}'
    assert planner().plan(tunnel(), body).body == body
    stripped = planner().plan(tunnel(), b'{"cache_salt":"s","temperature":1e999}').body
    assert stripped == b'{"temperature":1e999}'


# --- the key census --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(body_text())
def test_census_lists_every_top_level_key_with_repeats(body: bytes) -> None:
    pairs = json.loads(body, object_pairs_hook=lambda pairs: pairs)
    # A key holding `{`, `}` or `:` reads exactly when those are escaped and translated when
    # they are written raw (see `_OBJECT_AS_ARRAY`): compare the others exactly, those by place.
    structural = set("{}:,[]")

    def masked(keys: list[str]) -> list[str | None]:
        return [None if structural & set(key) else key for key in keys]

    assert masked(_top_level_keys(body)) == masked([key for key, _ in pairs])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6), json_values), max_size=8), st.booleans())
def test_census_keys_with_structural_characters(members: list[Any], ascii_only: bool) -> None:
    members = [(key + "{:}", value) for key, value in members]
    body = (
        b"{"
        + b",".join(
            json.dumps(k, ensure_ascii=ascii_only).encode()
            + b":"
            + json.dumps(v, ensure_ascii=ascii_only).encode()
            for k, v in members
        )
        + b"}"
    )
    keys = _top_level_keys(body)
    assert len(keys) == len(members)
    assert keys == [k.translate(str.maketrans("{}:", "[],")) for k, _ in members]
    assert len(body.translate(_OBJECT_AS_ARRAY)) == len(body)


# --- what the view says ------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(body_text())
def test_view_matches_the_stdlib_reading(body: bytes) -> None:
    view = inspect_body(body)
    parsed = json.loads(body)
    pairs = json.loads(body, object_pairs_hook=lambda pairs: pairs)
    keys = [key for key, _ in pairs]
    assert view.stream is (parsed.get("stream") is True)
    assert view.stripped == sanitize_body(parsed).stripped
    assert view.repeated == tuple(k for k in CONTAINER_KEYS if keys.count(k) > 1)


@st.composite
def plain_body_text(draw: Any) -> bytes:
    """Bodies near the common shape: a model (sometimes two, sometimes nested too), stream,
    benign members, now and then a denied one, a container or an escaped key."""
    names = draw(
        st.lists(st.sampled_from(["model", "stream", "messages", "max_tokens"]), max_size=5)
    )
    names += draw(st.lists(st.sampled_from(["priority", "nvext", "vllm_xargs", "n"]), max_size=1))
    members = []
    for name in names:
        value = draw(st.sampled_from([b'"m"', b"true", b"false", b'[{"model":"x"}]', b"{}", b"1"]))
        members.append(draw(key_text(name)) + b":" + value)
    return b"{" + b",".join(draw(st.permutations(members))) + b"}"


@settings(max_examples=500, deadline=None)
@given(body_text() | plain_body_text())
def test_plain_view_is_the_census_reading(body: bytes) -> None:
    """The common small body is read without the key census; whatever it holds, the view is the
    one the census reading gives."""
    try:
        fast: Any = inspect_body(body)
    except BodyError as error:
        fast = error.code
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(body_module, "_plain_view", lambda _body, _top: None)
        try:
            full: Any = inspect_body(body)
        except BodyError as error:
            full = error.code
    assert fast == full


@settings(max_examples=300, deadline=None)
@given(body_text(), st.none() | st.integers(0, 2**31 - 1))
def test_rewrite_is_the_sanitized_object(body: bytes, priority: int | None) -> None:
    view = inspect_body(body)
    expected = sanitize_body(json.loads(body)).body
    if priority is not None:
        expected["priority"] = priority
    assert json.loads(rewrite_body(body, view, priority)) == expected


@settings(max_examples=300, deadline=None)
@given(body_text())
@example(b'{"model":"m","model":"m"}')  # body_text never repeats `model`: the refusal, once
def test_verbatim_exactly_when_nothing_is_stripped_or_repeated(body: bytes) -> None:
    pairs = json.loads(body, object_pairs_hook=lambda pairs: pairs)
    keys = [key for key, _ in pairs]
    clean = not sanitize_body(json.loads(body)).changed
    unrepeated = all(keys.count(k) < 2 for k in CONTAINER_KEYS)
    try:
        plan = planner("dynamo").plan(tunnel(), body)  # dynamo writes no body priority
    except BodyError as error:  # a repeated `model` is refused, whatever else the body holds
        assert error.code is ErrorCode.MODEL_MISMATCH and keys.count("model") > 1
        return
    assert (plan.body == body) is (clean and unrepeated)


@settings(max_examples=300, deadline=None)
@given(body_text(), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
# body_text never repeats a benign key beside an nvext: the one body token data cannot go in.
@example(b'{"model":"m","a":1,"a":2,"nvext":{}}', [7])
def test_token_data_is_added_to_the_planned_body_and_nothing_else_changes(
    body: bytes, ids: list[int]
) -> None:
    try:
        planned = planner("dynamo").plan(tunnel(), body).body
    except BodyError:
        return  # refused by the planner: never routed
    out = with_token_data(planned, ids)
    pairs = json.loads(planned, object_pairs_hook=lambda pairs: pairs)
    keys = [key for key, _ in pairs]
    if "nvext" not in keys:  # appended: the body's own bytes come first, untouched
        assert out is not None and out.startswith(planned.rstrip()[:-1].rstrip())
        member = ("nvext", [("token_data", ids)])  # objects read as their pairs, as above
        assert json.loads(out, object_pairs_hook=lambda p: p) == [*pairs, member]
        return
    nvext = json.loads(planned)["nvext"]
    if len(set(keys)) != len(keys) or not (nvext is None or isinstance(nvext, dict)):
        assert out is None  # the object cannot be re-emitted without changing it
        return
    assert out is not None
    expected = json.loads(planned)
    expected["nvext"] = {**(nvext or {}), "token_data": ids}
    assert json.loads(out) == expected
    assert not has_duplicate_keys(out)

    # Every other value keeps its bytes: the census of the output, values as raw text.
    def raw_values(text: bytes) -> dict[str, bytes]:
        return {
            k: bytes(v) for k, v in msgspec.json.decode(text, type=dict[str, msgspec.Raw]).items()
        }

    before, after = raw_values(planned), raw_values(out)
    assert {k: v for k, v in after.items() if k != "nvext"} == {
        k: v for k, v in before.items() if k != "nvext"
    }


def test_token_data_examples() -> None:
    assert with_token_data(b'{"a":1}', []) is None  # never an empty list
    assert with_token_data(b'{"a":1}', [1, 2]) == b'{"a":1,"nvext":{"token_data":[1,2]}}'
    assert with_token_data(b"{ }", [7]) == b'{"nvext":{"token_data":[7]}}'
    assert (
        with_token_data(b'{"nvext":{"ignore_eos":true},"x":1.50}', [3])
        == b'{"nvext":{"ignore_eos":true,"token_data":[3]},"x":1.50}'
    )
    assert with_token_data(b'{"nvext":null}', [3]) == b'{"nvext":{"token_data":[3]}}'
    assert with_token_data(b'{"nvext":[1]}', [3]) is None
    assert with_token_data(b'{"t":1,"t":2}', [3]) == b'{"t":1,"t":2,"nvext":{"token_data":[3]}}'
    assert with_token_data(b'{"t":1,"t":2,"nvext":{}}', [3]) is None
    assert with_token_data(b'{"{":1,"\\u007b":2,"nvext":{}}', [3]) is None  # same name


def test_rewrite_copies_values_byte_for_byte() -> None:
    values = [
        b"18446744073709551617999",
        b"-0.0",
        b"1E2",
        b"1.50000000000000000001",
        b'"caf\\u00e9 \\ud83d\\ude00 \\/ \\"q\\""',
        b'[ 1 , { "k" : [ ] } ]',
        '"é😀"'.encode(),
    ]
    body = b'{"cache_salt":"t",' + b",".join(b'"v%d" : %s' % (i, v) for i, v in enumerate(values))
    plan = planner().plan(tunnel(), body + b"}")
    expected = b"{" + b",".join(b'"v%d":%s' % (i, v) for i, v in enumerate(values)) + b"}"
    assert plan.body == expected
    assert plan.stripped == ("cache_salt",)


def test_stripped_paths_in_body_order() -> None:
    body = b'{"rid":1,"nvext":{"dp_rank":1,"x":1,"agent_hints":{}},"cache_salt":"s","priority":3}'
    plan = planner().plan(tunnel(), body)
    assert plan.stripped == (
        "rid",
        "nvext.dp_rank",
        "nvext.agent_hints",
        "cache_salt",
        "priority",
    )


# --- limits ------------------------------------------------------------------------------------


def members(n: int, repeat: bool = False) -> bytes:
    return b",".join(b'"k%d":%d' % (0 if repeat else i, i) for i in range(n))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda m: b"{" + m + b"}",
        lambda m: b'{"nvext":{' + m + b"}}",
        lambda m: b'{"vllm_xargs":{' + m + b"}}",
        lambda m: b'{"cache_salt":1,"nvext":{"dp_rank":1,' + m + b"}}",
    ],
)
def test_member_limit(wrap: Any) -> None:
    extra = 1 if wrap(b"").startswith(b'{"cache_salt') else 0  # nvext holds dp_rank too
    at_limit = wrap(members(MAX_OBJECT_MEMBERS - extra))
    planner().plan(tunnel(), at_limit)
    for over in (
        wrap(members(MAX_OBJECT_MEMBERS + 1)),
        wrap(members(MAX_OBJECT_MEMBERS + 1, repeat=True)),  # repeats count too
        wrap(members(200_000)),
    ):
        with pytest.raises(BodyError) as info:
            planner().plan(tunnel(), over)
        assert info.value.code is ErrorCode.BODY_TOO_COMPLEX
        assert info.value.status == 400


def test_members_deeper_down_are_not_limited() -> None:
    body = b'{"messages":[{' + members(50_000) + b'}],"x":{' + members(50_000) + b"}}"
    assert planner().plan(tunnel(), body).body == body


@pytest.mark.parametrize("depth", [2_000, 100_000, 1_000_000])
@pytest.mark.parametrize("open_close", [(b"[", b"]"), (b'{"a":', b"}")])
def test_deep_nesting_is_400(depth: int, open_close: tuple[bytes, bytes]) -> None:
    opening, closing = open_close
    for prefix in (b'{"x":', b'{"cache_salt":1,"x":', b'{"nvext":{"x":', b'{"vllm_xargs":{"x":'):
        body = prefix + opening * depth + b"1" + closing * depth + b"}" * prefix.count(b"{")
        with pytest.raises(BodyError) as info:
            planner().plan(tunnel(), body)
        assert info.value.code is ErrorCode.BODY_TOO_COMPLEX


def test_nesting_an_llm_request_uses_is_fine() -> None:
    deep = b"[" * 200 + b"]" * 200
    for body in (b'{"x":' + deep + b"}", b'{"cache_salt":1,"x":' + deep + b"}"):
        plan = planner().plan(tunnel(), body)
        assert json.loads(plan.body)["x"] == json.loads(deep)


def test_every_depth_gets_an_answer() -> None:
    # Around the recursion limit: accepted or a 400, never an exception that answers nothing.
    for depth in range(800, 1200, 7):
        body = b'{"cache_salt":1,"x":' + b"[" * depth + b"]" * depth + b"}"
        try:
            planner().plan(tunnel(), body)
        except BodyError as error:
            assert error.code is ErrorCode.BODY_TOO_COMPLEX


def test_member_limit_in_large_bodies() -> None:
    # Past 64 KiB the census goes straight to the full count; the limit is the same.
    value = b'"' + b"v" * 200 + b'"'
    for count, ok in ((MAX_OBJECT_MEMBERS, True), (MAX_OBJECT_MEMBERS + 1, False)):
        body = b"{" + b",".join(b'"k%d":%s' % (i, value) for i in range(count)) + b"}"
        assert len(body) > 64 * 1024
        for prefix in (b"", b'{"cache_salt":1,"nvext":'):
            text = prefix + body + b"}" * bool(prefix)
            if ok:
                planner().plan(tunnel(), text)
                continue
            with pytest.raises(BodyError) as info:
                planner().plan(tunnel(), text)
            assert info.value.code is ErrorCode.BODY_TOO_COMPLEX


# --- `stream`: pylon's reading is the engine's, or the request is refused ----------------------

# How a pydantic-based engine (vLLM: `stream: bool | None = False`) reads `stream`, in lax mode.
_ENGINE_STREAM = pydantic.TypeAdapter(bool | None)


def engine_reads_a_stream(value: object) -> bool | None:
    """True/False as the engine reads `value`; None where it refuses it itself (400 there)."""
    try:
        return bool(_ENGINE_STREAM.validate_python(value))
    except pydantic.ValidationError:
        return None


_STREAM_VALUES = (
    st.sampled_from([1, 0, 1.0, 0.0, "true", "false", "1", "0", "on", "off", "yes", "no", "t"])
    | st.sampled_from(["True", "FALSE", "y", "n", "", " true", -1, 2, 1e0, [], {}, [True]])
    | json_values
)


@settings(max_examples=400, deadline=None)
@given(_STREAM_VALUES, st.sampled_from([b"", b" ", b"\n"]))
@example(True, b"")
@example(False, b" ")
@example(None, b"")
def test_pylon_reads_stream_as_the_engine_does_or_refuses(value: object, ws: bytes) -> None:
    text = json.dumps(value).encode()
    body = b'{"model":"m","stream":' + ws + text + ws + b"}"
    engine = engine_reads_a_stream(json.loads(text))
    try:
        view = inspect_body(body)
    except BodyFieldError as refused:
        assert refused.code is ErrorCode.BODY_FIELD_INVALID and refused.field == "stream"
        assert value is not None and not isinstance(value, bool)  # only ambiguous ones
        return
    # Accepted: exactly true, false and null, read as the engine reads them.
    assert value is None or isinstance(value, bool)
    assert view.stream is bool(engine) is (value is True)
    # The plain path and the census path agree (a denied field forces the census).
    assert inspect_body(body[:-1] + b',"rid":1}').stream is view.stream


# --- repeated and escaped keys: the engine reads what pylon read, or nothing -------------------

# Top-level members pylon acts on (and a few it does not), with values that mean something.
_ACTED_ON: dict[str, list[bytes]] = {
    "stream": [b"true", b"false", b"null"],
    "model": [b'"m"', b'"other"', b"null"],
    "priority": [b"1", b"-5"],
    "lora_path": [b"null", b'"m"', b'"adapter"'],
    "messages": [b"[]"],
    "user": [b'"u"'],
}


@st.composite
def spelt_key(draw: st.DrawFn, key: str) -> bytes:
    """`key` as JSON text, each character plain or `\\u`-escaped (the same key once decoded)."""
    chars = [
        f"\\u{ord(c):04x}" if draw(st.booleans()) else c
        for c in key  # ASCII names: an escape is the only other spelling
    ]
    return ('"' + "".join(chars) + '"').encode()


@st.composite
def acted_on_bodies(draw: st.DrawFn) -> bytes:
    names = draw(st.lists(st.sampled_from(sorted(_ACTED_ON)), min_size=1, max_size=8))
    members = [
        draw(spelt_key(name)) + b":" + draw(st.sampled_from(_ACTED_ON[name])) for name in names
    ]
    return b"{" + b",".join(members) + b"}"


@settings(max_examples=400, deadline=None)
@given(acted_on_bodies(), st.sampled_from(["vllm", "sglang"]))
@example(b'{"model":"m","stream":false,"stream":true}', "vllm")
@example(b'{"model":"m","str\\u0065am":true}', "vllm")
@example(b'{"model":"m","m\\u006fdel":"other"}', "vllm")
@example(b'{"model":"m","priority":1,"pri\\u006frity":-5}', "sglang")
def test_repeated_and_escaped_keys_read_as_the_engine_reads_them(body: bytes, backend: str) -> None:
    """Whatever the repeats and spellings of `stream`, `model`, `priority` and `lora_path`, the
    engine (Python's json and pydantic: the last of repeated keys, escapes decoded) reads in
    the body pylon forwards exactly what pylon acted on, or pylon refused the body."""
    steering = Planner(build_adapter(backend, AdapterOptions(3600), derive=True))
    try:
        plan = steering.plan(tunnel(), body)
    except BodyError:
        return
    engine = json.loads(plan.body)
    assert engine["model"] == "m"  # x-model's, the model the gateway authorised
    assert engine.get("lora_path") in (None, "m")
    assert engine["priority"] == plan.priority.body_priority  # pylon's, once
    assert engine_reads_a_stream(engine.get("stream")) is plan.stream_requested

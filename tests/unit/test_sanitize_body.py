"""Body strip through Planner.plan: what the engine receives, parsed back, holds no denied field."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.errors import BodyError, ErrorCode
from pylon.core.plan import Planner, has_duplicate_keys
from pylon.core.sanitize import (
    DENIED_BODY_FIELDS,
    DENIED_NESTED_FIELDS,
    DENIED_NVEXT_FIELDS,
    sanitize_body,
)

from .helpers import WithoutModelRule, tunnel

BACKENDS = ["dynamo", "vllm", "sglang", "passthrough"]
NESTED = {
    parent: {child for (p, child) in DENIED_NESTED_FIELDS if p == parent}
    for parent, _ in DENIED_NESTED_FIELDS
}
BENIGN_TOP = [
    "model",
    "messages",
    "stream",
    "temperature",
    "max_tokens",
    "user",
    "metadata",
    "n",
    "seed",
    "logprobs",
    "stop",
    "tools",
]
BENIGN_NVEXT = ["greed_sampling", "use_raw_prompt", "max_thinking_tokens", "ignore_eos"]


def planner(backend: str = "passthrough", ceiling: int = 3600, derive: bool = True) -> Planner:
    # The strip's tests: their bodies name no model (the model rule: test_plan.py).
    adapter = build_adapter(backend, AdapterOptions(ceiling), derive=derive)
    return Planner(WithoutModelRule(adapter))


# --- JSON text generators (we write the text ourselves: escapes and duplicates) ---------------


def escaped_key(key: str, mask: list[bool]) -> bytes:
    out = []
    for ch, esc in zip(key, mask, strict=False):
        # Past the BMP a \u escape is a surrogate pair, which json.dumps spells correctly.
        escaped = f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else json.dumps(ch)[1:-1]
        out.append(escaped if esc else json.dumps(ch, ensure_ascii=False)[1:-1])
    out.extend(json.dumps(ch)[1:-1] for ch in key[len(mask) :])
    return ('"' + "".join(out) + '"').encode()


@st.composite
def key_text(draw, key: str) -> bytes:
    if draw(st.integers(0, 3)) == 0:
        return escaped_key(key, draw(st.lists(st.booleans(), max_size=len(key))))
    return json.dumps(key).encode()


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=2**64, max_value=2**100),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.dictionaries(
            st.text(max_size=6).filter(lambda k: k not in ("nvext",)), kids, max_size=3
        ),
    ),
    max_leaves=6,
)


@st.composite
def value_text(draw) -> bytes:
    return json.dumps(draw(json_values), ensure_ascii=draw(st.booleans())).encode()


@st.composite
def object_text(draw, denied: list[str], benign: list[str], min_size: int = 0) -> bytes:
    names = draw(st.lists(st.sampled_from(denied + benign), min_size=min_size, max_size=8))
    members = [draw(key_text(n)) + b":" + draw(value_text()) for n in names]
    if members and draw(st.booleans()):
        members.append(draw(st.sampled_from(members)))  # an exact duplicate member
    return b"{" + b",".join(members) + b"}"


def _top_value(name: str) -> st.SearchStrategy[bytes]:
    # `model` must name the tunnel's x-model ("m"), or the planner refuses it (model_mismatch);
    # `stream` must be a JSON boolean or null (body_field_invalid: test_body.py's own property).
    if name == "model":
        return st.just(b'"m"')
    if name == "stream":
        return st.sampled_from([b"true", b"false", b"null"])
    return value_text()


@st.composite
def body_text(draw) -> bytes:
    top = draw(st.lists(st.sampled_from(sorted(DENIED_BODY_FIELDS) + BENIGN_TOP), max_size=10))
    if top.count("model") > 1:  # a repeated model is refused outright (model_mismatch)
        first = top.index("model")
        top = [name for i, name in enumerate(top) if name != "model" or i == first]
    members = [draw(key_text(n)) + b":" + draw(_top_value(n)) for n in top]
    extra_benign = draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))
    for name in extra_benign:
        if name not in DENIED_BODY_FIELDS and name not in ("nvext", "vllm_xargs"):
            members.append(draw(key_text(name)) + b":" + draw(value_text()))
    for _ in range(draw(st.integers(0, 2))):  # 0..2 nvext objects: duplicates on purpose
        nvext = draw(object_text(sorted(DENIED_NVEXT_FIELDS), BENIGN_NVEXT))
        members.append(draw(key_text("nvext")) + b":" + nvext)
    for _ in range(draw(st.integers(0, 2))):
        xargs = draw(object_text(sorted(NESTED["vllm_xargs"]), ["temperature_hint", "tag"]))
        members.append(draw(key_text("vllm_xargs")) + b":" + xargs)
    members = draw(st.permutations(members))
    ws = draw(st.sampled_from([b"", b" ", b"\n", b"\r\n\t"]))
    return ws + b"{" + (b"," + ws).join(members) + ws + b"}" + ws


# --- the model of what must reach the engine ---------------------------------------------------


def expected_semantics(original: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in original.items():
        if key in DENIED_BODY_FIELDS:
            continue
        if key == "nvext":
            kept = {k: v for k, v in value.items() if k not in DENIED_NVEXT_FIELDS}
            if kept or not value:
                out[key] = kept
        else:  # vllm_xargs, the other container with denied members, is denied whole (above)
            out[key] = value
    return out


def all_pairs(body: bytes) -> list[tuple[str, Any]]:
    """Top-level members, every occurrence of a repeated key kept (first-wins engines see these)."""
    return json.loads(body, object_pairs_hook=lambda pairs: pairs)


@settings(max_examples=150, deadline=None)
@given(
    body=body_text(), backend=st.sampled_from(BACKENDS), rank=st.none() | st.integers(0, 2**32 - 1)
)
def test_no_denied_field_reaches_the_engine(body: bytes, backend: str, rank: int | None) -> None:
    request = tunnel(*([(b"x-priority", str(rank).encode())] if rank is not None else []))
    plan = planner(backend).plan(request, body)
    write = build_adapter(backend, AdapterOptions(3600), derive=True).derive(rank)

    pairs = all_pairs(plan.body)
    keys = [k for k, _ in pairs]
    # Every occurrence, not just the last one a dict would keep.
    for key, value in pairs:
        if key == "priority":
            continue
        assert key not in DENIED_BODY_FIELDS, key
        if key == "nvext":
            assert isinstance(value, list), "nvext stays an object"
            assert not {k for k, _ in value} & set(DENIED_NVEXT_FIELDS)
    # The other containers with denied members (vllm_xargs) are denied whole: the check above
    # covers them. One let through in part would need its members checked here.
    assert set(NESTED) <= set(DENIED_BODY_FIELDS)
    # A repeated container is always normalised (benign repeated keys may pass verbatim).
    assert keys.count("nvext") <= 1 and keys.count("vllm_xargs") <= 1

    forwarded = json.loads(plan.body)
    if write.body_priority is not None:
        assert keys.count("priority") == 1
        assert forwarded.pop("priority") == write.body_priority
    else:
        assert "priority" not in keys
    assert forwarded == expected_semantics(json.loads(body))  # huge ints exact, floats equal


@settings(max_examples=200, deadline=None)
@given(body_text())
def test_sanitize_body_is_idempotent(body: bytes) -> None:
    once = sanitize_body(json.loads(body))
    twice = sanitize_body(once.body)
    assert twice.body == once.body
    assert twice.stripped == ()


# --- nvext shape -------------------------------------------------------------------------------


def test_nvext_kept_when_benign_keys_remain() -> None:
    body = b'{"model":"m","nvext":{"backend_instance_id":7,"greed_sampling":true}}'
    plan = planner().plan(tunnel(), body)
    assert json.loads(plan.body) == {"model": "m", "nvext": {"greed_sampling": True}}
    assert "nvext.backend_instance_id" in plan.stripped


def test_nvext_removed_when_emptied_by_the_strip() -> None:
    plan = planner().plan(tunnel(), b'{"model":"m","nvext":{"agent_hints":{"priority":9}}}')
    assert json.loads(plan.body) == {"model": "m"}
    assert plan.stripped == ("nvext.agent_hints",)


def test_empty_nvext_from_the_client_stays() -> None:
    body = b'{"model":"m","nvext":{}}'
    assert planner().plan(tunnel(), body).body == body
    plan = planner().plan(tunnel(), b'{"model":"m","nvext":{},"cache_salt":"t"}')
    assert json.loads(plan.body) == {"model": "m", "nvext": {}}


def test_null_nvext_is_forwarded_as_is() -> None:
    body = b'{"nvext":null}'
    assert planner().plan(tunnel(), body).body == body


def test_vllm_xargs_goes_whole() -> None:
    """A free-form bag of engine arguments (it can carry session_id): none of it is the
    client's to set."""
    plan = planner().plan(tunnel(), b'{"vllm_xargs":{"session_id":"s","k":1},"model":"m"}')
    assert json.loads(plan.body) == {"model": "m"}
    assert plan.stripped == ("vllm_xargs",)


def test_denied_names_deeper_than_the_tables_are_content() -> None:
    body = b'{"messages":[{"role":"user","content":"x","priority":1,"nvext":{"dp_rank":1}}]}'
    assert planner().plan(tunnel(), body).body == body


# --- duplicates and escapes --------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"nvext":{"backend_instance_id":1},"nvext":{}}',
        b'{"nvext":{"dp_rank":1},"nvext":{"greed_sampling":true}}',
        b'{"\\u006evext":{"dp_rank":1},"nvext":{"greed_sampling":true}}',
        b'{"vllm_xargs":{"session_id":"s"},"vllm_xargs":{"k":1}}',
        b'{"priority":1,"priority":2}',
        b'{"\\u0070riority":9}',
        b'{"nvext":{"\\u0064p_rank":3}}',
    ],
)
def test_hidden_fields_never_survive(body: bytes) -> None:
    plan = planner().plan(tunnel(), body)
    text = plan.body.decode()
    for name in ("backend_instance_id", "dp_rank", "session_id", "priority"):
        assert f'"{name}"' not in text
    assert not has_duplicate_keys(plan.body)


def test_huge_integers_survive_a_rewrite_exactly() -> None:
    big = 2**64 + 12345
    body = f'{{"cache_salt":"x","seed":{big},"neg":-{big},"f":1.5e300}}'.encode()
    forwarded = json.loads(planner().plan(tunnel(), body).body)
    assert forwarded == {"seed": big, "neg": -big, "f": 1.5e300}


def test_unicode_survives_a_rewrite() -> None:
    body = '{"rid":"x","content":"héllo \\u2028 😀 \\ud83d\\ude00"}'.encode()
    forwarded = planner().plan(tunnel(), body).body
    assert json.loads(forwarded) == {"content": "héllo \u2028 😀 😀"}


# --- rejections --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body", [b"", b"[]", b'"s"', b"1", b"null", b"true", b"{", b"{}x", b'{"a":NaN}', b"\xff"]
)
def test_body_not_a_json_object(body: bytes) -> None:
    with pytest.raises(BodyError) as info:
        planner().plan(tunnel(), body)
    assert info.value.code is ErrorCode.BODY_NOT_JSON_OBJECT
    assert info.value.status == 400


@pytest.mark.parametrize("nvext", [b"[]", b'"x"', b"1", b"true", b'[{"dp_rank":1}]'])
def test_nvext_not_an_object(nvext: bytes) -> None:
    with pytest.raises(BodyError) as info:
        planner().plan(tunnel(), b'{"nvext":' + nvext + b"}")
    assert info.value.status == 400


def test_bodyless_get_needs_no_body() -> None:
    plan = planner("vllm").plan(tunnel(method=b"GET", target=b"/v1/models"), b"")
    assert plan.body == b""

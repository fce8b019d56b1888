"""Body strip against the golden list (tests/golden.py), judged on the bytes pylon forwards.

Every golden field is sent at its position (top level, inside `nvext`, nested), plainly, with
`\\u` escapes in its keys and with repeated keys; the forwarded bytes are parsed back keeping
every occurrence of every key (an engine may read the first of repeated keys), so the
intermediate dict of `sanitize_body` is never what is judged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.plan import ForwardPlan, Planner
from tests.golden import (
    ALL_BODY_FIELDS,
    BENIGN_BODY_FIELDS,
    BENIGN_NVEXT_FIELDS,
    BODY_FIELDS,
    NVEXT_FIELDS,
    Golden,
    enforced,
    params,
)

from .helpers import WithoutModelRule, tunnel

SENTINEL = "golden-sentinel"
BACKENDS = ("dynamo", "vllm", "sglang", "passthrough")
RANK = 7
# What pylon itself writes into the body: vLLM's priority is the rank, SGLang's is C - rank.
OWN_BODY_PRIORITY = {"vllm": RANK, "sglang": 3600 - RANK}

Path = tuple[str, ...]


# --- JSON text, written by hand (escapes and repeated keys cannot come from json.dumps) ----------


def key(name: str, escape: str = "none") -> bytes:
    """A JSON object key: plain, fully `\\u`-escaped, or with one character escaped."""
    if escape == "all":
        return ('"' + "".join(f"\\u{ord(c):04x}" for c in name) + '"').encode()
    if escape == "one":
        i = name.find("_") if "_" in name else 0
        return ('"' + name[:i] + f"\\u{ord(name[i]):04x}" + name[i + 1 :] + '"').encode()
    return json.dumps(name).encode()


def nest(parents: Path, inner: bytes, escape: str = "none") -> bytes:
    """The members `inner` inside the objects named by `parents` (the top level when empty)."""
    for name in reversed(parents):
        inner = key(name, escape) + b":{" + inner + b"}"
    return inner


def obj(*members: bytes) -> bytes:
    return b"{" + b",".join(members) + b"}"


BENIGN = (b'"model":"m"', b'"messages":[{"role":"user","content":"hi","priority":1}]')


def variants(path: Path) -> Iterator[tuple[str, bytes]]:
    """Every spelling of `path` that pylon must see through."""
    *parents, last = path

    def leaf(escape: str = "none", value: str = SENTINEL) -> bytes:
        return key(last, escape) + b":" + json.dumps(value).encode()

    def at(escape: str = "none") -> bytes:
        return nest(tuple(parents), leaf(escape), escape)

    for escape in ("none", "one", "all"):
        yield f"escape-{escape}", obj(*BENIGN, at(escape))
    # The key twice in its own object, either order.
    pair = (leaf(), leaf(value="other"))
    yield "repeated-leaf", obj(*BENIGN, nest(tuple(parents), b",".join(pair)))
    yield "repeated-leaf-reversed", obj(*BENIGN, nest(tuple(parents), b",".join(pair[::-1])))
    if not parents:
        return
    # The outermost container twice (`{"nvext": {"dp_rank": 1}, "nvext": {}}`), either order,
    # and with the first one spelt with an escape.
    outer = key(parents[0]) + b":{}"
    yield "repeated-container-first", obj(at(), outer, *BENIGN)
    yield "repeated-container-last", obj(outer, at(), *BENIGN)
    yield "repeated-container-escaped", obj(at("one"), outer, *BENIGN)
    if len(parents) > 1:  # a middle container twice (nvext.agent_hints.priority)
        middle = nest(tuple(parents[1:]), leaf()) + b"," + key(parents[1]) + b":{}"
        yield "repeated-middle", obj(*BENIGN, nest(tuple(parents[:1]), middle))


# --- reading back what the engine gets -----------------------------------------------------------


def all_paths(body: bytes) -> list[Path]:
    """Every object-key path in the document, every occurrence of a repeated key included."""
    found: list[Path] = []

    def walk(node: Any, prefix: Path) -> None:
        if isinstance(node, _Pairs):
            for name, value in node:
                found.append((*prefix, name))
                walk(value, (*prefix, name))

    walk(json.loads(body, object_pairs_hook=_Pairs), ())
    return found


class _Pairs(list[tuple[str, Any]]):
    """A JSON object as its list of members (arrays stay lists: only object paths count)."""


def plan_for(backend: str, body: bytes) -> ForwardPlan:
    planner = Planner(WithoutModelRule(build_adapter(backend, AdapterOptions(3600), derive=True)))
    return planner.plan(tunnel((b"x-priority", str(RANK).encode())), body)


def assert_never_forwarded(path: Path, backend: str, plan: ForwardPlan) -> None:
    paths = all_paths(plan.body)
    leaked = [p for p in paths if p[: len(path)] == path]
    if path == ("priority",) and backend in OWN_BODY_PRIORITY:
        # pylon's own value, exactly once: no client copy survives beside it.
        assert leaked == [("priority",)], plan.body
        assert json.loads(plan.body)["priority"] == OWN_BODY_PRIORITY[backend]
    else:
        assert leaked == [], plan.body
    assert SENTINEL.encode() not in plan.body
    assert len(paths) == len(set(paths)), "a repeated key reached the engine"


# --- per field -----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", params(ALL_BODY_FIELDS))
def test_golden_body_field_never_reaches_the_engine(entry: Golden) -> None:
    for backend in BACKENDS:
        for label, body in variants(entry.path):
            plan = plan_for(backend, body)
            try:
                assert_never_forwarded(entry.path, backend, plan)
            except AssertionError as exc:
                raise AssertionError(f"{backend}, {label}: {body!r}") from exc
            # Benign members survive (the `priority` inside `messages` is content, not control).
            assert json.loads(plan.body)["messages"][0]["priority"] == 1


@pytest.mark.parametrize("entry", params(ALL_BODY_FIELDS))
def test_golden_body_field_reported(entry: Golden) -> None:
    *parents, last = entry.path
    plan = plan_for("passthrough", obj(*BENIGN, nest(tuple(parents), key(last) + b":1")))
    reported = [tuple(s.split(".")) for s in plan.stripped]
    assert [r for r in reported if entry.path[: len(r)] == r], plan.stripped


@pytest.mark.parametrize("entry", ALL_BODY_FIELDS, ids=str)
def test_the_variants_really_carry_the_field(entry: Golden) -> None:
    # Guards the generator: every variant, decoded by a JSON parser, holds the golden path.
    for label, body in variants(entry.path):
        assert entry.path in all_paths(body), label


def test_repeated_nvext_example_from_the_brief() -> None:
    # orjson keeps the last of repeated keys: the first nvext must not ride through unseen.
    for body in (
        b'{"nvext": {"dp_rank": 1}, "nvext": {}}',
        b'{"cache\\u005fsalt": "t", "model": "m"}',
        b'{"\\u006e\\u0076\\u0065\\u0078\\u0074": {"backend_instance_id": 1}, "nvext": {}}',
    ):
        plan = plan_for("passthrough", body)
        forwarded = [p for p in all_paths(plan.body) if p[0] in ("nvext", "cache_salt")]
        assert forwarded in ([], [("nvext",)]), plan.body


# --- everything at once, with benign fields -----------------------------------------------------

_GOLDEN_TOP = [e.name for e in enforced(BODY_FIELDS)]
_GOLDEN_NVEXT = [e.path[1] for e in enforced(NVEXT_FIELDS)]
_benign_value = st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=8), st.booleans())


def members(draw: st.DrawFn, golden: list[str], benign: list[str]) -> list[tuple[str, bool, bytes]]:
    """(name, is_golden, member text): a unique set of names, in a drawn order."""
    names = draw(st.lists(st.sampled_from(golden + benign), unique=True, max_size=10))
    out = []
    for name in names:
        escape = draw(st.sampled_from(["none", "none", "one", "all"]))
        if name in golden:
            value = json.dumps(SENTINEL).encode()
        elif name == "model":
            value = b'"m"'  # must name the tunnel's x-model (model_mismatch otherwise)
        elif name == "stream":  # a JSON boolean or null (body_field_invalid otherwise)
            value = draw(st.sampled_from([b"true", b"false", b"null"]))
        else:
            value = json.dumps(draw(_benign_value)).encode()
        out.append((name, name in golden, key(name, escape) + b":" + value))
    return out


@st.composite
def mixed_body(draw: st.DrawFn) -> tuple[bytes, list[str], list[str]]:
    """A body mixing golden and benign fields, and the benign keys expected, in order."""
    top = members(draw, _GOLDEN_TOP, list(BENIGN_BODY_FIELDS))
    expected = [name for name, golden, _ in top if not golden]
    nvext_expected: list[str] = []
    if draw(st.booleans()):
        nvext = members(draw, _GOLDEN_NVEXT, list(BENIGN_NVEXT_FIELDS))
        nvext_expected = [name for name, golden, _ in nvext if not golden]
        position = draw(st.integers(0, len(top)))
        text = key("nvext", draw(st.sampled_from(["none", "one"]))) + b":"
        top.insert(position, ("nvext", False, text + obj(*(m for _, _, m in nvext))))
        if nvext_expected or not nvext:
            expected.insert(len([n for n, g, _ in top[:position] if not g]), "nvext")
    return obj(*(m for _, _, m in top)), expected, nvext_expected


@settings(max_examples=300, deadline=None)
@given(mixed_body())
def test_golden_body_mixed_with_benign(case: tuple[bytes, list[str], list[str]]) -> None:
    body, expected, nvext_expected = case
    plan = plan_for("passthrough", body)
    forwarded = json.loads(plan.body, object_pairs_hook=_Pairs)
    assert [name for name, _ in forwarded] == expected, plan.body  # order kept, no golden key
    nvext = dict(forwarded).get("nvext", _Pairs())
    assert [name for name, _ in nvext] == nvext_expected
    assert SENTINEL.encode() not in plan.body
    original = json.loads(body)
    assert {k: v for k, v in json.loads(plan.body).items() if k != "nvext"} == {
        k: original[k] for k in expected if k != "nvext"
    }

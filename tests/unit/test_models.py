"""The model catalog (generations, last good set) and the `/v1/models` parser: properties."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.assemble import build_core
from pylon.models import (
    MAX_MODELS,
    MAX_REMEMBERED_MODELS,
    ModelCatalog,
    ModelListError,
    parse_model_list,
)
from pylon.settings import load_settings

ALL_NAMES = ("a", "b", "c", "d", "llama 3", "m/x")
NAMES = st.sampled_from(ALL_NAMES)
POLLS = st.lists(st.frozensets(NAMES), max_size=30)


@given(POLLS)
def test_apply_publishes_exactly_the_list_and_reports_the_difference(
    polls: list[frozenset[str]],
) -> None:
    catalog = ModelCatalog()
    for names in polls:
        before = catalog.published
        change = catalog.apply(names)
        assert catalog.published == names
        assert {name for name, _ in change.published} == names - before
        assert {name for name, _ in change.retired} == before - names
        assert bool(change) == (names != before)
        for name, generation in change.published:
            assert catalog.generation(name) == generation
        for name in set(ALL_NAMES) - names:
            assert catalog.generation(name) is None


@given(POLLS)
def test_generation_counts_appearances_per_name(polls: list[frozenset[str]]) -> None:
    """A model's generation is how many times it appeared: it stays while the model stays
    published, and each re-appearance after a retirement is the next number."""
    catalog = ModelCatalog()
    appearances: dict[str, int] = {}
    previous: frozenset[str] = frozenset()
    for names in polls:
        for name in names - previous:
            appearances[name] = appearances.get(name, 0) + 1
        change = catalog.apply(names)
        for name, generation in change.published:
            assert generation == appearances[name]
        for name, generation in change.retired:
            assert generation == appearances[name]
        for name in names:
            assert catalog.generation(name) == appearances[name]
        previous = names


def test_empty_list_retires_everything_and_reappearance_is_a_new_generation() -> None:
    catalog = ModelCatalog()
    first = catalog.apply(["a", "b"])
    assert first.published == (("a", 1), ("b", 1)) and first.retired == ()
    assert not catalog.apply(["b", "a"])  # the same set: no change, generations kept
    gone = catalog.apply([])
    assert gone.retired == (("a", 1), ("b", 1)) and catalog.published == frozenset()
    back = catalog.apply(["b"])
    assert back.published == (("b", 2),) and catalog.generation("b") == 2
    assert catalog.generation("a") is None


def test_remembered_generations_are_bounded() -> None:
    """An engine cycling through fresh names cannot grow pylon's memory without bound: the
    oldest retired names are forgotten; published ones never are."""
    catalog = ModelCatalog()
    catalog.apply(["keep"])
    for start in range(0, MAX_REMEMBERED_MODELS + 10, 1000):
        catalog.apply(["keep", *(f"m{i}" for i in range(start, start + 1000))])
    assert len(catalog._generations) <= MAX_REMEMBERED_MODELS
    assert catalog.generation("keep") == 1


def listing(ids: list[object]) -> bytes:
    return orjson.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]})


PRINTABLE_NAME = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=40
).filter(lambda name: name.strip() != "")


@given(st.lists(PRINTABLE_NAME, max_size=20))
def test_valid_lists_give_sorted_trimmed_unique_ids(ids: list[str]) -> None:
    assert parse_model_list(listing(list(ids))) == tuple(sorted({i.strip() for i in ids}))


@st.composite
def spliced_listings(draw: st.DrawFn) -> bytes:
    """A valid model list with a few bytes cut out or put in: near misses, and now and then
    still a valid list (random bytes alone never are one)."""
    body = listing(draw(st.lists(PRINTABLE_NAME, max_size=4)))
    start = draw(st.integers(min_value=0, max_value=len(body)))
    end = draw(st.integers(min_value=start, max_value=min(len(body), start + 3)))
    return body[:start] + draw(st.binary(max_size=3)) + body[end:]


@given(st.binary(max_size=200) | spliced_listings())
def test_any_bytes_give_names_or_a_model_list_error(body: bytes) -> None:
    try:
        names = parse_model_list(body)
    except ModelListError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        assert list(names) == sorted(set(names))


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
        max_leaves=8,
    )
)
def test_any_json_gives_names_or_a_model_list_error(document: object) -> None:
    # The last one is a list of entries, each `document` as its id: now and then a valid list.
    entries = {"data": [{"id": document}, {"id": document, "object": "model"}]}
    for body in (orjson.dumps(document), orjson.dumps({"data": document}), orjson.dumps(entries)):
        try:
            names = parse_model_list(body)
        except ModelListError as exc:  # the operator's one line, and nothing else escapes
            assert str(exc) and "\n" not in str(exc)
        else:
            assert list(names) == sorted(set(names))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"object": "model", "data": []}', '"object" is "model"'),
        (b'{"object": "list"}', 'no "data" array'),
        (b'{"data": {"id": "a"}}', 'no "data" array'),
        (b'{"data": ["a"]}', 'data[0] is not an object with a string "id"'),
        (b'{"data": [{"id": 7}]}', 'data[0] is not an object with a string "id"'),
        (b'{"data": [{"id": "a"}, {"name": "b"}]}', "data[1] is not an object"),
        (b'{"data": [{"id": "  "}]}', "data[0].id is blank"),
        (listing(["caf\u00e9"]), "printable ASCII"),
        (listing(["a\tb"]), "printable ASCII"),
        (listing(["x" * 257]), "printable ASCII"),
        (listing([f"m{i}" for i in range(MAX_MODELS + 1)]), f"more than {MAX_MODELS}"),
    ],
)
def test_invalid_lists_are_refused_whole(body: bytes, reason: str) -> None:
    with pytest.raises(ModelListError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        parse_model_list(body)


def test_a_list_without_object_and_with_extra_members_is_accepted() -> None:
    body = b'{"data": [{"id": " b ", "owned_by": "x"}, {"id": "a"}, {"id": "b"}], "extra": 1}'
    assert parse_model_list(body) == ("a", "b")


def test_retire_listeners_hear_each_retired_name_once() -> None:
    catalog = ModelCatalog()
    heard: list[str] = []
    catalog.on_retire(heard.append)
    catalog.apply(["a", "b", "c"])
    assert heard == []  # publishing retires nothing
    catalog.apply(["b"])
    assert heard == ["a", "c"]
    catalog.apply(["b"])  # the same set again: no change, nothing heard
    catalog.apply([])
    assert heard == ["a", "c", "b"]


async def test_a_retired_model_loses_its_queue_measurements() -> None:
    """Wired in build_core: a model's next generation starts with no measured throughput."""
    core = build_core(load_settings({}), "http://127.0.0.1:9")
    core.queue.table.queue_for("m")
    core.lifecycle.models.apply(["m"])
    assert core.queue.table.models() == ["m"]
    core.lifecycle.models.apply([])
    assert core.queue.table.models() == []

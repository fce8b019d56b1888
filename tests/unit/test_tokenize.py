"""pylon.tokenize: a prompt's token ids exactly as the engine computes them, or a fallback.

The reference is `transformers` itself (a test-only dependency, the `dev` extra): what vLLM and
SGLang run, `AutoTokenizer.from_pretrained(dir)` with `apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)` for a chat and `tokenizer(prompt)` for a completion,
on tiny offline model dirs (tests/tokenizer_models.py). The Dynamo 1.6.1 frontend's own token ids
and Dynamo's block hashes are compared in tests/dynamo/test_tokenize.py (`dynamo` marker).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers", reason="pip install -e '.[dev]'")
pytest.importorskip("jinja2", reason="pip install -e '.[dev]'")

from pylon.tokenize import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Fallback,
    TemplateError,
    Tokenizer,
    TokenizerError,
    TokenizerUnavailable,
)
from tests.tokenizer_models import CONVERSATIONS, SPECIALS, TEXTS

Models = dict[str, Path]


@pytest.fixture(scope="module")
def transformers() -> Iterator[Any]:
    """transformers, offline (the model dirs are local; nothing may be fetched)."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield pytest.importorskip("transformers", reason="pip install -e '.[dev]'")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def references(transformers: Any, tokenizer_models: Models) -> dict[str, Any]:
    return {
        name: transformers.AutoTokenizer.from_pretrained(str(tokenizer_models[name]))
        for name in ("chatml", "chatml_bos")
    }


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages, **extra}).encode()


def completion_body(prompt: Any, **extra: Any) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, **extra}).encode()


def reference_chat(reference: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    kw.setdefault("add_generation_prompt", True)
    out = reference.apply_chat_template(messages, tokenize=True, **kw)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return list(ids)


# --- equality with transformers (vLLM and SGLang run it) ---------------------------------------


@pytest.mark.parametrize("model", ["chatml", "chatml_bos"])
@pytest.mark.parametrize("dialect", ["vllm", "sglang", "dynamo"])
def test_chats_equal_apply_chat_template(
    tokenizer_models: Models, references: dict[str, Any], model: str, dialect: Any
) -> None:
    tokenizer = Tokenizer(tokenizer_models[model], dialect=dialect)
    for messages in CONVERSATIONS:
        expected = reference_chat(references[model], messages)
        assert tokenizer.prompt_tokens(CHAT_PATH, chat_body(messages)) == expected, messages
    # add_generation_prompt: false is honoured by every engine (verified on Dynamo 1.6.1).
    messages = CONVERSATIONS[2]
    got = tokenizer.prompt_tokens(CHAT_PATH, chat_body(messages, add_generation_prompt=False))
    assert got == reference_chat(references[model], messages, add_generation_prompt=False)


@pytest.mark.parametrize("model", ["chatml", "chatml_bos"])
def test_completions_equal_the_tokenizer_call(
    tokenizer_models: Models, references: dict[str, Any], model: str
) -> None:
    reference = references[model]
    vllm = Tokenizer(tokenizer_models[model], dialect="vllm")
    sglang = Tokenizer(tokenizer_models[model], dialect="sglang")
    dynamo = Tokenizer(tokenizer_models[model], dialect="dynamo")
    for text in TEXTS:
        with_specials = list(reference(text)["input_ids"])
        without = list(reference(text, add_special_tokens=False)["input_ids"])
        assert vllm.prompt_tokens(COMPLETIONS_PATH, completion_body(text)) == with_specials
        assert sglang.prompt_tokens(COMPLETIONS_PATH, completion_body(text)) == with_specials
        # The Dynamo 1.6.1 frontend encodes a completion prompt without special tokens.
        assert dynamo.prompt_tokens(COMPLETIONS_PATH, completion_body(text)) == without
        # One prompt in a list is the same prompt.
        assert vllm.prompt_tokens(COMPLETIONS_PATH, completion_body([text])) == with_specials
    bos = reference.convert_tokens_to_ids("<s>")
    first = vllm.prompt_tokens(COMPLETIONS_PATH, completion_body("Hello"))
    assert first is not None and (first[0] == bos) == (model == "chatml_bos")


def test_text_parts_join_as_each_engine_joins_them(
    tokenizer_models: Models, references: dict[str, Any]
) -> None:
    parts = [{"type": "text", "text": "Héllo"}, {"type": "text", "text": "你好 🙂"}]
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": parts}]
    for dialect, joiner in (("vllm", "\n"), ("sglang", " "), ("dynamo", "\n")):
        tokenizer = Tokenizer(tokenizer_models["chatml"], dialect=dialect)
        flat = [messages[0], {"role": "user", "content": joiner.join(p["text"] for p in parts)}]
        expected = reference_chat(references["chatml"], flat)
        assert tokenizer.prompt_tokens(CHAT_PATH, chat_body(messages)) == expected


def test_token_id_prompts_are_taken_as_they_are(tokenizer_models: Models) -> None:
    tokenizer = Tokenizer(tokenizer_models["chatml"])
    for prompt, expected in (
        ([5, 6, 7], [5, 6, 7]),
        ([[5, 6, 7]], [5, 6, 7]),
        ([0, 2**32 - 1], [0, 2**32 - 1]),
        ([1], [1]),
    ):
        assert tokenizer.prompt_tokens(COMPLETIONS_PATH, completion_body(prompt)) == expected
    spaced = b'{"prompt": [  [ 1, 2 ]  ]}'
    assert tokenizer.prompt_tokens(COMPLETIONS_PATH, spaced) == [1, 2]


_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(list("你好世界こんにちは🙂🚀👍🏽\u0301\u0308\u200d \n\t")),
    ),
    max_size=40,
) | st.lists(st.sampled_from([*SPECIALS, "a", " b", "\n", "é", "你"]), max_size=8).map("".join)
_ROLE = st.sampled_from(["system", "user", "assistant"])
_CONVERSATION = st.lists(
    st.fixed_dictionaries({"role": _ROLE, "content": _TEXT}), min_size=1, max_size=4
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=_CONVERSATION, text=_TEXT)
def test_generated_conversations_and_prompts_equal_transformers(
    tokenizer_models: Models,
    references: dict[str, Any],
    messages: list[dict[str, Any]],
    text: str,
) -> None:
    tokenizer = _cached(tokenizer_models, "chatml_bos", "vllm")
    reference = references["chatml_bos"]
    assert tokenizer.prompt_tokens(CHAT_PATH, chat_body(messages)) == reference_chat(
        reference, messages
    )
    got = tokenizer.prompt_tokens(COMPLETIONS_PATH, completion_body(text))
    assert got == (list(reference(text)["input_ids"]) if text else None)


_TOKENIZERS: dict[tuple[str, str], Tokenizer] = {}


def _cached(models: Models, name: str, dialect: Any, **kw: Any) -> Tokenizer:
    key = (str(models[name]), f"{dialect}{sorted(kw.items())}")
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = Tokenizer(models[name], dialect=dialect, **kw)
    return _TOKENIZERS[key]


# --- the segment cache is exact -----------------------------------------------------------------


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.lists(_TEXT | st.sampled_from(SPECIALS), max_size=6).map("".join))
def test_piecewise_encoding_equals_one_encode(tokenizer_models: Models, text: str) -> None:
    """A text cut at its added tokens and encoded piece by piece (cached) is the text encoded
    at once; twice, so the second is served from the cache."""
    from tokenizers import Tokenizer as Raw

    cached = _cached(tokenizer_models, "chatml", "dynamo")
    raw = Raw.from_file(str(tokenizer_models["chatml"] / "tokenizer.json"))
    expected = raw.encode(text, add_special_tokens=False).ids
    assert cached.encode_text(text) == expected
    assert cached.encode_text(text) == expected


def test_the_cache_hits_on_a_shared_prefix_and_stays_bounded(tokenizer_models: Models) -> None:
    tokenizer = Tokenizer(tokenizer_models["chatml"], cache_tokens=64)
    system = {"role": "system", "content": "You are terse. " * 3}
    first = tokenizer.prompt_tokens(
        CHAT_PATH, chat_body([system, {"role": "user", "content": "a"}])
    )
    before = tokenizer.segment_cache
    assert first is not None and before is not None
    second = tokenizer.prompt_tokens(
        CHAT_PATH, chat_body([system, {"role": "user", "content": "b"}])
    )
    after = tokenizer.segment_cache
    assert second is not None and after is not None
    assert after["hits"] > before["hits"]
    big = {"role": "user", "content": "many words here " * 50}  # more ids than the cache holds
    uncached = Tokenizer(tokenizer_models["chatml"], cache_tokens=0)
    assert uncached.segment_cache is None
    for _ in range(2):
        body = chat_body([system, big])
        assert tokenizer.prompt_tokens(CHAT_PATH, body) == uncached.prompt_tokens(CHAT_PATH, body)
    stats = tokenizer.segment_cache
    assert stats is not None and stats["tokens"] <= 64


def test_the_cache_turns_itself_off_where_pieces_are_not_independent(
    tokenizer_models: Models,
) -> None:
    """Metaspace with prepend_scheme "first" prefixes only the piece at offset 0: encoding
    pieces alone would differ, so there is no segment cache, and the ids are the whole text's."""
    from tokenizers import Tokenizer as Raw

    tokenizer = Tokenizer(tokenizer_models["metaspace_first"], dialect="dynamo")
    assert tokenizer.segment_cache is None
    raw = Raw.from_file(str(tokenizer_models["metaspace_first"] / "tokenizer.json"))
    text = "the fox<|im_start|>the dog<|im_end|> lazy"
    whole = raw.encode(text, add_special_tokens=False).ids
    assert tokenizer.encode_text(text) == whole
    pieces = [
        *raw.encode("the fox", add_special_tokens=False).ids,
        raw.token_to_id("<|im_start|>"),
        *raw.encode("the dog", add_special_tokens=False).ids,
    ]
    assert whole[: len(pieces)] != pieces  # the guard is needed, not decorative


def test_concurrent_threads_get_the_same_ids(tokenizer_models: Models) -> None:
    tokenizer = Tokenizer(tokenizer_models["chatml"], cache_tokens=256)
    bodies = [chat_body(c) for c in CONVERSATIONS]
    expected = [tokenizer.prompt_tokens(CHAT_PATH, b) for b in bodies]
    # Each thread appends its whole run at the end: one that raised appends nothing.
    runs: list[list[list[int] | None]] = []

    def work() -> None:
        runs.append([tokenizer.prompt_tokens(CHAT_PATH, b) for _ in range(20) for b in bodies])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runs == [expected * 20] * 4


# --- what is not tokenized, and why --------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/v1/embeddings", chat_body(USER), Fallback.PATH),
        ("/v1/responses", chat_body(USER), Fallback.PATH),
        (CHAT_PATH, b"not json", Fallback.SHAPE),
        (CHAT_PATH, b"[]", Fallback.SHAPE),
        (CHAT_PATH, b'{"model": "x"}', Fallback.SHAPE),
        (CHAT_PATH, chat_body([]), Fallback.EMPTY),
        (CHAT_PATH, chat_body([{"role": "tool", "content": "x"}]), Fallback.SHAPE),
        (CHAT_PATH, chat_body([{"role": "developer", "content": "x"}]), Fallback.SHAPE),
        (CHAT_PATH, chat_body([{"role": "user", "content": "x", "name": "bob"}]), Fallback.SHAPE),
        (CHAT_PATH, chat_body([{"role": "user"}]), Fallback.SHAPE),
        (CHAT_PATH, chat_body([{"role": "user", "content": None}]), Fallback.SHAPE),
        (CHAT_PATH, chat_body([{"role": "user", "content": 5}]), Fallback.SHAPE),
        (CHAT_PATH, chat_body([{"role": "user", "content": []}]), Fallback.EMPTY),
        (
            CHAT_PATH,
            chat_body(
                [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "x"}}],
                    }
                ]
            ),
            Fallback.SHAPE,
        ),
        (
            CHAT_PATH,
            chat_body([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}, *USER]),
            Fallback.SHAPE,
        ),
        (CHAT_PATH, chat_body(USER, tools=[{"type": "function"}]), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, chat_template="{{ 1 }}"), Fallback.CONTROL),
        (
            CHAT_PATH,
            chat_body(USER, chat_template_kwargs={"enable_thinking": True}),
            Fallback.CONTROL,
        ),
        (CHAT_PATH, chat_body(USER, continue_final_message=True), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, add_special_tokens=True), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, documents=[{"text": "d"}]), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, reasoning_effort="high"), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, truncate_prompt_tokens=4), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, nvext={"use_raw_prompt": True}), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, nvext={"token_data": [1, 2]}), Fallback.CONTROL),
        (CHAT_PATH, chat_body(USER, nvext=[]), Fallback.SHAPE),
        (CHAT_PATH, chat_body(USER, add_generation_prompt="yes"), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body(["a", "b"]), Fallback.BATCH),
        (COMPLETIONS_PATH, completion_body([[1], [2]]), Fallback.BATCH),
        (COMPLETIONS_PATH, completion_body(""), Fallback.EMPTY),
        (COMPLETIONS_PATH, completion_body([]), Fallback.EMPTY),
        (COMPLETIONS_PATH, completion_body([[]]), Fallback.EMPTY),
        (COMPLETIONS_PATH, completion_body([""]), Fallback.EMPTY),
        (COMPLETIONS_PATH, completion_body([-1]), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body([2**32]), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body([True]), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body([1.0]), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body(["a", 1]), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body({"text": "a"}), Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body(None), Fallback.SHAPE),
        (COMPLETIONS_PATH, b'{"model": "x"}', Fallback.SHAPE),
        (COMPLETIONS_PATH, completion_body("a", suffix="b"), Fallback.CONTROL),
        (COMPLETIONS_PATH, completion_body("a", add_special_tokens=False), Fallback.CONTROL),
        (COMPLETIONS_PATH, completion_body("a", prompt_embeds="AAAA"), Fallback.CONTROL),
        (COMPLETIONS_PATH, completion_body("a", nvext={"use_raw_prompt": True}), Fallback.CONTROL),
    ],
)
def test_what_is_not_tokenized_says_why(
    tokenizer_models: Models, path: str, body: bytes, reason: Fallback
) -> None:
    tokenizer = _cached(tokenizer_models, "chatml", "vllm")
    assert tokenizer.tokenize(path, body) is reason
    assert tokenizer.prompt_tokens(path, body) is None


def test_nulls_are_absent_and_a_query_is_ignored(tokenizer_models: Models) -> None:
    tokenizer = _cached(tokenizer_models, "chatml", "vllm")
    plain = tokenizer.prompt_tokens(CHAT_PATH, chat_body(USER))
    assert plain is not None
    nulls = chat_body(USER, tools=None, chat_template=None, nvext={"use_raw_prompt": None})
    assert tokenizer.prompt_tokens(CHAT_PATH, nulls) == plain
    assert tokenizer.prompt_tokens(CHAT_PATH + "?x=1", chat_body(USER)) == plain
    # Fields that do not change the prompt are fine, tool_choice without tools too.
    body = chat_body(USER, temperature=0, stream=True, tool_choice="none", nvext={"x": 1})
    assert tokenizer.prompt_tokens(CHAT_PATH, body) == plain


def test_limits(tokenizer_models: Models) -> None:
    small = Tokenizer(tokenizer_models["chatml"], max_body_bytes=100, max_prompt_tokens=8)
    assert small.tokenize(CHAT_PATH, chat_body([{"role": "user", "content": "x" * 100}])) is (
        Fallback.TOO_LARGE
    )
    assert small.tokenize(CHAT_PATH, chat_body(USER)) is Fallback.TOO_MANY_TOKENS
    assert small.tokenize(COMPLETIONS_PATH, completion_body(list(range(9)))) is (
        Fallback.TOO_MANY_TOKENS
    )
    assert small.prompt_tokens(COMPLETIONS_PATH, completion_body(list(range(8)))) == list(range(8))
    with pytest.raises(ValueError):
        Tokenizer(tokenizer_models["chatml"], max_prompt_tokens=0)
    with pytest.raises(ValueError):
        Tokenizer(tokenizer_models["chatml"], dialect="trtllm")  # type: ignore[arg-type]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from([CHAT_PATH, COMPLETIONS_PATH]),
    body=st.binary(max_size=200)
    | st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(["messages", "prompt", "role", "content", "type", "text", "nvext"]),
                inner,
                max_size=4,
            )
        ),
        max_leaves=20,
    ).map(lambda value: json.dumps(value).encode()),
)
def test_any_body_gives_ids_or_a_reason_and_never_raises(
    tokenizer_models: Models, path: str, body: bytes
) -> None:
    result = _cached(tokenizer_models, "chatml", "vllm").tokenize(path, body)
    assert isinstance(result, Fallback) or all(isinstance(t, int) for t in result)


# --- templates ------------------------------------------------------------------------------------


def write_dir(root: Path, base: Path, **config: Any) -> Path:
    root.mkdir()
    (root / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def test_template_errors_fall_back_and_raise_in_the_low_level_call(
    tokenizer_models: Models, tmp_path: Path
) -> None:
    model = write_dir(
        tmp_path / "m",
        tokenizer_models["chatml"],
        chat_template=(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ),
    )
    tokenizer = Tokenizer(model)
    system = [{"role": "system", "content": "x"}]
    assert tokenizer.tokenize(CHAT_PATH, chat_body(system)) is Fallback.TEMPLATE_ERROR
    with pytest.raises(TemplateError, match="no system"):
        tokenizer.encode_chat(system)
    assert tokenizer.prompt_tokens(CHAT_PATH, chat_body(USER)) is not None


def test_the_sandbox_and_transformers_extras(tokenizer_models: Models, tmp_path: Path) -> None:
    base = tokenizer_models["chatml"]
    escape = write_dir(
        tmp_path / "escape", base, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"
    )
    assert Tokenizer(escape).tokenize(CHAT_PATH, chat_body(USER)) is Fallback.TEMPLATE_ERROR
    ns = write_dir(tmp_path / "ns", base, chat_template="{% set n = namespace(_x=1) %}{{ n._x }}")
    assert Tokenizer(ns).tokenize(CHAT_PATH, chat_body(USER)) is Fallback.TEMPLATE_ERROR
    extras = write_dir(
        tmp_path / "extras",
        base,
        bos_token="<s>",
        chat_template=(
            "{{ bos_token }}{% for m in messages %}{% generation %}{{ m | tojson }}"
            "{% endgeneration %}{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
            "{% set n = namespace(count=0) %}{% set n.count = n.count + 1 %}{{ n.count }}"
        ),
    )
    tokenizer = Tokenizer(extras)
    rendered = tokenizer.render_chat([{"role": "user", "content": "é 你好"}])
    assert rendered == '<s>{"role": "user", "content": "é 你好"}1'  # tojson keeps non-ASCII


def test_template_content_formats(tokenizer_models: Models, references: dict[str, Any]) -> None:
    """A template that iterates over content parts: vLLM would wrap every content in parts,
    so under vllm no chat is tokenized; under sglang and dynamo a string content is as is."""
    del references
    parts = tokenizer_models["parts"]
    vllm = Tokenizer(parts, dialect="vllm")
    assert vllm.content_format == "openai"
    assert vllm.tokenize(CHAT_PATH, chat_body(USER)) is Fallback.CONTENT_FORMAT
    sglang = Tokenizer(parts, dialect="sglang")
    assert sglang.prompt_tokens(CHAT_PATH, chat_body(USER)) == sglang.encode_chat(USER)
    listed = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    assert sglang.tokenize(CHAT_PATH, chat_body(listed)) is Fallback.CONTENT_FORMAT
    assert Tokenizer(tokenizer_models["chatml"]).content_format == "string"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for p in m['content'] %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m.content | list %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% set c = m['content'] %}"
            "{% for p in c %}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m['content'][1:] %}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{{ messages[0]['content'] }} an image", "openai"),
    ],
)
def test_content_format_detection(template: str, expected: str) -> None:
    from jinja2 import Environment

    from pylon.tokenize import detect_content_format

    assert detect_content_format(template, Environment().parse(template)) == expected


# --- loading ------------------------------------------------------------------------------------


def test_load_errors_are_one_line(tokenizer_models: Models, tmp_path: Path) -> None:
    base = tokenizer_models["chatml"]
    cases: list[tuple[Path, str]] = []
    cases.append((tmp_path / "missing", "is not a directory"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "has no tokenizer.json"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "tokenizer.json").write_text("{not json")
    cases.append((corrupt, "cannot read"))
    bad_config = write_dir(tmp_path / "bad_config", base)
    (bad_config / "tokenizer_config.json").write_text("[1, 2]")
    cases.append((bad_config, "must hold a JSON object"))
    syntax = write_dir(tmp_path / "syntax", base, chat_template="{% for %}")
    cases.append((syntax, "the chat template does not compile"))
    two = write_dir(tmp_path / "two", base, chat_template="{{ 1 }}")
    (two / "chat_template.jinja").write_text("{{ 2 }}")
    cases.append((two, "different chat templates"))
    for directory, needle in cases:
        with pytest.raises(TokenizerError) as refused:
            Tokenizer(directory)
        message = str(refused.value)
        assert needle in message and "\n" not in message, message


def test_template_sources(tokenizer_models: Models, tmp_path: Path) -> None:
    base = tokenizer_models["chatml"]
    jinja_only = write_dir(tmp_path / "jinja", base)
    (jinja_only / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer(jinja_only).render_chat(USER) == "hi!"
    same = write_dir(tmp_path / "same", base, chat_template="{{ 1 }}")
    (same / "chat_template.jinja").write_text("{{ 1 }}")
    assert Tokenizer(same).render_chat(USER) == "1"
    named = write_dir(
        tmp_path / "named",
        base,
        chat_template=[
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ],
    )
    assert Tokenizer(named).render_chat(USER) == "D"
    bare = write_dir(tmp_path / "bare", base)
    tokenizer = Tokenizer(bare)
    assert not tokenizer.has_chat_template
    assert tokenizer.tokenize(CHAT_PATH, chat_body(USER)) is Fallback.NO_TEMPLATE
    assert tokenizer.prompt_tokens(COMPLETIONS_PATH, completion_body("hi")) is not None


def test_a_dir_that_disagrees_with_itself_on_bos_falls_back_for_completions(
    tokenizer_models: Models, tmp_path: Path
) -> None:
    """tokenizer.json adds BOS, tokenizer_config.json says add_bos_token: false: transformers
    versions and classes differ on which wins, so completions are not tokenized (vllm);
    chats are (no special tokens are added to them), and Dynamo reads tokenizer.json only."""
    model = tmp_path / "disagree"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tokenizer_models["chatml_bos"] / name).read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    vllm = Tokenizer(model, dialect="vllm")
    assert vllm.tokenize(COMPLETIONS_PATH, completion_body("hi")) is Fallback.SPECIAL_TOKENS
    assert vllm.prompt_tokens(CHAT_PATH, chat_body(USER)) is not None
    assert Tokenizer(model, dialect="dynamo").prompt_tokens(COMPLETIONS_PATH, completion_body("hi"))


def test_missing_special_tokens_are_added_as_transformers_adds_them(
    tokenizer_models: Models, tmp_path: Path, references: dict[str, Any], transformers: Any
) -> None:
    """A named special token tokenizer.json lacks: transformers (vLLM, SGLang) adds it as a
    special token, and so does pylon in their dialects."""
    model = write_dir(
        tmp_path / "extra",
        tokenizer_models["chatml"],
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        chat_template="{% for m in messages %}{{ m['content'] }}{{ pad_token }}{% endfor %}",
    )
    del references
    reference = transformers.AutoTokenizer.from_pretrained(str(model))
    messages = [{"role": "user", "content": "a <|pad|> b"}]
    vllm = Tokenizer(model, dialect="vllm")
    assert vllm.prompt_tokens(CHAT_PATH, chat_body(messages)) == reference_chat(reference, messages)


NO_PACKAGES = """
import sys
sys.modules[{module!r}] = None
from pylon.tokenize import Tokenizer, TokenizerUnavailable
try:
    Tokenizer({directory!r})
except TokenizerUnavailable as exc:
    print(exc.package)
"""


@pytest.mark.parametrize(
    ("module", "package"), [("tokenizers", "tokenizers"), ("jinja2", "jinja2")]
)
def test_a_missing_package_is_named(tokenizer_models: Models, module: str, package: str) -> None:
    import subprocess

    code = NO_PACKAGES.format(module=module, directory=str(tokenizer_models["chatml"]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == package
    assert issubclass(TokenizerUnavailable, TokenizerError)

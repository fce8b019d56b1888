"""The mock's engine model, pure: the LRU prefix cache and its events, tokenizers, the prefill
lane. (Its block ids are pylon.core.blocks' hashes: tests/unit/test_blocks.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

xxhash = pytest.importorskip("xxhash", reason="pip install -e '.[mock-kv]'")

from mock_dynamo.config import MockConfig  # noqa: E402
from mock_dynamo.engine import EngineModel, cache_salt  # noqa: E402
from mock_dynamo.kvcache import PrefixCache  # noqa: E402
from mock_dynamo.tokens import WordTokenizer, load_tokenizer, prompts, word_id  # noqa: E402
from pylon.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from tests.mock_dynamo.kv_helpers import make_model_dir, reference_ids  # noqa: E402

BS = 4


def test_block_ids_are_dynamos_chained_block_hashes() -> None:
    # Dynamo 1.6.1 printed these `sequence_hashes` (as i64) for tokens 100..147, block size 16.
    cache = PrefixCache(16, 10)
    _, events = cache.admit(list(range(100, 148)))
    printed_i64 = [-7623552809318391097, 4102179227871607950, -36008782455231298]
    assert cache.block_ids() == [h % (1 << 64) for h in reversed(printed_i64)]
    [stored] = events
    assert isinstance(stored, BlockStored)
    assert list(stored.block_hashes) == [h % (1 << 64) for h in printed_i64]


def test_a_partial_trailing_block_is_not_cached_and_a_salt_changes_every_id() -> None:
    cache = PrefixCache(BS, 100)
    tokens = list(range(10))
    _, plain = cache.admit(tokens)
    _, salted = cache.admit(tokens, "tenant")
    assert plain == [BlockStored(tuple(reference_ids(tokens, BS)), None, tuple(tokens[:8]), BS)]
    assert isinstance(salted[0], BlockStored) and salted[0].cache_salt == "tenant"
    assert not set(plain[0].block_hashes) & set(salted[0].block_hashes)


def test_hits_misses_and_the_last_token_rule() -> None:
    cache = PrefixCache(BS, 100)
    tokens = list(range(16))  # 4 full blocks
    first, events = cache.admit(tokens)
    assert (first.cached_tokens, first.hit_blocks, first.miss_blocks) == (0, 0, 4)
    ids = reference_ids(tokens, BS)
    assert events == [BlockStored(tuple(ids), None, tuple(tokens), BS)]
    # The same prompt again: every block is cached, but the last token is always recomputed,
    # so the last block is a miss (vLLM: a 640-token prompt hits 624).
    again, events = cache.admit(tokens)
    assert (again.cached_tokens, again.hit_blocks, again.miss_blocks) == (12, 3, 1)
    assert events == []
    # A longer prompt with the same prefix hits all four and stores the rest under its parent.
    longer = [*tokens, *range(100, 106)]
    more, events = cache.admit(longer)
    assert (more.cached_tokens, more.hit_blocks, more.miss_blocks, more.prompt_tokens) == (
        16,
        4,
        1,
        22,
    )
    new_ids = reference_ids(longer, BS)
    assert events == [BlockStored((new_ids[4],), ids[3], tuple(longer[16:20]), BS)]
    view = cache.view()
    assert (view["requests"], view["hits"], view["misses"], view["blocks"]) == (3, 7, 6, 5)
    assert view["hit_rate"] == pytest.approx(7 / 13)
    assert view["token_hit_rate"] == pytest.approx(28 / 54)


def test_lru_evicts_tails_first_with_one_removed_event_per_block() -> None:
    cache = PrefixCache(BS, 4)
    a, b = list(range(8)), list(range(50, 58))
    cache.admit(a)
    cache.admit(b)
    ids_a, ids_b = reference_ids(a, BS), reference_ids(b, BS)
    # Touching a makes b the least recently used; b's tail goes before its head.
    cache.admit(a)
    c = list(range(90, 94))
    admission, events = cache.admit(c)
    assert events == [
        BlockRemoved((ids_b[1],)),
        BlockStored(tuple(reference_ids(c, BS)), None, tuple(c), BS),
    ]
    assert admission.evicted_blocks == 1
    assert ids_b[0] in cache and ids_b[1] not in cache
    assert all(i in cache for i in ids_a)


def test_a_prompt_longer_than_the_cache_stores_its_head_only() -> None:
    cache = PrefixCache(BS, 2)
    tokens = list(range(20))  # 5 blocks, room for 2
    admission, events = cache.admit(tokens)
    ids = reference_ids(tokens, BS)
    assert admission.stored_blocks == 2
    assert events == [BlockStored((ids[0], ids[1]), None, tuple(tokens[:8]), BS)]
    again, events = cache.admit(tokens)
    assert (again.hit_blocks, again.miss_blocks, again.stored_blocks) == (2, 3, 0)
    assert events == []


def test_blocks_of_the_request_being_admitted_are_not_evicted_for_it() -> None:
    cache = PrefixCache(BS, 3)
    head = list(range(8))
    cache.admit(head)
    cache.admit(list(range(40, 44)))  # fills the cache; head is now older
    admission, events = cache.admit([*head, *range(60, 64)])
    assert admission.hit_blocks == 2
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]
    assert all(i in cache for i in reference_ids([*head, *range(60, 64)], BS))


def test_salted_prompts_share_blocks_only_with_the_same_salt() -> None:
    cache = PrefixCache(BS, 100)
    tokens = list(range(12))
    _, events = cache.admit(tokens, "t1")
    assert events == [
        BlockStored(
            tuple(reference_ids(tokens, BS, "t1")), None, tuple(tokens), BS, cache_salt="t1"
        )
    ]
    assert cache.admit(tokens, "t2")[0].hit_blocks == 0
    assert cache.admit(tokens, "t1")[0].hit_blocks == 2
    assert cache.admit(tokens)[0].hit_blocks == 0


def test_clear_drops_every_block() -> None:
    cache = PrefixCache(BS, 10)
    cache.admit(list(range(8)))
    assert cache.clear() == [AllBlocksCleared()]
    assert len(cache) == 0 and cache.view()["clears"] == 1
    assert cache.admit(list(range(8)))[0].hit_blocks == 0


@settings(max_examples=100)
@given(
    ops=st.lists(
        st.lists(st.integers(0, 3), min_size=0, max_size=24) | st.just([]),
        max_size=25,
    ),
    capacity=st.integers(1, 8),
)
def test_events_replay_to_exactly_the_cache_contents(ops: list[list[int]], capacity: int) -> None:
    """A router that applies the events holds exactly what the cache holds, never more than
    its capacity; a stored block's parent is held when it is announced, and eviction never
    leaves a block without its parent (tails go first)."""
    cache = PrefixCache(2, capacity)
    mirror: set[int] = set()
    parent_of: dict[int, int | None] = {}
    for tokens in ops:
        _, events = cache.admit(tokens)
        for event in events:
            if isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= mirror
                mirror -= set(event.block_hashes)
            elif isinstance(event, BlockStored):
                assert event.parent_hash is None or event.parent_hash in mirror
                assert len(event.token_ids) == 2 * len(event.block_hashes)
                parents = [event.parent_hash, *event.block_hashes[:-1]]
                parent_of.update(zip(event.block_hashes, parents, strict=True))
                mirror |= set(event.block_hashes)
        assert mirror == set(cache.block_ids())
        assert len(mirror) <= capacity
        assert all(parent_of[b] is None or parent_of[b] in mirror for b in mirror)


# --- tokenizers -----------------------------------------------------------------------------


def test_word_tokenizer_prompts() -> None:
    words = WordTokenizer()
    assert prompts(words, "completions", {"prompt": "a b  c"}) == [[word_id(w) for w in "abc"]]
    assert prompts(words, "completions", {"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert prompts(words, "completions", {"prompt": ["a", [7]]}) == [[word_id("a")], [7]]
    chat = {
        "messages": [
            {"role": "system", "content": "x y"},
            {"role": "user", "content": [{"type": "text", "text": "z"}]},
        ]
    }
    assert prompts(words, "chat", chat) == [[word_id("x"), word_id("y"), word_id("z")]]
    responses = {"instructions": "be", "input": "brief now"}
    assert prompts(words, "responses", responses) == [[word_id(w) for w in ("be", "brief", "now")]]
    for bad_endpoint, bad in (
        ("completions", {"prompt": 5}),
        ("completions", {"prompt": [[-1]]}),
        ("completions", {"prompt": [1 << 32]}),
        ("chat", {"messages": "hi"}),
        ("chat", {"messages": [{"content": "no role"}]}),
        ("chat", {"messages": [{"role": "user", "content": 5}]}),
        ("responses", {}),
    ):
        with pytest.raises(ValueError):
            prompts(words, bad_endpoint, bad)


def test_cache_salt_comes_from_the_body_or_nvext() -> None:
    assert cache_salt({"cache_salt": "a"}) == "a"
    assert cache_salt({"nvext": {"cache_salt": "b"}}) == "b"
    assert cache_salt({"cache_salt": "", "nvext": {"cache_salt": 3}}) is None


# --- the engine model: tokens, cache and the prefill lane ----------------------------------


def _plan(engine: EngineModel, body: dict[str, Any], now: float, rate: float) -> Any:
    return engine.plan(
        "completions", body, now=now, prefill_tokens_per_s=rate, word_count=lambda: 0
    )


def test_prefill_time_is_uncached_tokens_over_the_rate_and_prefills_queue() -> None:
    engine = EngineModel(MockConfig(kv_block_size=BS, kv_cache_blocks=100))
    tokens = list(range(41))
    first = _plan(engine, {"prompt": tokens}, now=10.0, rate=100.0)
    assert (first.prompt_tokens, first.cached_tokens, first.queue_s) == (41, 0, 0.0)
    assert first.prefill_s == pytest.approx(0.41)
    # Arriving while the first prefill runs: it waits for it, then prefills only 1 token.
    second = _plan(engine, {"prompt": tokens}, now=10.1, rate=100.0)
    assert second.cached_tokens == 40
    assert second.queue_s == pytest.approx(0.31)
    assert second.prefill_s == pytest.approx(0.01)
    # After the lane is idle there is no queue.
    third = _plan(engine, {"prompt": tokens}, now=20.0, rate=100.0)
    assert third.queue_s == 0.0 and third.first_token_delay_s == pytest.approx(0.01)
    # Rate 0: prefill is free.
    assert _plan(engine, {"prompt": tokens}, now=30.0, rate=0.0).first_token_delay_s == 0.0


def test_engine_off_by_default_and_words_without_a_cache() -> None:
    assert not EngineModel(MockConfig()).active(0.0)
    engine = EngineModel(MockConfig())
    assert engine.active(5.0)
    plan = engine.plan("chat", {}, now=0.0, prefill_tokens_per_s=5.0, word_count=lambda: 10)
    assert (plan.prompt_tokens, plan.cached_tokens, plan.prefill_s) == (10, None, 2.0)


# --- a local Hugging Face tokenizer dir ----------------------------------------------------


def test_hf_tokenizer_renders_the_chat_template_and_encodes_like_the_engine(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "model")
    hf = load_tokenizer(str(model), "vllm")
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model / "tokenizer.json"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Héllo"}, {"type": "text", "text": "你好 🙂"}],
        },
    ]
    expected_text = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHéllo\n你好 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    [chat_ids] = prompts(hf, "chat", {"messages": messages})
    assert raw.decode(chat_ids, skip_special_tokens=False) == expected_text
    assert chat_ids == raw.encode(expected_text, add_special_tokens=False).ids
    assert chat_ids[0] == raw.token_to_id("<|im_start|>")  # no BOS: the template has the specials
    # A completion prompt gets the post-processor's BOS, as vLLM's completions do ...
    [text_ids] = prompts(hf, "completions", {"prompt": "The quick fox"})
    assert text_ids[0] == raw.token_to_id("<s>")
    assert text_ids == raw.encode("The quick fox").ids
    # ... and none in the dynamo flavor (the default), as the Dynamo 1.6.1 frontend encodes it.
    dynamo = load_tokenizer(str(model))
    assert prompts(dynamo, "completions", {"prompt": "The quick fox"}) == [text_ids[1:]]
    assert prompts(dynamo, "chat", {"messages": messages}) == [chat_ids]
    # SGLang joins text parts with a space.
    [sglang_ids] = prompts(load_tokenizer(str(model), "sglang"), "chat", {"messages": messages})
    spaced = expected_text.replace("Héllo\n你好", "Héllo 你好")
    assert sglang_ids == raw.encode(spaced, add_special_tokens=False).ids


def test_hf_tokenizer_refuses_a_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        EngineModel(MockConfig(tokenizer=str(tmp_path)))


def test_a_template_error_is_a_value_error(tmp_path: Path) -> None:
    model = make_model_dir(tmp_path / "model")
    config = {"chat_template": "{{ raise_exception('no system messages') }}"}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no system messages"):
        prompts(
            load_tokenizer(str(model)), "chat", {"messages": [{"role": "user", "content": "x"}]}
        )

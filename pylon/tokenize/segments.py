"""Encoding a rendered chat segment by segment, with the segments cached (`Segmenter`), and
`encode_ids`, the one call into `tokenizers`' encode.

A chat's system prompt and earlier turns come back in every request of a conversation; encoding
each piece between two added tokens on its own, and remembering the pieces, makes them cost a
lookup instead of an encode, where that is exactly the whole encode (`Segmenter` says when)."""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["Segmenter", "encode_ids"]


def encode_ids(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text).ids`, through the batch call: it releases the GIL while Rust
    encodes (a plain `encode` holds it), and the `_fast` form skips the offsets (about 25%
    less time). The ids are the same."""
    batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    ids: list[int] = batch([text], add_special_tokens=add_special_tokens)[0].ids
    return ids


# Pre-tokenizers and normalizers that treat every piece between two added tokens the same
# wherever the piece sits in the text. Metaspace with prepend_scheme "first" is the exception
# (it prefixes only the piece at offset 0), so it turns the cache off, as does anything unknown.
_PIECEWISE_PRE_TOKENIZERS: Final = frozenset(
    {
        "ByteLevel",
        "Split",
        "Digits",
        "Punctuation",
        "Whitespace",
        "WhitespaceSplit",
        "BertPreTokenizer",
        "CharDelimiterSplit",
        "UnicodeScripts",
        "Metaspace",
        "Sequence",
    }
)
_PIECEWISE_NORMALIZERS: Final = frozenset(
    {
        "NFC",
        "NFD",
        "NFKC",
        "NFKD",
        "Lowercase",
        "Strip",
        "StripAccents",
        "Replace",
        "Prepend",
        "Nmt",
        "Precompiled",
        "BertNormalizer",
        "Sequence",
    }
)


def _piecewise(component: object, allowed: frozenset[str]) -> bool:
    if component is None:
        return True
    if not isinstance(component, dict):
        return False
    kind = component.get("type")
    if kind not in allowed:
        return False
    if kind == "Metaspace" and component.get("prepend_scheme", "always") == "first":
        return False
    if kind == "Sequence":
        parts = component.get("pretokenizers", component.get("normalizers"))
        return isinstance(parts, list) and all(_piecewise(p, allowed) for p in parts)
    return True


class Segmenter:
    """A rendered chat encoded piece by piece, with the pieces cached.

    `tokenizers` first cuts a text at its added tokens (the leftmost, longest match; a
    special token such as `<|im_start|>` is one), then normalizes, pre-tokenizes and encodes
    each piece on its own, and with `add_special_tokens=False` adds nothing around them. So the
    ids of a chat are the concatenation of its pieces' ids, and a piece seen before (a system
    prompt, an earlier turn: what KV-aware routing is about) costs a lookup, not an encode.

    Only when that holds exactly: every added token matched on the raw text as is (not
    normalized, no lstrip/rstrip/single_word), special tokens not split, the normalizer and
    pre-tokenizer piecewise (`_piecewise`), and a self-check on sample texts. Otherwise (or with
    `cache_tokens=0`) `encode` is one plain encode. The cache is an LRU bounded by token ids.
    """

    def __init__(
        self, tokenizer: Any, splitter: re.Pattern[str] | None, ids: dict[str, int], capacity: int
    ) -> None:
        self._tokenizer = tokenizer
        self._splitter = splitter
        self._added_ids = ids
        self._capacity = capacity
        self._cache: OrderedDict[str, array[int]] = OrderedDict()
        self._held = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    @classmethod
    def build(cls, tokenizer: Any, spec: Mapping[str, Any], capacity: int) -> Segmenter:
        """The segmenter for `tokenizer` (`spec`: its tokenizer.json, parsed), keeping up to
        `capacity` token ids: piece by piece where that is exact, else one plain encode."""
        plain = cls(tokenizer, None, {}, 0)
        if capacity == 0 or getattr(tokenizer, "encode_special_tokens", False):
            return plain
        if not (
            _piecewise(spec.get("normalizer"), _PIECEWISE_NORMALIZERS)
            and _piecewise(spec.get("pre_tokenizer"), _PIECEWISE_PRE_TOKENIZERS)
        ):
            return plain
        added = tokenizer.get_added_tokens_decoder()
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return plain
        ids = {token.content: token_id for token_id, token in added.items() if token.content}
        if not ids:
            return plain
        # Longest first: at one position the first alternative that matches is the longest.
        pattern = "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))
        segmenter = cls(tokenizer, re.compile(pattern), ids, capacity)
        return segmenter if segmenter._self_check(list(ids)) else plain

    def _self_check(self, added: list[str]) -> bool:
        samples = ["", " ", "Hello world", " Héllo\n\n wörld 你好 🙂 e\u0301  "]
        for token in added[:8]:
            samples += [f"{token}x {token} y\n{token}{token}", f" a{token}\nb ", token]
        try:
            return all(self._encode_pieces(s, cache=False) == self._whole(s) for s in samples)
        except Exception:
            return False

    def _whole(self, text: str) -> list[int]:
        return encode_ids(self._tokenizer, text, False)

    def encode(self, text: str) -> list[int]:
        """`text`'s ids, without adding special tokens (a rendered chat writes its own)."""
        if self._splitter is None:
            return self._whole(text)
        return self._encode_pieces(text, cache=True)

    def _encode_pieces(self, text: str, *, cache: bool) -> list[int]:
        assert self._splitter is not None
        out: list[int] = []
        start = 0
        for match in self._splitter.finditer(text):
            if match.start() > start:
                out.extend(self._piece(text[start : match.start()], cache))
            out.append(self._added_ids[match.group()])
            start = match.end()
        if start < len(text):
            out.extend(self._piece(text[start:], cache))
        return out

    def _piece(self, piece: str, cache: bool) -> Sequence[int]:
        if not cache:
            return self._whole(piece)
        with self._lock:
            held = self._cache.get(piece)
            if held is not None:
                self._cache.move_to_end(piece)
                self._hits += 1
                return held
            self._misses += 1
        ids = array("I", self._whole(piece))
        if len(ids) <= self._capacity:
            with self._lock:
                if piece not in self._cache:
                    self._cache[piece] = ids
                    self._held += len(ids)
                    while self._held > self._capacity:
                        _, dropped = self._cache.popitem(last=False)
                        self._held -= len(dropped)
        return ids

    def counters(self) -> dict[str, int] | None:
        """The cache's `hits`, `misses` and `tokens` (ids held), or None without a cache."""
        if self._splitter is None:
            return None
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "tokens": self._held}

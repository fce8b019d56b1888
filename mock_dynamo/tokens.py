"""Prompt tokenization, the way the engine would do it.

Two tokenizers, one interface (`prompts(endpoint, body) -> [[token id]]`, one list per prompt):

- a local Hugging Face model dir: pylon's `pylon.tokenize.Tokenizer`, the one implementation
  pylon's KV-aware routing also uses, so the mock engine and the router cannot drift. It
  renders the chat template the way `transformers`' `apply_chat_template` does (with
  `add_generation_prompt=True`) and encodes the rendered chat without adding special tokens;
  a completion prompt gets the special tokens (tokenizer.json's post-processor, e.g. a BOS) in
  the vllm and sglang flavors, and none in the dynamo flavor (the Dynamo 1.6.1 frontend's
  rule). See pylon/tokenize/ (its package docstring) for the dialects.
- `WordTokenizer`: no model dir. Each whitespace-separated word of the prompt text is one token,
  its id `zlib.crc32` of the word's UTF-8 bytes; chat and responses messages contribute their
  text content in order (roles are not tokens). Deterministic and dependency-free, and it agrees
  with the word count the mock reports as `prompt_tokens` without an engine model.

The mock reads bodies leniently, like an engine that accepts what it can (pylon's
`Tokenizer.prompt_tokens` is the strict reading, for routing): a `/v1/completions` prompt given
as token ids (a list of ints, or a list of such lists) is taken as is, and a list of strings is
several prompts. Message content may be a string or a list of parts; text parts are joined as
the flavor's engine joins them (`pylon.tokenize.content_text`: a newline, a space for sglang).
`/v1/responses` becomes messages: `instructions` as a system message, then `input` (a string is
one user message). Bad shapes raise ValueError (the mock answers 400).
"""

from __future__ import annotations

import zlib
from typing import Any, Protocol

from pylon.tokenize import Dialect, Tokenizer, TokenizerUnavailable, content_text

U32_MAX = (1 << 32) - 1

Endpoint = str  # "chat", "completions" or "responses"


class PromptTokenizer(Protocol):
    name: str
    joiner: str  # how a message's text parts are joined

    def encode_text(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


def prompts(
    tokenizer: PromptTokenizer, endpoint: Endpoint, body: dict[str, Any]
) -> list[list[int]]:
    """The token ids of each prompt of an inference body."""
    if endpoint == "chat":
        return [tokenizer.encode_chat(_messages(body.get("messages"), tokenizer.joiner))]
    if endpoint == "responses":
        return [tokenizer.encode_chat(_responses_messages(body, tokenizer.joiner))]
    return [_completion_prompt(tokenizer, p) for p in _completion_prompts(body.get("prompt"))]


def token_data(body: dict[str, Any]) -> list[int] | None:
    """`nvext.token_data`: the prompt's ids a router computed (Dynamo), or None. ValueError when
    it is not a list of u32 (the frontend refuses the request)."""
    nvext = body.get("nvext")
    if not isinstance(nvext, dict) or "token_data" not in nvext:
        return None
    ids = nvext["token_data"]
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= U32_MAX for t in ids):
        raise ValueError("nvext.token_data must be a list of token ids (u32)")
    return ids


def _completion_prompts(raw: object) -> list[object]:
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        return [raw]
    if isinstance(raw, list) and raw:
        return list(raw)
    raise ValueError("prompt must be a non-empty string, token list, or list of either")


def _completion_prompt(tokenizer: PromptTokenizer, prompt: object) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode_text(prompt)
    if isinstance(prompt, list) and all(_is_int(t) and 0 <= t <= U32_MAX for t in prompt):
        return list(prompt)
    raise ValueError("each prompt must be a string or a list of token ids (u32)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _messages(raw: object, joiner: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ValueError("messages must be a list")
    out = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string role")
        out.append({**message, "content": content_text(message.get("content"), joiner)})
    return out


def _responses_messages(body: dict[str, Any], joiner: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        # Message items only (function-call items and the like carry no role).
        items = [i for i in raw if isinstance(i, dict) and isinstance(i.get("role"), str)]
        if items:
            messages.extend(_messages(items, joiner))
    elif raw is not None:
        raise ValueError("input must be a string or a list of items")
    if not messages:
        raise ValueError("input is required")
    return messages


def word_id(word: str) -> int:
    return zlib.crc32(word.encode("utf-8"))


class WordTokenizer:
    """Words as tokens (see the module docstring)."""

    name = "words"
    joiner = "\n"

    def encode_text(self, text: str) -> list[int]:
        return [word_id(w) for w in text.split()]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [word_id(w) for m in messages for w in str(m.get("content") or "").split()]


def load_tokenizer(directory: str | None, flavor: Dialect = "dynamo") -> PromptTokenizer:
    """Words without a directory; else pylon's `Tokenizer`, in the dialect of the engine the
    mock plays (`flavor`). ValueError, one line, when the directory cannot be used."""
    if directory is None:
        return WordTokenizer()
    try:
        return Tokenizer(directory, dialect=flavor)
    except TokenizerUnavailable as exc:
        raise ValueError(
            f"--tokenizer needs the '{exc.package}' package: pip install -e '.[mock-kv]'"
        ) from None

"""Prompt tokenization, the way the engine would do it.

Two tokenizers, one interface (`prompts(endpoint, body) -> [[token id]]`, one list per prompt):

- `HfTokenizer(dir)`: a local Hugging Face model dir. `tokenizer.json` (read with `tokenizers`)
  and the chat template of `tokenizer_config.json` (or `chat_template.jinja` beside it), rendered
  with jinja2 the way `transformers`' `apply_chat_template` renders it (sandboxed, `trim_blocks`,
  `lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, a `tojson` that keeps
  non-ASCII), with `add_generation_prompt=True` and the special tokens of the config. As vLLM
  does: a chat's rendered text is encoded without adding special tokens (the template has them);
  a completion prompt is encoded with them (tokenizer.json's post-processor, e.g. a BOS).
- `WordTokenizer`: no model dir. Each whitespace-separated word of the prompt text is one token,
  its id `zlib.crc32` of the word's UTF-8 bytes; chat and responses messages contribute their
  text content in order (roles are not tokens). Deterministic and dependency-free, and it agrees
  with the word count the mock reports as `prompt_tokens` without an engine model.

Either way a `/v1/completions` prompt given as token ids (a list of ints, or a list of such lists)
is taken as is. A list of strings is several prompts. Message content may be a string or a list
of parts; text parts are joined with a newline (vLLM's "string" content format). `/v1/responses`
becomes messages: `instructions` as a system message, then `input` (a string is one user
message). Bad shapes raise ValueError (the mock answers 400).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

U32_MAX = (1 << 32) - 1

Endpoint = str  # "chat", "completions" or "responses"


class PromptTokenizer(Protocol):
    name: str

    def encode_text(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


def prompts(
    tokenizer: PromptTokenizer, endpoint: Endpoint, body: dict[str, Any]
) -> list[list[int]]:
    """The token ids of each prompt of an inference body."""
    if endpoint == "chat":
        return [tokenizer.encode_chat(_messages(body.get("messages")))]
    if endpoint == "responses":
        return [tokenizer.encode_chat(_responses_messages(body))]
    return [_completion_prompt(tokenizer, p) for p in _completion_prompts(body.get("prompt"))]


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


def _messages(raw: object) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ValueError("messages must be a list")
    out = []
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message must be an object with a string role")
        out.append({**message, "content": content_text(message.get("content"))})
    return out


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
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
            messages.extend(_messages(items))
    elif raw is not None:
        raise ValueError("input must be a string or a list of items")
    if not messages:
        raise ValueError("input is required")
    return messages


def content_text(content: object) -> str:
    """A message's text: a string, or its text parts joined with a newline."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError("message content must be a string or a list of parts")


def word_id(word: str) -> int:
    return zlib.crc32(word.encode("utf-8"))


class WordTokenizer:
    """Words as tokens (see the module docstring)."""

    name = "words"

    def encode_text(self, text: str) -> list[int]:
        return [word_id(w) for w in text.split()]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [word_id(w) for m in messages for w in str(m.get("content") or "").split()]


def _token_text(value: object) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _default_template(raw: object) -> str | None:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


class HfTokenizer:
    """tokenizer.json plus the chat template of a local model dir (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - depends on the install
            raise ValueError(
                "--tokenizer needs the 'tokenizers' package: pip install -e '.[mock-kv]'"
            ) from None
        root = Path(directory)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"tokenizer dir {root} has no tokenizer.json")
        self.name = f"hf:{root}"
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:
            raise ValueError(f"cannot read {tokenizer_file}: {exc}") from None
        config = _read_json(root / "tokenizer_config.json")
        template = _default_template(config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        self._special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self._render: Callable[..., str] | None = (
            None if template is None else _compile_template(template)
        )

    def encode_text(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self._render is None:
            raise ValueError("the tokenizer dir has no chat template")
        try:
            return self._render(messages=messages, add_generation_prompt=True, **self._special)
        except ValueError:
            raise
        except Exception as exc:  # a template error is the request's problem, not the mock's
            raise ValueError(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        rendered = self.render_chat(messages)
        return list(self._tokenizer.encode(rendered, add_special_tokens=False).ids)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


class TemplateError(ValueError):
    """`raise_exception(...)` called by a chat template."""


def _compile_template(source: str) -> Callable[..., str]:
    try:
        from jinja2 import TemplateError as JinjaError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - depends on the install
        raise ValueError(
            "a chat template needs the 'jinja2' package: pip install -e '.[mock-kv]'"
        ) from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: object, ensure_ascii: bool = False, indent: int | None = None, **kw: Any
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        template = env.from_string(source)
    except JinjaError as exc:
        raise ValueError(f"chat template does not compile: {exc}") from None

    def render(**context: Any) -> str:
        try:
            return str(template.render(**context))
        except JinjaError as exc:
            raise ValueError(f"chat template failed: {exc}") from None

    return render


def load_tokenizer(directory: str | None) -> PromptTokenizer:
    return WordTokenizer() if directory is None else HfTokenizer(directory)

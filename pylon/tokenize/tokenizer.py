"""`Tokenizer`: one model directory's tokenizer and chat template, as one engine dialect applies
them, and `tokenize`/`prompt_tokens`, the routing entry point (see the package docstring)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, Final, Literal, get_args

import msgspec

from pylon.tokenize.errors import TemplateError, TokenizerError, TokenizerUnavailable, one_line
from pylon.tokenize.segments import Segmenter, encode_ids
from pylon.tokenize.shapes import (
    CHAT_CONTROLS,
    CHAT_DECODER,
    CHAT_PATH,
    COMPLETION_CONTROLS,
    COMPLETION_DECODER,
    COMPLETIONS_PATH,
    ID_LISTS_DECODER,
    IDS_DECODER,
    QUOTE,
    TEXT_DECODER,
    TEXTS_DECODER,
    steered,
)
from pylon.tokenize.template import ContentFormat, compile_template

__all__ = [
    "DEFAULT_CACHE_TOKENS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "DIALECTS",
    "Dialect",
    "Fallback",
    "Tokenizer",
]

Dialect = Literal["vllm", "sglang", "dynamo"]
DIALECTS: Final[tuple[str, ...]] = get_args(Dialect)
# Request bodies above this are not tokenized (routing falls back): the cost of tokenizing is
# linear in the text, and it runs per request.
DEFAULT_MAX_BODY_BYTES: Final = 1024 * 1024
DEFAULT_MAX_PROMPT_TOKENS: Final = 256 * 1024
# Token ids the segment cache keeps (4 bytes each, plus the segments' text).
DEFAULT_CACHE_TOKENS: Final = 1024 * 1024

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES); the Dynamo frontend passes three.
_NAMED_SPECIALS: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_DYNAMO_SPECIALS: Final = ("bos_token", "eos_token", "unk_token")
_JOINERS: Final[dict[str, str]] = {"vllm": "\n", "sglang": " ", "dynamo": "\n"}


class Fallback(StrEnum):
    """Why a request's prompt was not tokenized (routing then goes without the cache view)."""

    PATH = "path"  # not /v1/completions or /v1/chat/completions
    TOO_LARGE = "too_large"  # body over max_body_bytes
    SHAPE = "shape"  # not JSON, or a prompt/message shape pylon does not reproduce
    BATCH = "batch"  # several prompts in one completion request
    EMPTY = "empty"  # an empty prompt or conversation
    CONTROL = "control"  # the client steers rendering (tools, chat_template, ...)
    CONTENT_FORMAT = "content_format"  # the template takes content parts (vLLM wraps them)
    NO_TEMPLATE = "no_template"  # a chat, and the model dir has no chat template
    TEMPLATE_ERROR = "template_error"  # the template refused the conversation
    ERROR = "error"  # the tokenizer failed on the text (never seen; never a crash either)
    SPECIAL_TOKENS = "special_tokens"  # the dir disagrees with itself on BOS/EOS (see load)
    TOO_MANY_TOKENS = "too_many_tokens"  # over max_prompt_tokens


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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {one_line(exc)}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _read_text(path: Path) -> str | None:
    if not path.exists():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {one_line(exc)}") from None


class Tokenizer:
    """One model directory's tokenizer and chat template, as one engine dialect applies them."""

    def __init__(
        self,
        directory: str | Path,
        *,
        dialect: Dialect = "vllm",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
    ) -> None:
        """Load `directory` (`TokenizerError`: one line saying what is wrong with it).

        `cache_tokens`: how many token ids the segment cache keeps (see `Segmenter`); 0: none."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, got {dialect!r}")
        if max_body_bytes < 0 or max_prompt_tokens < 1 or cache_tokens < 0:
            raise ValueError(
                "max_body_bytes and cache_tokens must be >= 0, and max_prompt_tokens >= 1"
            )
        try:
            from tokenizers import AddedToken
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError:
            raise TokenizerUnavailable("tokenizers") from None
        root = Path(directory)
        if not root.is_dir():
            raise TokenizerError(
                f"tokenizer dir {root} is not a directory (a Hugging Face model dir: "
                "tokenizer.json, tokenizer_config.json)"
            )
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"tokenizer dir {root} has no tokenizer.json")
        tokenizer_json = _read_text(tokenizer_file) or ""
        try:
            tokenizer = HfTokenizer.from_str(tokenizer_json)
            spec = json.loads(tokenizer_json)
        except Exception as exc:  # the Rust side raises plain Exceptions
            raise TokenizerError(f"cannot read {tokenizer_file}: {one_line(exc)}") from None
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        specials = {
            name: text
            for name in _NAMED_SPECIALS
            if (text := _token_text(config.get(name, special_map.get(name)))) is not None
        }
        template = _default_template(config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        file_template = _read_text(jinja_file)
        if template is not None and file_template is not None and template != file_template:
            raise TokenizerError(
                f"{root}: tokenizer_config.json and chat_template.jinja hold different chat "
                "templates (which one an engine renders depends on its version); keep one"
            )
        template = template if template is not None else file_template

        self.directory = root
        self.dialect: Dialect = dialect
        self.name = f"hf:{root}"
        self.max_body_bytes = max_body_bytes
        self.max_prompt_tokens = max_prompt_tokens
        if dialect == "dynamo":
            # The frontend reads tokenizer.json as it is (Rust `tokenizers`), no more.
            self._context: dict[str, Any] = {
                name: specials[name] for name in _DYNAMO_SPECIALS if name in specials
            }
        else:
            # transformers drops the file's truncation and padding unless asked, and adds the
            # named special tokens tokenizer.json lacks.
            tokenizer.no_truncation()
            tokenizer.no_padding()
            missing = [t for t in specials.values() if tokenizer.token_to_id(t) is None]
            if missing:
                tokenizer.add_special_tokens(
                    [AddedToken(t, special=True, normalized=False) for t in missing]
                )
            self._context = {**specials, "documents": None}
        self._context["tools"] = None
        self._tokenizer = tokenizer
        self._add_specials_to_text = dialect != "dynamo"
        # A completion prompt is encoded with the special tokens only when the post-processor
        # agrees with tokenizer_config.json's add_bos_token / add_eos_token: transformers
        # rebuilds the post-processor from those flags for some tokenizer classes and versions.
        self._text_reliable = not self._add_specials_to_text or self._specials_agree(
            config, specials
        )
        # How the engine joins a message's text parts.
        self.joiner = _JOINERS[dialect]
        self._segments = Segmenter.build(tokenizer, spec, cache_tokens)
        self._render: Callable[..., str] | None = None
        self.content_format: ContentFormat = "string"
        if template is not None:
            self._render, self.content_format = compile_template(template)

    @property
    def has_chat_template(self) -> bool:
        return self._render is not None

    def _specials_agree(self, config: Mapping[str, Any], specials: Mapping[str, str]) -> bool:
        probe = self._tokenizer.encode("a", add_special_tokens=True).ids
        for flag, name, index in (
            ("add_bos_token", "bos_token", 0),
            ("add_eos_token", "eos_token", -1),
        ):
            wanted = config.get(flag)
            token = specials.get(name)
            if not isinstance(wanted, bool) or token is None:
                continue
            token_id = self._tokenizer.token_to_id(token)
            added = bool(probe) and token_id is not None and probe[index] == token_id
            if added != wanted:
                return False
        return True

    # --- the low-level steps (mock_dynamo's lenient reading uses these) -------------------

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's ids (with the special tokens, except for Dynamo's frontend)."""
        if not self._add_specials_to_text:
            return self._segments.encode(text)
        return encode_ids(self._tokenizer, text, True)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template rendered over `messages` as given (`TemplateError` if it fails)."""
        if self._render is None:
            raise TemplateError("the tokenizer dir has no chat template")
        return self._render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._context
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """A chat's ids: rendered, then encoded without adding special tokens (the template
        writes them), as vLLM, SGLang and the Dynamo frontend do."""
        rendered = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self._segments.encode(rendered)

    @property
    def segment_cache(self) -> dict[str, int] | None:
        """The segment cache's counters (`hits`, `misses`, `tokens`), or None without one."""
        return self._segments.counters()

    # --- a request, strictly --------------------------------------------------------------

    def prompt_tokens(self, path: str, body: bytes) -> list[int] | None:
        """The prompt's token ids as the engine will compute them, or None when pylon cannot be
        sure of them (the request shapes `tokenize` falls back on). Never raises."""
        result = self.tokenize(path, body)
        return None if isinstance(result, Fallback) else result

    def tokenize(self, path: str, body: bytes) -> list[int] | Fallback:
        """`prompt_tokens`, saying why when it falls back. `path` may carry a query."""
        route = path.partition("?")[0]
        if route not in (CHAT_PATH, COMPLETIONS_PATH):
            return Fallback.PATH
        if len(body) > self.max_body_bytes:
            return Fallback.TOO_LARGE
        try:
            result = self._chat(body) if route == CHAT_PATH else self._completion(body)
        except (msgspec.DecodeError, RecursionError):
            return Fallback.SHAPE
        except TemplateError:
            return Fallback.TEMPLATE_ERROR
        except Exception:  # the tokenizer's own failure is not the request's crash either
            return Fallback.ERROR
        if isinstance(result, list) and len(result) > self.max_prompt_tokens:
            return Fallback.TOO_MANY_TOKENS
        return result

    def _completion(self, body: bytes) -> list[int] | Fallback:
        request = COMPLETION_DECODER.decode(body)
        if steered(request, COMPLETION_CONTROLS):
            return Fallback.CONTROL
        raw = memoryview(request.prompt)  # msgspec's Raw is the value's bytes, unpadded
        if not raw:
            return Fallback.SHAPE
        if raw[0] == QUOTE:
            text = TEXT_DECODER.decode(raw)
        else:
            inner = bytes(raw[1:65]).lstrip()[:1]
            if inner == b'"':
                texts = TEXTS_DECODER.decode(raw)
                if len(texts) != 1:
                    return Fallback.BATCH if texts else Fallback.EMPTY
                text = texts[0]
            elif inner == b"[":
                lists = ID_LISTS_DECODER.decode(raw)
                if len(lists) != 1:
                    return Fallback.BATCH if lists else Fallback.EMPTY
                return lists[0] or Fallback.EMPTY
            else:
                return IDS_DECODER.decode(raw) or Fallback.EMPTY
        if not text:
            return Fallback.EMPTY
        if not self._text_reliable:
            return Fallback.SPECIAL_TOKENS
        return self.encode_text(text)

    def _chat(self, body: bytes) -> list[int] | Fallback:
        request = CHAT_DECODER.decode(body)
        if request.messages is None:
            return Fallback.SHAPE
        if steered(request, CHAT_CONTROLS):
            return Fallback.CONTROL
        if not request.messages:
            return Fallback.EMPTY
        if self._render is None:
            return Fallback.NO_TEMPLATE
        dialect, openai_format = self.dialect, self.content_format == "openai"
        if openai_format and dialect == "vllm":
            return Fallback.CONTENT_FORMAT
        messages: list[dict[str, str]] = []
        for message in request.messages:
            content = message.content
            if not isinstance(content, str):
                if not content:
                    return Fallback.EMPTY  # [] renders differently in each engine
                if openai_format:
                    return Fallback.CONTENT_FORMAT
                content = self.joiner.join([part.text for part in content])
            messages.append({"role": message.role, "content": content})
        return self.encode_chat(messages, add_generation_prompt=request.add_generation_prompt)

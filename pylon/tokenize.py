"""A prompt's token ids exactly as the engine computes them: the one tokenization implementation.

KV-aware routing hashes a request's prompt into blocks (`pylon.core.blocks`) and looks them up in
the cache view the engines' KV events built; a single token that differs from the engine's
changes every block hash after it. So `Tokenizer` does what the engine does, or says it cannot
(`Fallback`) and routing falls back; it never guesses. mock_dynamo tokenizes with it too, so the
mock engine and pylon cannot drift.

A `Tokenizer` is a local Hugging Face model directory, loaded once (`Tokenizer(dir, dialect=)`,
`TokenizerError` with one line when the directory cannot be used):

- `tokenizer.json`, read with `tokenizers` (what vLLM and SGLang use through `transformers`, and
  what the Dynamo frontend uses in Rust);
- the chat template of `tokenizer_config.json` (`chat_template`: a string, or the `default` of
  a named list), or `chat_template.jinja` beside it; both present and different is refused (which
  one an engine renders depends on its version);
- the named special tokens of `tokenizer_config.json` (else `special_tokens_map.json`).

Rendering is `transformers`' `apply_chat_template`: jinja2's `ImmutableSandboxedEnvironment`
with `trim_blocks`, `lstrip_blocks`, `loopcontrols`, the `{% generation %}` tag, a `tojson` that
keeps non-ASCII, `raise_exception`, `strftime_now`, and a `namespace` that refuses underscore
names; context `messages`, `add_generation_prompt`, `tools=None` and the special tokens.

What each engine does with a request (the `dialect`; `Settings.backend` names them):

| | vllm | sglang | dynamo (1.6.1 frontend) |
|---|---|---|---|
| completion prompt (text) | encoded with special tokens | with special tokens | without |
| chat | rendered, encoded without special tokens | same | same |
| text-only content parts | joined with `"\\n"` | joined with `" "` | joined with `"\\n"` |
| template context | + `documents=None`, all named special tokens | same as vllm | bos, eos, unk |

A template that iterates over a message's content (vLLM's and SGLang's "openai" content format)
makes vLLM wrap every content in parts, which pylon does not imitate: such chats fall back under
`vllm`, and under `sglang` when a content is a list.

`prompt_tokens(path, body)` (the routing entry point) reads `/v1/completions` and
`/v1/chat/completions` bodies strictly and answers None for any shape it cannot reproduce
exactly: several prompts, tools, documents, a chat template or its arguments from the client,
`continue_final_message`, `add_special_tokens`, `truncate_prompt_tokens`, `reasoning_effort`,
`nvext.use_raw_prompt` or `nvext.token_data`, roles other than system/user/assistant, message
fields other than role and content, non-text content parts, an empty prompt or conversation, a
template error, a body over `max_body_bytes` or a prompt over `max_prompt_tokens`, and (vllm,
sglang) a completion prompt when the dir disagrees with itself on adding BOS/EOS. `tokenize`
says why (`Fallback`), for metrics. Both never raise for a request's content, and are
thread-safe: the encode runs in Rust without the GIL (`encode_batch_fast`), so a caller may run
them in a worker thread while its event loop goes on; jinja2 renders from an immutable template.

Cost (docs/routing.md, "Tokenization"): the encode is nearly all of it. A chat is encoded piece
by piece between its added tokens, with an LRU cache of pieces (`_Segmenter`, only where that is
exactly the whole encode), so a system prompt or an earlier turn seen before costs a lookup.

`tokenizers` and `jinja2` are imported when a `Tokenizer` is built, never by importing this
module; they ship with the `dynamo` extra (what `--routing kv` needs), `mock-kv` and `dev`. A
missing package raises `TokenizerUnavailable` naming it.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, get_args

import msgspec

if TYPE_CHECKING:
    from jinja2 import nodes

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "DEFAULT_CACHE_TOKENS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "DIALECTS",
    "ContentFormat",
    "Dialect",
    "Fallback",
    "TemplateError",
    "Tokenizer",
    "TokenizerError",
    "TokenizerUnavailable",
    "content_text",
    "detect_content_format",
]

Dialect = Literal["vllm", "sglang", "dynamo"]
DIALECTS: Final[tuple[str, ...]] = get_args(Dialect)
ContentFormat = Literal["string", "openai"]

COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_PATH: Final = "/v1/chat/completions"
U32_MAX: Final = (1 << 32) - 1
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
# Template keywords SGLang takes for the "openai" content format without looking further.
_MEDIA_WORDS: Final = ("image", "audio", "video", "vision")


class TokenizerError(ValueError):
    """The model directory cannot be used; the message is one line for the operator."""


class TokenizerUnavailable(TokenizerError):
    """A package tokenization needs (`tokenizers`, `jinja2`) is not installed."""

    def __init__(self, package: str) -> None:
        super().__init__(f"tokenization needs the '{package}' package")
        self.package = package


class TemplateError(ValueError):
    """A chat template failed to render (its `raise_exception(...)`, or a jinja2 error)."""


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


# --- the request shapes read strictly ----------------------------------------------------------

_ABSENT: Final = msgspec.Raw()
_NULL: Final = msgspec.Raw(b"null")
_QUOTE: Final = ord('"')


class _TextPart(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    type: Literal["text"]
    text: str


class _Message(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    role: Literal["system", "user", "assistant"]
    content: str | list[_TextPart]


class _Nvext(msgspec.Struct, gc=False):
    use_raw_prompt: msgspec.Raw = _ABSENT
    token_data: msgspec.Raw = _ABSENT


class _Controls(msgspec.Struct, gc=False):
    """Fields with which a client changes what the engine renders or encodes: present and not
    null, the prompt is not tokenized."""

    add_special_tokens: msgspec.Raw = _ABSENT
    truncate_prompt_tokens: msgspec.Raw = _ABSENT
    mm_processor_kwargs: msgspec.Raw = _ABSENT
    nvext: _Nvext | None = None


class _ChatBody(_Controls, gc=False):
    messages: list[_Message] | None = None
    add_generation_prompt: bool = True
    tools: msgspec.Raw = _ABSENT
    functions: msgspec.Raw = _ABSENT
    documents: msgspec.Raw = _ABSENT
    chat_template: msgspec.Raw = _ABSENT
    chat_template_kwargs: msgspec.Raw = _ABSENT
    chat_template_args: msgspec.Raw = _ABSENT
    continue_final_message: msgspec.Raw = _ABSENT
    reasoning_effort: msgspec.Raw = _ABSENT
    media_io_kwargs: msgspec.Raw = _ABSENT


class _CompletionBody(_Controls, gc=False):
    prompt: msgspec.Raw = _ABSENT
    prompt_embeds: msgspec.Raw = _ABSENT
    suffix: msgspec.Raw = _ABSENT


_CHAT_CONTROLS: Final = (
    "add_special_tokens",
    "truncate_prompt_tokens",
    "mm_processor_kwargs",
    "tools",
    "functions",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "chat_template_args",
    "continue_final_message",
    "reasoning_effort",
    "media_io_kwargs",
)
_COMPLETION_CONTROLS: Final = (
    "add_special_tokens",
    "truncate_prompt_tokens",
    "mm_processor_kwargs",
    "prompt_embeds",
    "suffix",
)

_TokenId = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
_CHAT_DECODER: Final = msgspec.json.Decoder(_ChatBody)
_COMPLETION_DECODER: Final = msgspec.json.Decoder(_CompletionBody)
_TEXT_DECODER: Final = msgspec.json.Decoder(str)
_TEXTS_DECODER: Final = msgspec.json.Decoder(list[str])
_IDS_DECODER: Final = msgspec.json.Decoder(list[_TokenId])
_ID_LISTS_DECODER: Final = msgspec.json.Decoder(list[list[_TokenId]])


def _present(raw: msgspec.Raw) -> bool:
    return bool(raw) and raw != _NULL


def _steered(body: _Controls, names: Sequence[str]) -> bool:
    if any(_present(getattr(body, name)) for name in names):
        return True
    nvext = body.nvext
    return nvext is not None and (_present(nvext.use_raw_prompt) or _present(nvext.token_data))


def content_text(content: object, joiner: str = "\n") -> str:
    """A message's text: a string, or its text parts joined with `joiner` (vLLM's and Dynamo's
    "string" content format join with a newline). For mock_dynamo's lenient reading: other
    parts are skipped, None is empty; anything else is a ValueError."""
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
        return joiner.join(texts)
    raise ValueError("message content must be a string or a list of parts")


# --- the model directory -----------------------------------------------------------------------


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
        raise TokenizerError(f"cannot read {path}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _read_text(path: Path) -> str | None:
    if not path.exists():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {_one_line(exc)}") from None


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """`tokenizer.encode(text).ids`, through the batch call: it releases the GIL while Rust
    encodes (a plain `encode` holds it), and the `_fast` form skips the offsets (about 25%
    less time). The ids are the same."""
    batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    ids: list[int] = batch([text], add_special_tokens=add_special_tokens)[0].ids
    return ids


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "strerror", None) or exc)
    return " ".join(text.split()) or type(exc).__name__


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

        `cache_tokens`: how many token ids the segment cache keeps (see `_Segmenter`); 0: none."""
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
            raise TokenizerError(f"cannot read {tokenizer_file}: {_one_line(exc)}") from None
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
        self._segments = _Segmenter.build(tokenizer, spec, cache_tokens)
        self._render: Callable[..., str] | None = None
        self.content_format: ContentFormat = "string"
        if template is not None:
            self._render, self.content_format = _compile_template(template)

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
        return _encode(self._tokenizer, text, True)

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
        request = _COMPLETION_DECODER.decode(body)
        if _steered(request, _COMPLETION_CONTROLS):
            return Fallback.CONTROL
        raw = memoryview(request.prompt)  # msgspec's Raw is the value's bytes, unpadded
        if not raw:
            return Fallback.SHAPE
        if raw[0] == _QUOTE:
            text = _TEXT_DECODER.decode(raw)
        else:
            inner = bytes(raw[1:65]).lstrip()[:1]
            if inner == b'"':
                texts = _TEXTS_DECODER.decode(raw)
                if len(texts) != 1:
                    return Fallback.BATCH if texts else Fallback.EMPTY
                text = texts[0]
            elif inner == b"[":
                lists = _ID_LISTS_DECODER.decode(raw)
                if len(lists) != 1:
                    return Fallback.BATCH if lists else Fallback.EMPTY
                return lists[0] or Fallback.EMPTY
            else:
                return _IDS_DECODER.decode(raw) or Fallback.EMPTY
        if not text:
            return Fallback.EMPTY
        if not self._text_reliable:
            return Fallback.SPECIAL_TOKENS
        return self.encode_text(text)

    def _chat(self, body: bytes) -> list[int] | Fallback:
        request = _CHAT_DECODER.decode(body)
        if request.messages is None:
            return Fallback.SHAPE
        if _steered(request, _CHAT_CONTROLS):
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


# --- encoding a rendered chat, segment by segment --------------------------------------------

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


class _Segmenter:
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
    def build(cls, tokenizer: Any, spec: Mapping[str, Any], capacity: int) -> _Segmenter:
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
        return _encode(self._tokenizer, text, False)

    def encode(self, text: str) -> list[int]:
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
        if self._splitter is None:
            return None
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "tokens": self._held}


# --- the chat template ---------------------------------------------------------------------------


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "3.1.6" -> (3, 1, 6), "3.2rc1" -> (3, 2)."""
    return tuple(int(m.group()) for p in text.split(".")[:3] if (m := re.match(r"\d+", p)))


def _compile_template(source: str) -> tuple[Callable[..., str], ContentFormat]:
    """The template compiled the way transformers compiles it, and its content format."""
    try:
        import jinja2
        from jinja2 import nodes as jinja_nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from jinja2.utils import Namespace
    except ImportError:
        raise TokenizerUnavailable("jinja2") from None
    if _version(jinja2.__version__) < (3, 1, 6):
        # As transformers: older jinja2 has known sandbox escapes, and templates are code.
        raise TokenizerError(
            f"jinja2 {jinja2.__version__} is too old to render chat templates safely: "
            "install jinja2>=3.1.6"
        )

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): its
        body, rendered as is."""

        tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja_nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    class GuardedNamespace(Namespace):
        """A template `namespace()` that stores no underscore-prefixed names."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_name(name)
            Namespace.__setitem__(self, name, value)

    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        value: object,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = GuardedNamespace
    try:
        template = env.from_string(source)
        tree = env.parse(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {_one_line(exc)}") from None
    content_format = detect_content_format(source, tree)

    def render(**context: Any) -> str:
        try:
            return str(template.render(**context))
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {_one_line(exc)}") from None

    return render, content_format


def detect_content_format(source: str, tree: nodes.Template) -> ContentFormat:
    """ "openai" when the template may iterate over a message's content (vLLM and SGLang then
    pass content as a list of parts), else "string". Errs towards "openai": a loop over anything
    that reads a `content` member (through filters, tests, slices, or a variable set from one),
    and SGLang's shortcut (the template mentions images, audio, video or vision)."""
    from jinja2 import nodes as jinja_nodes

    if any(word in source for word in _MEDIA_WORDS):
        return "openai"

    def walk(node: jinja_nodes.Node) -> Iterator[jinja_nodes.Node]:
        yield node
        yield from node.find_all(jinja_nodes.Node)

    def reads_content(node: jinja_nodes.Node, names: set[str]) -> bool:
        for item in walk(node):
            if isinstance(item, jinja_nodes.Getattr) and item.attr == "content":
                return True
            if (
                isinstance(item, jinja_nodes.Getitem)
                and isinstance(item.arg, jinja_nodes.Const)
                and item.arg.value == "content"
            ):
                return True
            if isinstance(item, jinja_nodes.Name) and item.name in names:
                return True
        return False

    # Variables set from a content read ({% set c = message['content'] %}), to a fixed point.
    tainted: set[str] = set()
    assigns = [
        (assign.node, [n.name for n in walk(assign.target) if isinstance(n, jinja_nodes.Name)])
        for assign in tree.find_all(jinja_nodes.Assign)
    ]
    changed = True
    while changed:
        changed = False
        for value, targets in assigns:
            fresh = [name for name in targets if name not in tainted]
            if fresh and reads_content(value, tainted):
                tainted.update(fresh)
                changed = True
    for loop in tree.find_all(jinja_nodes.For):
        if reads_content(loop.iter, tainted):
            return "openai"
    return "string"

"""The request shapes read strictly: the `/v1/completions` and `/v1/chat/completions` bodies
pylon can reproduce the engine's tokens for, as msgspec structs, their decoders, and the fields
with which a client steers rendering (`steered`). Anything else fails to decode, and the
tokenizer falls back (`pylon.tokenize.tokenizer`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final, Literal

import msgspec

__all__ = [
    "CHAT_CONTROLS",
    "CHAT_DECODER",
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "COMPLETION_CONTROLS",
    "COMPLETION_DECODER",
    "IDS_DECODER",
    "ID_LISTS_DECODER",
    "QUOTE",
    "TEXTS_DECODER",
    "TEXT_DECODER",
    "U32_MAX",
    "content_text",
    "steered",
]

COMPLETIONS_PATH: Final = "/v1/completions"
CHAT_PATH: Final = "/v1/chat/completions"
U32_MAX: Final = (1 << 32) - 1

_ABSENT: Final = msgspec.Raw()
_NULL: Final = msgspec.Raw(b"null")
QUOTE: Final = ord('"')  # a JSON value starting with it is a string


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


# The fields of each body with which the client steers rendering or encoding (see `steered`).
CHAT_CONTROLS: Final = (
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
COMPLETION_CONTROLS: Final = (
    "add_special_tokens",
    "truncate_prompt_tokens",
    "mm_processor_kwargs",
    "prompt_embeds",
    "suffix",
)

_TokenId = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
CHAT_DECODER: Final = msgspec.json.Decoder(_ChatBody)
COMPLETION_DECODER: Final = msgspec.json.Decoder(_CompletionBody)
TEXT_DECODER: Final = msgspec.json.Decoder(str)
TEXTS_DECODER: Final = msgspec.json.Decoder(list[str])
IDS_DECODER: Final = msgspec.json.Decoder(list[_TokenId])
ID_LISTS_DECODER: Final = msgspec.json.Decoder(list[list[_TokenId]])


def _present(raw: msgspec.Raw) -> bool:
    return bool(raw) and raw != _NULL


def steered(body: _Controls, names: Sequence[str]) -> bool:
    """Whether one of `names` (or nvext's raw prompt or token data) is present and not null."""
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

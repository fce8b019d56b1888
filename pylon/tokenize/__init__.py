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

Rendering is `transformers`' `apply_chat_template` (template.py says how), with the context
`messages`, `add_generation_prompt`, `tools=None` and the special tokens.

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
by piece between its added tokens, with an LRU cache of pieces (`Segmenter`, only where that is
exactly the whole encode), so a system prompt or an earlier turn seen before costs a lookup.

`tokenizers` and `jinja2` are imported when a `Tokenizer` is built, never by importing this
package; they ship with the `dynamo` extra (what `--routing kv` needs), `mock-kv` and `dev`. A
missing package raises `TokenizerUnavailable` naming it.

What lives where (each module imports only those above it):

- errors.py: `TokenizerError`, `TokenizerUnavailable`, `TemplateError`.
- shapes.py: the request shapes read strictly (msgspec structs and decoders for the two bodies,
  the client's steering fields), `CHAT_PATH`, `COMPLETIONS_PATH`, `content_text`.
- segments.py: the segment cache (`Segmenter`) and the one encode call (`encode_ids`).
- template.py: the chat template emulation (`compile_template`, `detect_content_format`).
- tokenizer.py: `Tokenizer` (the model directory, the dialects, `tokenize`/`prompt_tokens`) and
  `Fallback`.

The names below are the package's API; import them from `pylon.tokenize`.
"""

from pylon.tokenize.errors import TemplateError, TokenizerError, TokenizerUnavailable
from pylon.tokenize.shapes import CHAT_PATH, COMPLETIONS_PATH, content_text
from pylon.tokenize.template import ContentFormat, detect_content_format
from pylon.tokenize.tokenizer import (
    DEFAULT_CACHE_TOKENS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPT_TOKENS,
    DIALECTS,
    Dialect,
    Fallback,
    Tokenizer,
)

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

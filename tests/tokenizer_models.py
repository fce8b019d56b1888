"""Tiny offline Hugging Face model dirs for the tokenization tests, built once per session.

The base is `scripts/dynamo_stack.py`'s `build_model_dir` (a byte-level BPE trained here in about a
second, a ChatML template, the dir the real Dynamo stack serves); nothing is downloaded. Variants
are copies with one thing changed:

- `chatml`: as built (no post-processor: a completion prompt gets no BOS);
- `chatml_bos`: tokenizer.json's post-processor adds `<s>`, and tokenizer_config.json says
  `add_bos_token: true` (a Llama-style dir, where vLLM's completions start with BOS and the Dynamo
  frontend's do not);
- `parts`: a template that iterates over a message's content (vLLM's "openai" content format);
- `metaspace_first`: a Metaspace pre-tokenizer with `prepend_scheme: "first"` (the piecewise
  segment cache must turn itself off for it).

And the corpus every tokenization test runs: `TEXTS` (completion prompts) and `CONVERSATIONS`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

SPECIALS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<unk>"]

# Texts an engine sees: multi-byte (CJK, emoji with ZWJ and skin tones, combining marks, RTL),
# whitespace runs, code, numbers, and text that spells the template's own special tokens.
TEXTS = [
    "Hello world",
    "Héllo wörld, ça va ? Größe",
    "你好\uff0c世界。今天天气很好。",
    "こんにちは、世界 カタカナ",
    "한국어 텍스트",
    "🙂🚀 👩‍👩‍👧‍👦 family 👍🏽 ✊🏿",
    "e\u0301 a\u0308 n\u0303 \u1e9b\u0323 Z\u0324\u0354\u0367\u0311\u0343",
    "שלום עולם مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # square\n",
    "  leading and trailing  ",
    "\t\ttabs\n\n\nnewlines\r\n",
    "pi = 3.14159; 2**64 = 18446744073709551616",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "<|im_start|>user\ninjected<|im_end|>",
    "<s> and </s> and <unk>",
    "The quick brown fox jumps over the lazy dog. " * 40,
    " ",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🙂"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And e\u0301 \u00d7 3?"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": " "}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}],
    [{"role": "system", "content": "only a system prompt"}],
    *[[{"role": "user", "content": text}] for text in TEXTS],
]

PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}[{{ part['text'] }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def build_models(root: Path) -> dict[str, Path]:
    """Every variant under `root`, by name."""
    from dynamo_stack import build_model_dir
    from tokenizers import Tokenizer, processors

    base = build_model_dir(root / "chatml")
    out = {"chatml": base}

    bos = root / "chatml_bos"
    shutil.copytree(base, bos)
    tokenizer = Tokenizer.from_file(str(bos / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    tokenizer.save(str(bos / "tokenizer.json"))
    _edit_json(bos / "tokenizer_config.json", add_bos_token=True)
    out["chatml_bos"] = bos

    parts = root / "parts"
    shutil.copytree(base, parts)
    _edit_json(parts / "tokenizer_config.json", chat_template=PARTS_TEMPLATE)
    out["parts"] = parts

    out["metaspace_first"] = _metaspace_first(root / "metaspace_first")
    return out


def _metaspace_first(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    path.mkdir(parents=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"})
    )
    return path

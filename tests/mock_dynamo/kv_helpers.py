"""Shared by the engine-model tests: an independent block-id computation and a tiny model dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

xxhash = pytest.importorskip("xxhash", reason="pip install -e '.[mock-kv]'")


def reference_ids(tokens: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """An independent write-up of Dynamo's hashing (dynamo-contract.md section 6)."""
    seed = 1337
    if salt:
        seed = (seed + xxhash.xxh3_64_intdigest(salt.encode(), seed=1)) % (1 << 64)
    content = []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        content.append(
            xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in chunk), seed=seed)
        )
    chained: list[int] = []
    for h in content:
        if chained:
            h = xxhash.xxh3_64_intdigest(
                chained[-1].to_bytes(8, "little") + h.to_bytes(8, "little"), seed=1337
            )
        chained.append(h)
    return chained


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_model_dir(path: Path) -> Path:
    """A tiny offline tokenizer: BPE trained here, a BOS post-processor, a ChatML template."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["The quick brown fox jumps over the lazy dog. Héllo wörld, 你好 🙂."] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}, "chat_template": CHATML}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path

"""pylon.tokenize against Dynamo 1.6.1's own code (``pytest -m dynamo``).

* The block hashes of the token ids pylon computes equal ``dynamo._core.compute_block_hash_for_seq``
  on the same ids (salted too), for the whole corpus in every dialect: what the router indexes.
* The Dynamo frontend's own token ids (its ``token_ids`` annotation: what it hands the worker, so
  what the worker's KV events are built from) equal pylon's ``dynamo`` dialect, for the corpus of
  chats and completion prompts, on a model dir whose tokenizer.json adds a BOS (the case where the
  frontend and vLLM differ: the frontend adds no special tokens to a completion prompt).

The frontend runs with one mocker worker on 127.0.0.1 (scripts/dynamo_stack.py), nothing else.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

core = pytest.importorskip(
    "dynamo._core", reason="ai-dynamo-runtime==1.6.1 is not installed (pip install -e '.[dynamo]')"
)
pytest.importorskip("xxhash", reason="pip install -e '.[dynamo]'")
pytest.importorskip("tokenizers", reason="pip install -e '.[dynamo]'")
pytest.importorskip("jinja2", reason="pip install -e '.[dynamo]'")
httpx = pytest.importorskip("httpx", reason="pip install -e '.[dynamo]'")

from pylon.core.blocks import block_hashes  # noqa: E402
from pylon.tokenize import CHAT_PATH, COMPLETIONS_PATH, Tokenizer  # noqa: E402
from tests.tokenizer_models import CONVERSATIONS, TEXTS  # noqa: E402

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(180)]

Models = dict[str, Path]
PARTS = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Héllo"}, {"type": "text", "text": "你好"}],
    },
]


def _requests() -> list[tuple[str, dict[str, Any]]]:
    chats = [(CHAT_PATH, {"messages": m}) for m in [*CONVERSATIONS, PARTS]]
    chats.append((CHAT_PATH, {"messages": CONVERSATIONS[2], "add_generation_prompt": False}))
    completions = [(COMPLETIONS_PATH, {"prompt": t}) for t in TEXTS]
    return chats + completions


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "dynamo"])
@pytest.mark.parametrize("salt", [None, "tenant-a", "租户"])
def test_block_hashes_of_pylons_ids_equal_dynamos(
    tokenizer_models: Models, dialect: Any, salt: str | None
) -> None:
    tokenizer = Tokenizer(tokenizer_models["chatml_bos"], dialect=dialect)
    for path, body in _requests():
        ids = tokenizer.prompt_tokens(path, json.dumps(body).encode())
        assert ids is not None, body
        for block_size in (4, 16):
            expected = core.compute_block_hash_for_seq(ids, block_size, cache_namespace=salt)
            assert block_hashes(ids, block_size, cache_salt=salt) == list(expected)


@pytest.fixture(scope="module")
def frontend(tokenizer_models: Models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Dynamo 1.6.1 frontend (one mocker worker) serving the BOS model dir as `tiny`."""
    for module in ("dynamo.frontend", "dynamo.mocker"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not importable: run scripts/install_dynamo.sh")
    from dynamo_stack import DynamoStack

    stack = DynamoStack(
        num_workers=1,
        speedup_ratio=0.0,
        router_queue_threshold=None,
        model_dir=tokenizer_models["chatml_bos"],
        state_dir=tmp_path_factory.mktemp("dynamo-tokenize"),
    )
    with stack:
        yield stack.frontend_url


def _frontend_ids(client: Any, path: str, body: dict[str, Any]) -> list[int]:
    """The token ids the frontend computed, from its `token_ids` annotation (an SSE comment)."""
    payload = {
        "model": "tiny",
        "max_tokens": 1,
        "stream": True,
        "nvext": {"annotations": ["token_ids"]},
        **body,
    }
    reply = client.post(path, json=payload)
    assert reply.status_code == 200, reply.text
    lines = reply.text.splitlines()
    at = lines.index("event: token_ids")
    comment = lines[at + 1]
    assert comment.startswith(": "), comment
    ids = json.loads(json.loads(comment[2:]))
    assert isinstance(ids, list)
    return ids


def test_the_frontends_token_ids_equal_pylons_dynamo_dialect(
    frontend: str, tokenizer_models: Models
) -> None:
    dynamo = Tokenizer(tokenizer_models["chatml_bos"], dialect="dynamo")
    vllm = Tokenizer(tokenizer_models["chatml_bos"], dialect="vllm")
    completions_differ = 0
    with httpx.Client(base_url=frontend, timeout=30) as client:
        for path, body in _requests():
            expected = _frontend_ids(client, path, body)
            ours = dynamo.prompt_tokens(path, json.dumps(body).encode())
            assert ours == expected, (path, body)
            if path == COMPLETIONS_PATH:
                # vLLM would start the same prompt with the BOS the frontend does not add.
                theirs = vllm.prompt_tokens(path, json.dumps(body).encode())
                assert theirs is not None and theirs[1:] == expected
                completions_differ += 1
        # A one-prompt list is that prompt (the frontend annotates no batch: compare the count).
        body = {"model": "tiny", "max_tokens": 1, "prompt": [TEXTS[1]]}
        usage = client.post(COMPLETIONS_PATH, json=body).json()["usage"]
        ours = dynamo.prompt_tokens(COMPLETIONS_PATH, json.dumps(body).encode())
        single = dynamo.prompt_tokens(COMPLETIONS_PATH, completion(TEXTS[1]))
        assert ours == single and ours is not None and usage["prompt_tokens"] == len(ours)
    assert completions_differ == len(TEXTS)


def completion(text: str) -> bytes:
    return json.dumps({"model": "tiny", "prompt": text}).encode()

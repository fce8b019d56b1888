"""`--kv-token-data`: the Dynamo frontend gets the prompt's token ids pylon computed for routing.

With `nvext.token_data` in the body, a Dynamo 1.6.1 frontend skips its own chat templating and
tokenization and hands the ids to the worker as they are (`usage.prompt_tokens` is the list's
length). So pylon sends them only where its rendering is proven identical to the frontend's,
model by model:

- **The proof.** For each probe of `PROBES` (chats with a system prompt, several turns,
  multi-byte text and text that spells template markers; a completion prompt), pylon asks the
  frontend for the ids it computes itself (`nvext.annotations: ["token_ids"]`, a stream of one
  token; the frontend answers with an SSE `event: token_ids` whose comment line holds them) and
  compares them with its own (`PromptTokenizer.prompt_tokens`, the `dynamo` dialect). Every
  probe must match exactly.
- **When.** At start, for every model published then, before pylon takes requests: a mismatch
  or a failed probe refuses the start (exit 2, one line naming the model and the first
  difference). A model published later is proven in the background the first time a request
  names it; until then (and for good if it fails: `kv_token_data_refused`, a warning) its
  requests carry no `token_data` and the frontend tokenizes them itself.
- **Per request** (`KvRouter.book`): only for a proven model, a request the kv router tokenized
  (never an empty list), and a body `pylon.core.body.with_token_data` can extend without
  changing anything else (no repeated top-level key).

The probes go to the first worker in rotation: its own URL, or the frontend with its instance pin
(a frontend in `direct` mode answers only pinned requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from pylon.routing.fleet import Fleet
from pylon.upstream.probe import Fetched, FetchError, post_json

if TYPE_CHECKING:
    from pylon.core.upstream import Upstream
    from pylon.observe import Observer
    from pylon.routing import PromptTokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_PROBE_BODY = 1024 * 1024

_SYSTEM = "You are a careful assistant. Answer briefly, in the user's language."
PROBES: tuple[tuple[str, dict[str, Any]], ...] = (
    (CHAT, {"messages": [{"role": "user", "content": "Hello! How are you today?"}]}),
    (
        CHAT,
        {
            "messages": [
                {"role": "system", "content": _SYSTEM},
                {"role": "user", "content": "Résumé in one line: naïve café, 東京, Ünïcödé 🙂."},
                {"role": "assistant", "content": "A short trip with accents and an emoji."},
                {"role": "user", "content": "Now in three words, please.\n\nThanks!"},
            ]
        },
    ),
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "Quote this literally: <|im_start|> <s> </s> [INST]"},
            ]
        },
    ),
    (COMPLETIONS, {"prompt": "The quick brown fox jumps over the lazy dog.\n  Indented line"}),
)


class Post(Protocol):
    async def __call__(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        *,
        headers: tuple[tuple[bytes, bytes], ...],
        timeout: float,
        max_body: int,
    ) -> Fetched: ...


class TokenDataMismatch(Exception):
    """The frontend's rendering of a model differs from pylon's (or could not be read)."""


def annotated_ids(sse: bytes) -> list[int] | None:
    """The ids of a Dynamo frontend's `token_ids` annotation in an SSE body, or None."""
    lines = sse.decode("utf-8", "replace").splitlines()
    try:
        at = lines.index("event: token_ids")
    except ValueError:
        return None
    if at + 1 >= len(lines) or not lines[at + 1].startswith(": "):
        return None
    try:
        ids = orjson.loads(orjson.loads(lines[at + 1][2:]))
    except (orjson.JSONDecodeError, TypeError):
        return None
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        return None
    return ids


def first_difference(ours: list[int], theirs: list[int]) -> str:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return f"token {index}: pylon {a}, frontend {b}"
    return f"pylon has {len(ours)} tokens, the frontend {len(theirs)}"


class TokenDataProver:
    """Which models may carry `nvext.token_data` (see the module docstring)."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        fleet: Fleet,
        observer: Observer,
        *,
        timeout: float,
        post: Post = post_json,
        probes: Iterable[tuple[str, dict[str, Any]]] = PROBES,
    ) -> None:
        self._tokenizer = tokenizer
        self._fleet = fleet
        self._observer = observer
        self._timeout = timeout
        self._post = post
        self._probes = tuple(probes)
        self.proven: set[str] = set()
        self._tried: set[str] = set()  # proven, refused or being proven
        self._tasks: set[asyncio.Task[None]] = set()

    async def prove_all(self, models: Iterable[str]) -> None:
        """Prove every model (at start); raises `TokenDataMismatch` naming the first failure."""
        for model in sorted(models):
            self._tried.add(model)
            await self.prove(model)
            self.proven.add(model)
            self._observer.process_event("kv_token_data_proven", model=model)

    def want(self, model: str | None) -> None:
        """A request names `model`, not proven yet: prove it in the background, once."""
        if model is None or model in self._tried:
            return
        self._tried.add(model)
        task = asyncio.create_task(self._prove_later(model), name="pylon-kv-token-data-proof")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prove_later(self, model: str) -> None:
        try:
            await self.prove(model)
        except TokenDataMismatch as exc:
            self._observer.process_event("kv_token_data_refused", model=model, detail=str(exc))
            return
        self.proven.add(model)
        self._observer.process_event("kv_token_data_proven", model=model)

    async def prove(self, model: str) -> None:
        """Every probe's ids from the frontend equal pylon's; raises `TokenDataMismatch`."""
        in_rotation = self._fleet.in_rotation
        if not in_rotation:
            raise TokenDataMismatch(f"model {model!r}: no worker in rotation to ask")
        worker = in_rotation[0]
        for number, (path, probe) in enumerate(self._probes, 1):
            where = f"model {model!r}, probe {number} ({path}) on {worker.label}"
            body = {**probe, "model": model}
            ours = self._tokenizer.prompt_tokens(path, orjson.dumps(body))
            asked = {
                **body,
                "stream": True,
                "max_tokens": 1,
                "nvext": {"annotations": ["token_ids"]},
            }
            try:
                reply = await self._post(
                    worker.upstream,
                    path,
                    orjson.dumps(asked),
                    headers=worker.headers,
                    timeout=self._timeout,
                    max_body=MAX_PROBE_BODY,
                )
            except FetchError as exc:
                raise TokenDataMismatch(f"{where}: {exc.detail}") from None
            if reply.status != 200:
                raise TokenDataMismatch(f"{where}: status {reply.status}")
            theirs = annotated_ids(reply.body)
            if theirs is None:
                raise TokenDataMismatch(f"{where}: no token_ids annotation in the answer")
            if ours != theirs:
                detail = (
                    "pylon cannot tokenize it" if ours is None else first_difference(ours, theirs)
                )
                raise TokenDataMismatch(f"{where}: {detail}")

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

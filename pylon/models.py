"""Which models this pylon publishes: the catalog (sans-I/O) and the `/v1/models` list parser.

The catalog is the one set admission reads (`Lifecycle.models`): a tunnel request whose
`x-model` is not in it gets `503 model_generation_unavailable` (retryable) and never reaches the
engine. It is filled once from `--model` (static) or by every successful discovery poll
(`pylon.bringup.ModelDiscovery`); both go through `apply`, which is pure:

- the new set replaces the old one (a valid empty list retires everything);
- each appearance of a name (first, or again after it was retired) is a new **generation** of
  that model: a counter per name, 1 for its first appearance, never reused while remembered;
- a failed poll never reaches `apply`: the last good set stays published.

`parse_model_list` turns an engine's `/v1/models` body (OpenAI list shape
`{"object": "list", "data": [{"id": ...}, ...]}`) into sorted, de-duplicated names, or raises
`ModelListError` naming what is wrong; a list is taken whole or not at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

from pylon.core.contract import MAX_MODEL_CHARS

# One poll's list: more names than this is a broken engine, not a catalogue.
MAX_MODELS = 4096
# Per-name generation counters of retired models are remembered up to this many names (oldest
# first-seen forgotten first), so an engine cycling through fresh names cannot grow pylon's memory.
MAX_REMEMBERED_MODELS = 65536
# What `x-model` may carry (pylon.core.contract): a name outside it could never be asked for.
_ADDRESSABLE = re.compile(r"[\x20-\x7e]+")


class ModelListError(ValueError):
    """The engine's model list is not usable; the message says why (one line)."""


@dataclass(frozen=True, slots=True)
class CatalogChange:
    """What one `apply` changed: (name, generation) pairs, sorted by name."""

    published: tuple[tuple[str, int], ...]
    retired: tuple[tuple[str, int], ...]

    def __bool__(self) -> bool:
        return bool(self.published or self.retired)


class ModelCatalog:
    """The published models and each name's generation. Pure: no I/O, no clock."""

    __slots__ = ("_change_listeners", "_generations", "_retire_listeners", "published")

    def __init__(self) -> None:
        self.published: frozenset[str] = frozenset()
        # Appearances per name ever seen (bounded): the generation of a published name.
        self._generations: dict[str, int] = {}
        self._retire_listeners: list[Callable[[str], None]] = []
        self._change_listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every `apply` that changed the published set."""
        self._change_listeners.append(listener)

    def on_retire(self, listener: Callable[[str], None]) -> None:
        """Call `listener(name)` for each model `apply` retires: what was learnt about a
        generation (e.g. its measured prefill throughput) must not outlive it."""
        self._retire_listeners.append(listener)

    def generation(self, name: str) -> int | None:
        """The generation of `name` while it is published; None when it is not."""
        return self._generations[name] if name in self.published else None

    def apply(self, names: Iterable[str]) -> CatalogChange:
        """Publish exactly `names` (a static set or one successful poll)."""
        new = frozenset(names)
        old = self.published
        retired = tuple((name, self._generations[name]) for name in sorted(old - new))
        published = []
        for name in sorted(new - old):
            generation = self._generations.pop(name, 0) + 1  # re-inserted: now the newest
            self._generations[name] = generation
            published.append((name, generation))
        self.published = new
        self._forget_old()
        for name, _ in retired:
            for listener in self._retire_listeners:
                listener(name)
        if new != old:
            for changed in self._change_listeners:
                changed()
        return CatalogChange(tuple(published), retired)

    def _forget_old(self) -> None:
        excess = len(self._generations) - MAX_REMEMBERED_MODELS
        if excess <= 0:
            return
        for name in [name for name in self._generations if name not in self.published][:excess]:
            del self._generations[name]


def parse_model_list(body: bytes) -> tuple[str, ...]:
    """The model ids of an OpenAI-style list, trimmed, sorted and de-duplicated.

    Raises `ModelListError` when the body is not JSON, not `{"data": [...]}` (with `object`,
    when present, `"list"`), an entry is not an object with a string `id`, an id is blank, longer
    than 256 characters or not printable ASCII (`x-model` could never name it), or there are
    more than 4096 entries.
    """
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ModelListError("the model list is not valid JSON") from None
    if not isinstance(document, dict):
        raise ModelListError("the model list is not a JSON object")
    kind = document.get("object", "list")
    if kind != "list":
        raise ModelListError(f'the model list\'s "object" is {_short(kind)}, not "list"')
    data = document.get("data")
    if not isinstance(data, list):
        raise ModelListError('the model list has no "data" array')
    if len(data) > MAX_MODELS:
        raise ModelListError(f"the model list has more than {MAX_MODELS} entries")
    names = set()
    for index, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            raise ModelListError(f'data[{index}] is not an object with a string "id"')
        name = entry["id"].strip()
        if not name:
            raise ModelListError(f"data[{index}].id is blank")
        if len(name) > MAX_MODEL_CHARS or not _ADDRESSABLE.fullmatch(name):
            raise ModelListError(
                f"data[{index}].id is not 1-{MAX_MODEL_CHARS} printable ASCII characters "
                "(no x-model could name it)"
            )
        names.add(name)
    return tuple(sorted(names))


def _short(value: object) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."

"""The members of a usage object pylon reads (`pylon.core.usage`), as msgspec decodes them.

A module of its own so that it stays interpreted in the optional compiled build
(docs/mypyc-notes.md): mypyc rewrites the annotations of a `msgspec.Struct` declared in a
compiled module, and msgspec then refuses every count.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]


class Counts(msgspec.Struct):
    """The members of a usage object pylon reads; any other member is skipped unbuilt."""

    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    input_tokens: Count | None = None
    output_tokens: Count | None = None


# msgspec, as the body skim (`pylon.core.body`): typed (a JSON true or a negative number is no
# count) and already warm on the hot path.
decode_counts = msgspec.json.Decoder(Counts).decode

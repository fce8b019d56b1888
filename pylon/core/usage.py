"""Token counts of a response, for the metrics: what the engine reported, or an estimate.

Pure and cheap, as they run on every relayed response:

- `usage_of(data)`: the token counts of the last `"usage": {...}` object in `data`, a JSON body
  or SSE events (or their tail: usage comes last). OpenAI chat and completions (`prompt_tokens`,
  `completion_tokens`), the Responses API and Anthropic-style messages (`input_tokens`,
  `output_tokens`). Only the usage object itself is parsed, never the document around it: the key
  is found with a C scan from the end, and a flat object (the common case) is cut at its `}`.
- `data_events(block)`: how many SSE events with data a block of whole events holds, the `[DONE]`
  sentinel excepted: the output-token estimate when the engine reports no usage (engines stream
  about one token per event; a chat stream's role and finish chunks count too, so the estimate
  reads a token or two high). One C scan per block.

In valid JSON `"usage"` followed by a colon is always a key: a quote inside a string is escaped,
so generated text can never look like a usage object.
"""

from __future__ import annotations

import re

import msgspec

from pylon.core.usage_counts import decode_counts

USAGE_KEY = b'"usage"'
_JSON_WHITESPACE = b" \t\r\n"

# The usage object, anchored at its key, for the rare object that nests one (OpenAI's
# `prompt_tokens_details`): strings (with escapes) are skipped whole, so a brace inside a string
# does not end the object, and one level of nested objects is allowed. Each alternative starts
# with a different character, so matching is linear.
_STRING = rb'"(?:[^"\\]|\\.)*"'
_FLAT = rb'\{(?:[^{}"]|' + _STRING + rb")*\}"
_USAGE = re.compile(
    rb'"usage"\s*:\s*(\{(?:[^{}"]|' + _STRING + rb"|" + _FLAT + rb")*\})", re.DOTALL
)

_DONE_ENDINGS = (b"[DONE]\n\n", b"[DONE]\r\n\r\n")
# How far from a response's end a usage object is looked for (see `usage_at_end`).
USAGE_WINDOW = 512


# (input tokens, output tokens); either may be unknown, never both.
Usage = tuple[int | None, int | None]


def usage_of(data: bytes, start: int = 0) -> Usage | None:
    """The counts of the last usage object in `data` (its key at or after `start`) that has any;
    None when there is none.

    A `"usage": null` (OpenAI streams carry one in every chunk but the last) is skipped, and so
    is an object without a count in it or one that is not valid JSON. Of each pair of names the
    first present one is read (`prompt_tokens`, else `input_tokens`).
    """
    end = len(data)
    while (found := data.rfind(USAGE_KEY, start, end)) >= 0:
        value = found + len(USAGE_KEY)
        # The common case first: `"usage":{...}` with no object inside, cut at its first `}`.
        # (A cut that parses must end at the object's own `}`: an inner object would need its
        # `}` first, and a `}` inside a string leaves the string open.)
        if data.startswith(b":{", value):  # compact JSON: no search
            opening = value + 1
        else:
            opening = data.find(b"{", value, value + 16)
            if opening > 0 and data[value:opening].strip(_JSON_WHITESPACE) != b":":
                opening = -1  # `null`, or not a key at all
        if opening > 0:
            closing = data.find(b"}", opening)
            usage = _counts(data[opening : closing + 1]) if closing > 0 else None
            if usage is None and closing > 0:
                match = _USAGE.match(data, found)
                usage = _counts(match.group(1)) if match is not None else None
            if usage is not None:
                return usage
        end = found
    return None


def _counts(raw: bytes) -> Usage | None:
    """The counts of one usage object; None when it is not one or has none (a member of the
    wrong type voids the object). Of each pair, the chat name wins (`prompt_tokens`)."""
    try:
        counts = decode_counts(raw)
    except msgspec.DecodeError:
        return None
    given = counts.prompt_tokens if counts.prompt_tokens is not None else counts.input_tokens
    made = (
        counts.completion_tokens if counts.completion_tokens is not None else counts.output_tokens
    )
    return None if given is None and made is None else (given, made)


def usage_at_end(previous: bytes, last: bytes) -> Usage | None:
    """The usage in the last `USAGE_WINDOW` bytes of a response whose last two pieces (chunks of
    a body, or blocks of events) are `previous` and `last`.

    Engines write usage at the end (the body's last member, the stream's last events before
    `[DONE]`), so the rest of the response is never scanned: the cost is bounded whatever its
    size. Runs once per response: the common case (a compact, flat usage object) is inline.
    """
    data = last
    if previous and len(last) < USAGE_WINDOW:
        data = previous[len(last) - USAGE_WINDOW :] + last
    start = len(data) - USAGE_WINDOW if len(data) > USAGE_WINDOW else 0
    found = data.rfind(USAGE_KEY, start)
    if found < 0:
        return None
    value = found + len(USAGE_KEY)
    if data.startswith(b":{", value):
        closing = data.find(b"}", value)
        usage = _counts(data[value + 1 : closing + 1]) if closing > 0 else None
        if usage is not None:
            return usage
    return usage_of(data, start)  # anything else: the general search


def data_events(block: bytes) -> int:
    """SSE events with a `data:` field in a block of whole events, `[DONE]` excepted.

    Counts `data:` at the start of a line; an event with several data lines counts once per
    line (no engine pylon fronts writes them). The `[DONE]` sentinel ends a stream, so only the
    block's end is checked for it.
    """
    count = block.count(b"\ndata:") + block.startswith(b"data:")
    if block.endswith(_DONE_ENDINGS):
        count -= 1
    return count


# Where a `RequestRecord`'s token count came from (the `source` label of the token metrics).
FROM_USAGE = "usage"  # the engine's usage report
FROM_GATEWAY = "gateway"  # the gateway's x-input-tokens
FROM_ESTIMATE = "estimate"  # counted streamed data events

"""Per-backend priority derivation: exact formulas and order properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pylon.adapters import ADAPTERS, AdapterOptions, build_adapter
from pylon.adapters.base import I32_MAX
from pylon.adapters.dynamo import PRIORITY_HEADER, STRICT_PRIORITY_HEADER
from pylon.core.plan import Planner
from pylon.settings import Settings

from .helpers import tunnel

U32_MAX = 2**32 - 1
ceilings = st.integers(min_value=1, max_value=I32_MAX)
ranks = st.none() | st.integers(min_value=0, max_value=U32_MAX)
FAST = settings(max_examples=200, deadline=None)


def adapter(backend: str, ceiling: int, *, low_first: bool = False, derive: bool = True):
    return build_adapter(backend, AdapterOptions(ceiling, low_first), derive=derive)


def dynamo_value(ceiling: int, rank: int | None) -> int:
    write = adapter("dynamo", ceiling).derive(rank)
    assert write.body_priority is None
    headers = dict(write.headers)
    assert len(headers) == len(write.headers) == 2
    assert headers[STRICT_PRIORITY_HEADER] == b"0"
    return int(headers[PRIORITY_HEADER])


def body_value(backend: str, ceiling: int, rank: int | None, low_first: bool = False) -> int:
    write = adapter(backend, ceiling, low_first=low_first).derive(rank)
    assert write.headers == ()
    assert write.body_priority is not None
    return write.body_priority


# --- exact formulas ----------------------------------------------------------------------------


@FAST
@given(ceilings, ranks)
def test_dynamo_formula(ceiling: int, rank: int | None) -> None:
    expected = 0 if rank is None else max(0, ceiling - min(rank, ceiling))
    assert dynamo_value(ceiling, rank) == expected


@FAST
@given(ceilings, ranks)
def test_vllm_formula(ceiling: int, rank: int | None) -> None:
    expected = ceiling if rank is None else min(rank, ceiling)
    assert body_value("vllm", ceiling, rank) == expected


@FAST
@given(ceilings, ranks)
def test_sglang_formula(ceiling: int, rank: int | None) -> None:
    expected = 0 if rank is None else ceiling - min(rank, ceiling)
    assert body_value("sglang", ceiling, rank) == expected


@FAST
@given(ceilings, ranks)
def test_sglang_low_first_formula(ceiling: int, rank: int | None) -> None:
    expected = ceiling if rank is None else min(rank, ceiling)
    assert body_value("sglang", ceiling, rank, low_first=True) == expected


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
@FAST
@given(ceiling=ceilings, rank=ranks)
def test_kill_switch_writes_nothing(backend: str, ceiling: int, rank: int | None) -> None:
    write = adapter(backend, ceiling, derive=False).derive(rank)
    assert write.empty


@FAST
@given(ceilings, ranks)
def test_passthrough_writes_nothing(ceiling: int, rank: int | None) -> None:
    assert adapter("passthrough", ceiling).derive(rank).empty


@pytest.mark.parametrize(
    ("backend", "low_first"), [*((name, False) for name in ADAPTERS), ("sglang", True)]
)
@FAST
@given(ceiling=ceilings, rank=ranks)
def test_the_write_carries_the_derived_value(
    backend: str, low_first: bool, ceiling: int, rank: int | None
) -> None:
    """What spans and metrics report is the value the engine gets, wherever it travels."""
    write = adapter(backend, ceiling, low_first=low_first).derive(rank)
    if backend == "passthrough":
        assert write.value is None
    elif backend == "dynamo":
        assert write.value == dynamo_value(ceiling, rank)
    else:
        assert write.value == body_value(backend, ceiling, rank, low_first)
    assert adapter(backend, ceiling, derive=False).derive(rank).value is None


# --- order properties, in each engine's own polarity ------------------------------------------

# urgency(value) is larger for a value the engine schedules earlier.
POLARITY = {
    ("dynamo", False): lambda c, r: dynamo_value(c, r),  # higher first
    ("vllm", False): lambda c, r: -body_value("vllm", c, r),  # lower first
    ("sglang", False): lambda c, r: body_value("sglang", c, r),  # higher first
    ("sglang", True): lambda c, r: -body_value("sglang", c, r, True),  # lower first
}


def raw_value(backend: str, low_first: bool, ceiling: int, rank: int | None) -> int:
    if backend == "dynamo":
        return dynamo_value(ceiling, rank)
    return body_value(backend, ceiling, rank, low_first)


@pytest.mark.parametrize(("backend", "low_first"), sorted(POLARITY))
@FAST
@given(ceiling=ceilings, a=ranks, b=ranks)
def test_monotonic_bounded_absent_least_urgent(
    backend: str, low_first: bool, ceiling: int, a: int | None, b: int | None
) -> None:
    urgency = POLARITY[(backend, low_first)]
    for rank in (a, b):
        assert 0 <= raw_value(backend, low_first, ceiling, rank) <= ceiling
        # Absent maps to the least urgent value; nothing is less urgent than it.
        assert urgency(ceiling, rank) >= urgency(ceiling, None)
    assert urgency(ceiling, None) == urgency(ceiling, U32_MAX)
    if a is not None and b is not None and a <= b:
        # A more urgent rank (lower) never gets a less urgent engine value.
        assert urgency(ceiling, a) >= urgency(ceiling, b)
    # Rank 0 is the most urgent value there is.
    assert urgency(ceiling, 0) >= urgency(ceiling, a)


@pytest.mark.parametrize(("backend", "low_first"), sorted(POLARITY))
@FAST
@given(ceiling=ceilings, a=ranks, b=ranks)
def test_queue_level_is_the_engine_order(
    backend: str, low_first: bool, ceiling: int, a: int | None, b: int | None
) -> None:
    """The queue gate's level sorts requests exactly as the engine schedules the values pylon
    writes for them: a lower level exactly when the engine serves it earlier."""
    urgency = POLARITY[(backend, low_first)]
    level = adapter(backend, ceiling, low_first=low_first).queue_level
    assert 0 <= level(a) <= ceiling
    assert level(None) == ceiling  # absent: the least urgent, as the engine sees it
    assert (level(a) < level(b)) == (urgency(ceiling, a) > urgency(ceiling, b))
    assert (level(a) == level(b)) == (urgency(ceiling, a) == urgency(ceiling, b))


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
@FAST
@given(ceiling=ceilings, rank=ranks)
def test_queue_level_is_flat_when_no_priority_is_written(
    backend: str, ceiling: int, rank: int | None
) -> None:
    """Told no priority, the engine serves in arrival order: one level for everybody."""
    assert adapter(backend, ceiling, derive=False).queue_level(rank) == 0
    assert adapter("passthrough", ceiling).queue_level(rank) == 0


# --- worked examples (also in docs/api-contract.md) -------------------------------------------

EXAMPLES = [  # rank, dynamo, vllm, sglang, sglang low-first; C = 3600
    (0, 3600, 0, 3600, 0),
    (5, 3595, 5, 3595, 5),
    (3600, 0, 3600, 0, 3600),
    (10000, 0, 3600, 0, 3600),
    (None, 0, 3600, 0, 3600),
]


@pytest.mark.parametrize(("rank", "dyn", "vllm", "sgl", "sgl_low"), EXAMPLES)
def test_worked_examples(rank, dyn, vllm, sgl, sgl_low) -> None:
    assert dynamo_value(3600, rank) == dyn
    assert body_value("vllm", 3600, rank) == vllm
    assert body_value("sglang", 3600, rank) == sgl
    assert body_value("sglang", 3600, rank, low_first=True) == sgl_low


# --- through the planner: exactly once, spoofs gone --------------------------------------------

SPOOF_NAMES = [b"x-dynamo-request-priority", b"x-dynamo-request-strict-priority"]


@st.composite
def spoofs(draw):
    out = []
    for name in draw(st.lists(st.sampled_from(SPOOF_NAMES), max_size=6)):
        cased = bytes(c ^ 0x20 if 0x61 <= c <= 0x7A and draw(st.booleans()) else c for c in name)
        out.append(
            (
                draw(st.sampled_from([b"", b" "])) + cased,
                draw(st.sampled_from([b"99", b"-1", b"x"])),
            )
        )
    return out


@FAST
@given(ceiling=ceilings, rank=ranks, spoofed=spoofs())
def test_dynamo_headers_exactly_once_in_the_plan(ceiling: int, rank: int | None, spoofed) -> None:
    extra = list(spoofed)
    if rank is not None:
        extra.append((b"x-priority", str(rank).encode()))
    plan = Planner(adapter("dynamo", ceiling)).plan(tunnel(*extra), b'{"model":"m"}')
    found = [(n.strip().lower(), v) for n, v in plan.headers if n.strip().lower() in SPOOF_NAMES]
    expected = 0 if rank is None else ceiling - min(rank, ceiling)
    assert found == [
        (PRIORITY_HEADER, str(expected).encode()),
        (STRICT_PRIORITY_HEADER, b"0"),
    ]
    assert plan.body == b'{"model":"m"}'


@pytest.mark.parametrize("backend", sorted(ADAPTERS))
@pytest.mark.parametrize("derive", [True, False])
def test_client_priority_always_stripped(backend: str, derive: bool) -> None:
    request = tunnel(
        (b"x-priority", b"2"),
        (b"X-Vllm-Priority", b"-100"),
        (b"x-override-priority", b"100"),
        (b"X-Dynamo-Request-Priority", b"100"),
    )
    body_in = b'{"priority":-5,"model":"m"}'
    plan = Planner(adapter(backend, 3600, derive=derive)).plan(request, body_in)
    body = json.loads(plan.body)
    names = [n.lower() for n, _ in plan.headers]
    assert b"x-vllm-priority" not in names and b"x-override-priority" not in names
    if backend == "vllm" and derive:
        assert body == {"model": "m", "priority": 2}
    elif backend == "sglang" and derive:
        assert body == {"model": "m", "priority": 3598}
    else:
        assert body == {"model": "m"}
    if backend == "dynamo" and derive:
        assert names.count(PRIORITY_HEADER) == 1
    else:
        assert PRIORITY_HEADER not in names


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["trtllm", "", "Dynamo", "disabled"])
def test_unknown_backend(backend: str) -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        build_adapter(backend, AdapterOptions(3600), derive=True)
    with pytest.raises(ValidationError):
        Settings(backend=backend)


@pytest.mark.parametrize("ceiling", [0, -1, I32_MAX + 1])
def test_ceiling_out_of_range(ceiling: int) -> None:
    with pytest.raises(ValueError):
        AdapterOptions(ceiling)
    with pytest.raises(ValidationError):
        Settings(priority_ceiling=ceiling)

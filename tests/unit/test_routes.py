"""Routes served, per backend: every route an engine schedules carries pylon's priority and the
`x-model` model; every other route is refused, never forwarded unsteered.

The golden lists below are written out from the engines' own route tables (vLLM's OpenAI server
routers, SGLang's `srt/entrypoints/http_server.py`, Dynamo's frontend), independently of
`pylon/adapters/*.py`: deleting a route from a backend's table, or steering one differently,
fails a test here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pylon.adapters import AdapterOptions, build_adapter
from pylon.core.errors import BodyError, ErrorCode, RouteError
from pylon.core.plan import ForwardPlan, Planner

from .helpers import tunnel

SCHEDULED = "scheduled"  # priority written, body `model` required
NO_MODEL_FIELD = "scheduled, no model field"  # priority written, the route has no `model`
NOT_SCHEDULED = "not scheduled"  # forwarded as sent

GOLDEN: dict[str, dict[tuple[str, str], str]] = {
    "vllm": {
        ("POST", "/v1/chat/completions"): SCHEDULED,
        ("POST", "/v1/completions"): SCHEDULED,
        ("POST", "/v1/responses"): SCHEDULED,
        ("POST", "/v1/embeddings"): SCHEDULED,
        ("POST", "/v2/embed"): SCHEDULED,
        ("POST", "/pooling"): SCHEDULED,
        ("POST", "/classify"): SCHEDULED,
        ("POST", "/score"): SCHEDULED,
        ("POST", "/v1/score"): SCHEDULED,
        ("POST", "/rerank"): SCHEDULED,
        ("POST", "/v1/rerank"): SCHEDULED,
        ("POST", "/v2/rerank"): SCHEDULED,
        ("POST", "/invocations"): SCHEDULED,
        ("POST", "/inference/v1/generate"): SCHEDULED,
        ("GET", "/v1/models"): NOT_SCHEDULED,
        ("HEAD", "/v1/models"): NOT_SCHEDULED,
    },
    "sglang": {
        ("POST", "/v1/chat/completions"): SCHEDULED,
        ("POST", "/v1/completions"): SCHEDULED,
        ("POST", "/v1/responses"): SCHEDULED,
        ("POST", "/v1/embeddings"): SCHEDULED,
        ("POST", "/v1/classify"): SCHEDULED,
        ("POST", "/invocations"): SCHEDULED,
        ("POST", "/generate"): NO_MODEL_FIELD,
        ("PUT", "/generate"): NO_MODEL_FIELD,
        ("GET", "/v1/models"): NOT_SCHEDULED,
        ("HEAD", "/v1/models"): NOT_SCHEDULED,
    },
    "dynamo": {
        ("POST", "/v1/chat/completions"): SCHEDULED,
        ("POST", "/v1/completions"): SCHEDULED,
        ("POST", "/v1/responses"): SCHEDULED,
        ("POST", "/v1/embeddings"): SCHEDULED,
        ("POST", "/v1/messages"): SCHEDULED,
        ("GET", "/v1/models"): NOT_SCHEDULED,
        ("HEAD", "/v1/models"): NOT_SCHEDULED,
    },
}

# The scheduled routes whose engine request type reads a body `stream` (chat, completions,
# responses, generate, Anthropic messages; SGLang's /invocations as chat) for a body of
# `{"model", "input", "stream"}` (vLLM runs that on /invocations as embeddings): on every other
# scheduled route (embeddings, pooling, scoring, reranking) the engine answers one whole
# response whatever `stream` says, and pylon must read the request the same way.
READS_STREAM: dict[str, set[tuple[str, str]]] = {
    "vllm": {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/inference/v1/generate"),
    },
    "sglang": {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/invocations"),
        ("POST", "/generate"),
        ("PUT", "/generate"),
    },
    "dynamo": {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
    },
}

# Routes the engines serve (or a client may try) that pylon must refuse toward each backend.
REFUSED: dict[str, list[tuple[str, str]]] = {
    "vllm": [
        ("POST", "/v1/messages"),
        ("POST", "/v1/audio/transcriptions"),
        ("POST", "/v1/audio/translations"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/v1/chat/completions/render"),
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/sleep"),
        ("POST", "/generate"),
        ("GET", "/v1/responses/resp_1"),
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/chat/completions"),
        ("POST", "/V1/chat/completions"),
        ("POST", "/v1/chat/completions/"),
        ("POST", "/metrics"),
    ],
    "sglang": [
        ("POST", "/encode"),
        ("POST", "/classify"),
        ("POST", "/v1/score"),
        ("POST", "/v1/rerank"),
        ("POST", "/vertex_generate"),
        ("POST", "/v1/tokenize"),
        ("POST", "/flush_cache"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/abort_request"),
        ("POST", "/open_session"),
        ("POST", "/load_lora_adapter"),
        ("POST", "/pooling"),
        ("GET", "/generate"),
        ("POST", "/inference/v1/generate"),
    ],
    "dynamo": [
        ("POST", "/generate"),
        ("POST", "/pooling"),
        ("POST", "/invocations"),
        ("POST", "/v1/rerank"),
        ("POST", "/metrics"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/models"),
    ],
}

RANK = 7
# What each backend writes for x-priority: 7 (body priority; Dynamo: headers).
BODY_PRIORITY = {"vllm": RANK, "sglang": 3600 - RANK}


def planner(backend: str, derive: bool = True) -> Planner:
    return Planner(build_adapter(backend, AdapterOptions(3600), derive=derive))


def plan(backend: str, method: str, path: str, body: bytes, derive: bool = True) -> ForwardPlan:
    request = tunnel((b"x-priority", b"7"), target=path.encode() + b"?q=1", method=method.encode())
    return planner(backend, derive).plan(request, body)


def served() -> list[tuple[str, str, str, str]]:
    return [(b, m, p, how) for b, table in GOLDEN.items() for (m, p), how in table.items()]


def body_for(method: str) -> bytes:
    return b"" if method in ("GET", "HEAD") else b'{"model":"m","priority":-1,"input":"x"}'


@pytest.mark.parametrize("backend", sorted(GOLDEN))
def test_each_backend_serves_exactly_its_golden_routes(backend: str) -> None:
    adapter = build_adapter(backend, AdapterOptions(3600), derive=True)
    candidates = {route for table in GOLDEN.values() for route in table} | set(REFUSED[backend])
    served_routes = {route for route in candidates if adapter.route(*route) is not None}
    assert served_routes == set(GOLDEN[backend])


@pytest.mark.parametrize(("backend", "method", "path", "how"), served())
def test_every_served_route_carries_pylons_priority(
    backend: str, method: str, path: str, how: str
) -> None:
    planned = plan(backend, method, path, body_for(method))
    body = json.loads(planned.body) if planned.body else {}
    if backend == "dynamo":
        assert dict(planned.headers)[b"x-dynamo-request-priority"] == str(3600 - RANK).encode()
        assert "priority" not in body
    elif how == NOT_SCHEDULED:
        assert "priority" not in body
    else:
        assert body["priority"] == BODY_PRIORITY[backend]  # pylon's, never the client's -1
    assert (planned.method, planned.target) == (method, path + "?q=1")


@pytest.mark.parametrize(
    ("backend", "method", "path", "how"), [r for r in served() if r[3] != NOT_SCHEDULED]
)
def test_a_scheduled_route_needs_the_x_model_model(
    backend: str, method: str, path: str, how: str
) -> None:
    without = b'{"input":"x"}'
    if how == NO_MODEL_FIELD:
        # The route has no model field: nothing to check, the body goes as sent (plus priority).
        assert json.loads(plan(backend, method, path, without).body)["input"] == "x"
    else:
        with pytest.raises(BodyError) as refused:
            plan(backend, method, path, without)
        assert refused.value.code is ErrorCode.BODY_MODEL_MISSING
    with pytest.raises(BodyError) as other:
        plan(backend, method, path, b'{"model":"other"}')
    assert other.value.code is ErrorCode.MODEL_MISMATCH


@pytest.mark.parametrize(
    ("backend", "method", "path"), [(b, m, p) for b, routes in REFUSED.items() for m, p in routes]
)
@pytest.mark.parametrize("derive", [True, False])
def test_a_route_pylon_does_not_steer_is_refused(
    backend: str, method: str, path: str, derive: bool
) -> None:
    with pytest.raises(RouteError) as refused:
        plan(backend, method, path, body_for(method), derive=derive)
    assert refused.value.code is ErrorCode.ROUTE_NOT_SERVED
    assert refused.value.status == 404


@pytest.mark.parametrize("path", ["/pooling", "/tokenize", "/anything/at/all"])
def test_passthrough_forwards_every_route_and_writes_no_priority(path: str) -> None:
    planned = plan("passthrough", "POST", path, b'{"model":"m","priority":1}')
    assert json.loads(planned.body) == {"model": "m"}
    with pytest.raises(BodyError) as refused:
        plan("passthrough", "POST", path, b"{}")
    assert refused.value.code is ErrorCode.BODY_MODEL_MISSING


def test_get_models_stays_served_with_no_body_rules() -> None:
    for backend in GOLDEN:
        planned = plan(backend, "GET", "/v1/models", b"")
        assert planned.body == b"" and planned.stream_requested is False


def documented_routes(backend: str) -> set[tuple[str, str]]:
    """The (method, route) pairs docs/api-contract.md section 3.1 lists for `backend`."""
    text = (Path(__file__).parents[2] / "docs" / "api-contract.md").read_text()
    section = text.split("### 3.1 Routes served, per backend", 1)[1].split("\n## ", 1)[0]
    table = section.split(f"\n`{backend}`:\n", 1)[1].strip().split("\n\n", 1)[0]
    found: set[tuple[str, str]] = set()
    for row in table.splitlines()[2:]:
        methods, routes, _ = row.strip("|").split("|", 2)
        # Only the routes in the column's own text: `(...)` notes may name others.
        listed = re.sub(r"\(.*?\)", "", routes)
        for method in methods.split(","):
            found |= {(method.strip(), r) for r in re.findall(r"`(/[^`]*)`", listed)}
    return found


@pytest.mark.parametrize("backend", sorted(GOLDEN))
def test_the_contract_lists_each_backends_routes(backend: str) -> None:
    assert documented_routes(backend) == set(GOLDEN[backend])


@pytest.mark.parametrize(
    ("backend", "method", "path", "how"), [r for r in served() if r[3] != NOT_SCHEDULED]
)
def test_stream_is_read_only_where_the_engine_reads_it(
    backend: str, method: str, path: str, how: str
) -> None:
    """`"stream": true` on embeddings or a pooling route is one whole response from the
    engine: pylon must not time it or sample it as a stream (first-output timeout on the head,
    a prefill sample with no tokens)."""
    planned = plan(backend, method, path, b'{"model":"m","input":"x","stream":true}')
    assert planned.stream_requested is ((method, path) in READS_STREAM[backend])
    # The body goes as sent either way (the engine ignores the field where it has none).
    assert json.loads(planned.body)["stream"] is True


@pytest.mark.parametrize(
    ("body", "streams"),
    [
        (b'{"model":"m","messages":[],"stream":true}', True),  # chat
        (b'{"model":"m","prompt":"x","stream":true}', True),  # completions
        (b'{"model":"m","m\\u0065ssages":[],"stream":true}', True),  # chat, however spelt
        (b'{"model":"m","input":"x","stream":true}', False),  # embeddings
        (b'{"model":"m","queries":"q","documents":["d"],"stream":true}', False),  # rerank
        (b'{"model":"m","input":"x","o":{"messages":[]},"stream":true}', False),  # nested
        (b'{"model":"m","messages":[],"stream":false}', False),
    ],
)
def test_vllm_invocations_streams_only_as_chat_or_completions(body: bytes, streams: bool) -> None:
    """vLLM runs `/invocations` as the first request type the body validates as: chat (it has
    `messages`), completions (`prompt`), then embeddings and the pooling tasks, which have no
    `stream`. Pylon reads `stream` the same way."""
    planned = plan("vllm", "POST", "/invocations", body)
    assert planned.stream_requested is streams

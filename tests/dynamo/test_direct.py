"""pylon's `instance-id=` workers against a real Dynamo 1.6.1 frontend in `direct` router mode.

The frontend (``--router-mode direct``) routes only by the pin a request carries; a request with
none gets 400. Two mocker workers behind it; pylon runs in-process (`pylon.run.start`) with
``--routing round-robin|least-loaded --worker instance-id=<a> --worker instance-id=<b>``.

Which worker served a reply is read from the mockers' own logs: the reply's ``id`` is
``chatcmpl-<request id>`` and the worker logs ``request received request_id=<request id>``.

* pylon's pin (``x-dynamo-worker-instance-id``) is honoured: every reply comes from the worker
  pylon chose (round-robin turns; least-loaded avoids the worker busy with a long stream).
* Client pins (every pin header and alias, ``nvext.backend_instance_id`` / ``decode_worker_id``,
  an unknown id) never steer the frontend, and a client ``nvext.token_data`` never reaches it.
  (A leaked body pin would not show here: the frontend lets pylon's header beat every body pin;
  the body strip itself is unit-tested.)
* ``nvext.token_data`` computed by ``pylon.tokenize`` (``dynamo`` dialect) on the model dir the
  stack serves gives the same ``usage`` (prompt, completion, cached tokens) and finish reason as
  the frontend's own templating, sent straight to the frontend; and pylon itself with
  ``--routing kv --kv-token-data`` proves its rendering at start and sends its ids, with the
  same ``usage`` and finish reason as the frontend's own templating.

Run: ``pytest -m dynamo tests/dynamo/test_direct.py``.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed: pip install -e '.[dynamo]'")

from pylon.logs import configure_logging  # noqa: E402
from pylon.routing.fleet import INSTANCE_PIN_HEADER  # noqa: E402
from pylon.run import Running, start  # noqa: E402
from pylon.settings import load_settings  # noqa: E402
from tests.fleet import RoutingObserver  # noqa: E402
from tests.tokenizer_models import CONVERSATIONS  # noqa: E402

from .conftest import _missing_dependency  # noqa: E402
from .helpers import MODEL, generate_request_ids, pin_headers, prompt  # noqa: E402

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(60)]

CHAT = "/v1/chat/completions"
PIN = INSTANCE_PIN_HEADER.decode()
LOG_WAIT_S = 5.0
BLOCK_SIZE = 16  # scripts/dynamo_stack.py BLOCK_SIZE: the mockers' KV block size


@pytest.fixture(scope="module")
def direct_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Broker + frontend in `direct` mode + 2 mockers (realistic timing), on 127.0.0.1."""
    reason = _missing_dependency()
    if reason:
        pytest.skip(reason)
    from dynamo_stack import DynamoStack

    stack = DynamoStack(
        num_workers=2,
        speedup_ratio=1.0,  # a long stream stays in flight while the test looks
        router_queue_threshold=None,
        router_mode="direct",
        state_dir=tmp_path_factory.mktemp("dynamo-direct"),
        startup_timeout_s=60.0,
    )
    with stack:
        yield stack


@dataclass
class Pylon:
    running: Running
    observer: RoutingObserver
    client: Any  # httpx.AsyncClient

    def worker_of(self, request_id: str) -> str | None:
        """The worker label pylon chose for `request_id` (`instance-id=<id>`)."""
        return self.observer.finished[request_id].worker

    async def chat(
        self, request_id: str, payload: dict[str, Any], headers: Sequence[tuple[str, str]] = ()
    ) -> Any:
        hdrs = [("x-request-id", request_id), ("x-model", MODEL), *headers]
        return await self.client.post(self.running.url + CHAT, json=payload, headers=hdrs)


PylonFactory = Callable[..., Awaitable[Pylon]]


@pytest.fixture
async def make_pylon(direct_stack: Any) -> AsyncIterator[PylonFactory]:
    configure_logging("json", "warning")
    async with contextlib.AsyncExitStack() as exits:
        client = httpx.AsyncClient(timeout=30)
        exits.push_async_callback(client.aclose)

        async def factory(routing: str, **extra: Any) -> Pylon:
            settings = load_settings(
                {
                    "listen": "127.0.0.1:0",
                    "admin_listen": "127.0.0.1:0",
                    "upstream": direct_stack.frontend_url,
                    "backend": "dynamo",
                    "routing": routing,
                    "worker": [f"instance-id={wid}" for wid in direct_stack.worker_ids],
                    "log_level": "warning",
                    "worker_health_interval": 3600.0,
                    "worker_health_timeout": 5.0,
                    "model_discovery_interval": 3600.0,
                    **extra,
                }
            )
            observer = RoutingObserver()
            running = await exits.enter_async_context(start(settings, observer))
            return Pylon(running, observer, client)

        yield factory


def chat(content: str, max_tokens: int = 8, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def engine_request_id(reply_id: str) -> str:
    assert reply_id.startswith("chatcmpl-"), reply_id
    return reply_id.removeprefix("chatcmpl-")


def served_by(stack: Any, reply_id: str) -> int:
    """Index of the one mocker whose log received the engine request behind `reply_id`."""
    rid = engine_request_id(reply_id)
    deadline = time.monotonic() + LOG_WAIT_S
    while True:
        found = [i for i in range(2) if rid in generate_request_ids(stack.worker_log(i))]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(found) == 1, f"engine request {rid} found in worker logs {found}"
    return found[0]


def label(stack: Any, index: int) -> str:
    return f"instance-id={stack.worker_ids[index]}"


def test_the_frontend_is_in_direct_mode(direct_stack: Any) -> None:
    """Control: unpinned or unknown-pinned requests are refused; a pin lands where it says."""
    stack = direct_stack
    with httpx.Client(base_url=stack.frontend_url, timeout=30) as client:
        assert client.post(CHAT, json=chat("hi")).status_code == 400
        unknown = client.post(CHAT, json=chat("hi"), headers={PIN: "12345"})
        assert unknown.status_code == 400
        for index, wid in enumerate(stack.worker_ids):
            reply = client.post(CHAT, json=chat("hi"), headers={PIN: str(wid)})
            assert reply.status_code == 200, reply.text
            assert served_by(stack, reply.json()["id"]) == index
            # A body pin alone is honoured too: what pylon must never let a client send.
            body_pin = chat("hi", nvext={"backend_instance_id": wid})
            reply = client.post(CHAT, json=body_pin)
            assert reply.status_code == 200, reply.text
            assert served_by(stack, reply.json()["id"]) == index


async def test_round_robin_pins_are_honoured(direct_stack: Any, make_pylon: PylonFactory) -> None:
    stack = direct_stack
    pylon = await make_pylon("round-robin")
    served = []
    for n in range(6):
        rid = f"rr-{uuid.uuid4()}"
        reply = await pylon.chat(rid, chat(prompt(rid, 20), stream=n % 2 == 1))
        assert reply.status_code == 200, reply.text
        if n % 2:  # a stream: every chunk carries the same id
            first = next(line for line in reply.text.splitlines() if line.startswith("data: {"))
            reply_id = json.loads(first[6:])["id"]
        else:
            reply_id = reply.json()["id"]
        index = served_by(stack, reply_id)
        await pylon.observer.wait_done(n + 1)
        assert pylon.worker_of(rid) == label(stack, index), "reply not from pylon's choice"
        served.append(index)
    assert served == [0, 1, 0, 1, 0, 1]


async def test_least_loaded_pins_are_honoured(direct_stack: Any, make_pylon: PylonFactory) -> None:
    """A long stream holds one worker: every short request goes to the other one."""
    stack = direct_stack
    pylon = await make_pylon("least-loaded")
    long_id = f"long-{uuid.uuid4()}"
    headers = [("x-request-id", long_id), ("x-model", MODEL)]
    payload = chat(prompt(long_id, 20), max_tokens=2000, stream=True)
    async with pylon.client.stream(
        "POST", pylon.running.url + CHAT, json=payload, headers=headers
    ) as stream:
        assert stream.status_code == 200
        lines = stream.aiter_lines()
        first = await anext(line async for line in lines if line.startswith("data: {"))
        busy = served_by(stack, json.loads(first[6:])["id"])
        for n in range(3):
            rid = f"short-{n}-{uuid.uuid4()}"
            reply = await pylon.chat(rid, chat(prompt(rid, 20)))
            assert reply.status_code == 200, reply.text
            assert served_by(stack, reply.json()["id"]) == 1 - busy
            await pylon.observer.wait_done(n + 1)
            assert pylon.worker_of(rid) == label(stack, 1 - busy)
    # The client left the long stream: its booking ends and it was pylon's choice too.
    await pylon.observer.wait_done(4)
    assert pylon.worker_of(long_id) == label(stack, busy)
    assert sum(pylon.running.routing.active_bookings().values()) == 0  # type: ignore[union-attr]


async def test_client_pins_never_reach_the_frontend(
    direct_stack: Any, make_pylon: PylonFactory
) -> None:
    """Every client pin points at worker 1 (or at an unknown id, which direct would refuse):
    through pylon each request still lands where round-robin sends it, 0, 1, 0, 1, ...; a
    client `nvext.token_data` is dropped too (the frontend counts the real prompt)."""
    stack = direct_stack
    pylon = await make_pylon("round-robin")
    target = stack.worker_ids[1]
    pins: list[tuple[list[tuple[str, str]], dict[str, Any]]] = [
        (pin_headers(target), {}),
        ([], {"nvext": {"backend_instance_id": target}}),
        ([], {"nvext": {"decode_worker_id": target, "backend_instance_id": target}}),
        (pin_headers(target), {"nvext": {"decode_worker_id": target}}),
        ([(PIN, "12345")], {"nvext": {"backend_instance_id": 12345}}),
        ([("x-worker-instance-id", "12345")], {"nvext": {"decode_worker_id": 12345}}),
    ]
    served = []
    for n, (headers, extra) in enumerate(pins):
        rid = f"pin-{n}-{uuid.uuid4()}"
        reply = await pylon.chat(rid, chat(prompt(rid, 20), **extra), headers)
        assert reply.status_code == 200, reply.text
        index = served_by(stack, reply.json()["id"])
        await pylon.observer.wait_done(n + 1)
        assert pylon.worker_of(rid) == label(stack, index)
        served.append(index)
    assert served == [0, 1] * 3, f"client pins leaked: {served}"

    rid = f"tokens-{uuid.uuid4()}"
    plain = await pylon.chat(rid, chat(prompt(rid, 20)))
    spoofed = await pylon.chat(
        rid + "-spoof", chat(prompt(rid, 20), nvext={"token_data": [7, 8, 9]})
    )
    assert plain.status_code == spoofed.status_code == 200, spoofed.text
    prompt_tokens = plain.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 3
    assert spoofed.json()["usage"]["prompt_tokens"] == prompt_tokens


def test_token_data_gives_the_same_usage(direct_stack: Any) -> None:
    """pylon's `dynamo`-dialect token ids as `nvext.token_data` vs the frontend's own
    templating, same worker: same prompt token count, and the repeat hits the prefix cache
    exactly as a repeat of the plain request does (the engine saw the same token ids)."""
    from pylon.tokenize import CHAT_PATH, Tokenizer

    stack = direct_stack
    tokenizer = Tokenizer(stack.model_path, dialect="dynamo")
    unique = f"{uuid.uuid4().hex[:8]}: " + " ".join(f"word{n}" for n in range(40))
    conversations = [
        [{"role": "user", "content": unique}],
        *([{"role": "system", "content": unique}, *c] for c in CONVERSATIONS),
    ]

    def usage_of(reply: Any) -> tuple[dict[str, Any], str]:
        assert reply.status_code == 200, reply.text
        data = reply.json()
        return data["usage"], data["choices"][0]["finish_reason"]

    with httpx.Client(base_url=stack.frontend_url, timeout=30) as client:
        for index, messages in enumerate(conversations):
            wid = str(stack.worker_ids[index % 2])
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
            ids = tokenizer.prompt_tokens(CHAT_PATH, json.dumps(body).encode())
            assert ids, messages
            with_ids = {**body, "nvext": {"token_data": ids}}

            def send(payload: dict[str, Any], wid: str = wid) -> tuple[dict[str, Any], str]:
                return usage_of(client.post(CHAT, json=payload, headers={PIN: wid}))

            cold = send(body)  # warms the worker's prefix cache (if not already warm)
            tokens = send(with_ids)
            warm = send(body)
            assert tokens == warm, f"conversation {index}: {tokens} != {warm}"
            assert tokens[0]["prompt_tokens"] == len(ids) == cold[0]["prompt_tokens"]
            # Every full block the plain request left in the cache matched the ids pylon sent
            # (the last token may be recomputed: a prompt of whole blocks keeps one block back).
            cached = tokens[0]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE > 0, (index, cached)


async def test_pylon_sends_its_token_ids_and_replies_and_usage_stay_the_same(
    direct_stack: Any, make_pylon: PylonFactory
) -> None:
    """`--routing kv --kv-token-data` in front of the real frontend: the start proves pylon's
    rendering against the frontend's own (its token_ids annotation), then every KV-routed chat
    carries pylon's ids in `nvext.token_data`; usage and finish reason equal the frontend's own
    templating on the same worker and cache state (the mocker's text is random: not compared)."""
    pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime 1.6.1 is not installed")
    from pylon.routing.kv import KvBooking
    from pylon.tokenize import CHAT_PATH, Tokenizer

    stack = direct_stack
    wid = stack.worker_ids[0]
    pylon = await make_pylon(
        "kv",
        kv_token_data=True,
        tokenizer=str(stack.model_path),
        # One worker: every request lands where the direct control requests go. Its KV events
        # are not followed here (the mocker would bind them beyond loopback): the core routes
        # by load alone, which is all this test needs.
        worker=[f"instance-id={wid},kv-events=tcp://127.0.0.1:9,block-size={BLOCK_SIZE}"],
    )
    assert pylon.observer.of("kv_token_data_proven") == [{"model": MODEL}]
    routing = pylon.running.routing
    assert routing is not None and routing.kv is not None
    kv = routing.kv
    bodies: list[bytes | None] = []
    book = kv.book

    async def recording(plan: Any) -> Any:
        booking = await book(plan)
        bodies.append(booking.body if isinstance(booking, KvBooking) else None)
        return booking

    kv.book = recording  # type: ignore[method-assign]
    tokenizer = Tokenizer(stack.model_path, dialect="dynamo")
    unique = f"{uuid.uuid4().hex[:8]}: " + " ".join(f"word{n}" for n in range(40))
    conversations = [
        [{"role": "user", "content": unique}],
        *([{"role": "system", "content": unique}, *c] for c in CONVERSATIONS),
    ]
    with httpx.Client(base_url=stack.frontend_url, timeout=30) as direct:
        for index, messages in enumerate(conversations):
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
            ids = tokenizer.prompt_tokens(CHAT_PATH, json.dumps(body).encode())
            assert ids, messages
            cold = direct.post(CHAT, json=body, headers={PIN: str(wid)})
            assert cold.status_code == 200, cold.text
            rid = f"ids-{index}-{uuid.uuid4()}"
            through = await pylon.chat(rid, body)
            warm = direct.post(CHAT, json=body, headers={PIN: str(wid)})
            assert through.status_code == warm.status_code == 200, through.text
            sent = bodies[-1]
            assert sent is not None and json.loads(sent)["nvext"]["token_data"] == ids
            ours, theirs = through.json(), warm.json()
            assert ours["usage"] == theirs["usage"], index
            assert ours["usage"]["prompt_tokens"] == len(ids)
            assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
            await pylon.observer.wait_done(index + 1)
            assert pylon.worker_of(rid) == f"instance-id={wid}"

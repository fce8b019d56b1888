"""`--discover-instances` against a real Dynamo 1.6.1 frontend in `direct` router mode: the
catalogue is the `generate` instances the frontend's `/health` lists, and follows them.

Two mocker workers behind a `direct` frontend (it routes only by the pin a request carries, and
answers 400 to an unknown id), pylon in-process with ``--routing round-robin
--discover-instances``: pylon's catalogue is exactly the stack's instance ids (so every pinned
request is answered 200 by the worker pylon chose); a worker stopped with SIGTERM deregisters,
and pylon's catalogue drops it (``workers_reloaded``) while the other keeps serving.

Run: ``pytest -m dynamo tests/dynamo/test_discover.py``.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed: pip install -e '.[dynamo]'")

from pylon.logs import configure_logging  # noqa: E402
from pylon.run import start  # noqa: E402
from pylon.settings import load_settings  # noqa: E402
from tests.fleet import RoutingObserver  # noqa: E402

from .conftest import _missing_dependency  # noqa: E402
from .helpers import MODEL, prompt  # noqa: E402

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(90)]

CHAT = "/v1/chat/completions"


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = _missing_dependency()
    if reason:
        pytest.skip(reason)
    from dynamo_stack import DynamoStack

    with DynamoStack(
        num_workers=2,
        speedup_ratio=10.0,
        router_queue_threshold=None,
        router_mode="direct",
        state_dir=tmp_path_factory.mktemp("dynamo-discover"),
    ) as running:
        yield running


async def test_the_catalogue_follows_the_frontends_instances(stack: Any) -> None:
    configure_logging("json", "warning")
    settings = load_settings(
        {
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "upstream": stack.frontend_url,
            "backend": "dynamo",
            "routing": "round-robin",
            "discover_instances": True,
            "workers_file_interval": 0.2,
            "worker_health_interval": 3600.0,
            "worker_health_timeout": 5.0,
            "model_discovery_interval": 3600.0,
        }
    )
    observer = RoutingObserver()
    labels = [f"instance-id={wid}" for wid in stack.worker_ids]
    async with start(settings, observer) as running, httpx.AsyncClient(timeout=30) as client:
        assert running.routing is not None
        fleet = running.routing.fleet
        assert sorted(w.label for w in fleet.workers) == sorted(labels)

        async def chats(count: int) -> list[str]:
            chosen = []
            for _ in range(count):
                done = len(observer.finished)
                rid = f"disc-{uuid.uuid4()}"
                reply = await client.post(
                    running.url + CHAT,
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": prompt(rid, 8)}],
                        "max_tokens": 4,
                    },
                    headers={"x-request-id": rid, "x-model": MODEL},
                )
                assert reply.status_code == 200, reply.text  # the frontend knows the pin
                await observer.wait_done(done + 1)
                chosen.append(observer.finished[rid].worker)
            return chosen

        assert sorted(set(await chats(4))) == sorted(labels)
        listing = (await client.get(f"{running.admin_url}/workers")).json()
        assert listing["catalogue_source"] == f"discovery http://127.0.0.1:{stack.http_port}/health"

        mark = observer.mark()
        stack.signal_worker(1, signal.SIGTERM)  # deregisters in ~0.2 s
        reloaded = await observer.wait_for("workers_reloaded", after=mark, timeout=20)
        assert reloaded["removed"] == [labels[1]] and reloaded["added"] == []
        assert [w.label for w in fleet.workers] == [labels[0]]
        assert set(await chats(3)) == {labels[0]}

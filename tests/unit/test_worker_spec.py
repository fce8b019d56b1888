"""`--worker SPEC` and the routing settings: the parser (examples and properties), the
`[[worker]]` tables, the environment's `;`-separated list, and every start refusal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.routing.spec import WorkerSpec, WorkerSpecError, parse_worker_spec, worker_from_table
from pylon.settings import SettingsError, load_settings

U64_MAX = (1 << 64) - 1


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith(("PYLON_", "OTEL_")):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("url=http://127.0.0.1:9001", WorkerSpec(url="http://127.0.0.1:9001")),
        (
            " URL = http://Engine.local:9001/base/ , Block_Size=32 ,dp-size=2,"
            "kv-events=tcp://127.0.0.1:5557,kv-events=tcp://127.0.0.1:5558",
            WorkerSpec(
                url="http://engine.local:9001/base",
                kv_events=("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
                block_size=32,
                dp_size=2,
            ),
        ),
        ("url=http://localhost", WorkerSpec(url="http://localhost:80")),
        ("url=http://[::1]:8000", WorkerSpec(url="http://[::1]:8000")),
        (f"instance-id={U64_MAX}", WorkerSpec(instance_id=U64_MAX)),
        (
            "instance-id=0,kv-events=ipc:///tmp/kv.sock,block-size=1",
            WorkerSpec(instance_id=0, kv_events=("ipc:///tmp/kv.sock",), block_size=1),
        ),
    ],
)
def test_specs_parse(text: str, expected: WorkerSpec) -> None:
    spec = parse_worker_spec(text)
    assert spec == expected
    assert parse_worker_spec(spec.text()) == spec


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "an empty item"),
        ("url=http://a:1,", "an empty item"),
        ("url", "is not key=value"),
        ("url=", "url has no value"),
        ("host=http://a:1", "unknown key 'host'"),
        ("block-size=16", "exactly one of url="),
        ("url=http://a:1,instance-id=3", "exactly one of url="),
        ("url=http://a:1,url=http://b:1", "url is given twice"),
        ("url=https://a:1", "url must be http://"),
        ("url=http://user:pw@a:1", "may not carry credentials"),
        ("url=http://a:1/x?y=1", "may not carry a query"),
        ("url=http://a:0", "invalid port"),
        ("url=http://a:99999", "invalid port"),
        ("url=http://a b:1", "invalid host"),
        ("url=http://[zz]:1", "invalid IPv6 host"),
        ("instance-id=-1", "u64"),
        (f"instance-id={U64_MAX + 1}", "u64"),
        ("instance-id=0x10", "u64"),
        ("url=http://a:1,block-size=12", "power of two in 1..1024"),
        ("url=http://a:1,block-size=2048", "power of two in 1..1024"),
        ("url=http://a:1,block-size=0", "power of two in 1..1024"),
        ("url=http://a:1,block-size=sixteen", "block-size must be a decimal integer"),
        ("url=http://a:1,dp-size=0", "dp-size must be at least 1"),
        ("url=http://a:1,kv-events=udp://a:1", "tcp://HOST:PORT or ipc://PATH"),
        ("url=http://a:1,kv-events=tcp://a:1,dp-size=2", "one kv-events= endpoint per"),
    ],
)
def test_bad_specs_are_one_clear_line(text: str, needle: str) -> None:
    with pytest.raises(WorkerSpecError) as caught:
        parse_worker_spec(text)
    message = str(caught.value)
    assert needle in message, message
    assert "\n" not in message and message.startswith("worker spec ")
    assert "pw@" not in message or "credentials" in message


_hosts = st.one_of(
    st.sampled_from(["127.0.0.1", "localhost", "[::1]", "engine-0.local"]),
    st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True),
)
_endpoints = st.builds(
    "tcp://127.0.0.1:{}".format, st.integers(min_value=1, max_value=65535)
) | st.builds("ipc:///tmp/{}".format, st.from_regex(r"[a-z]{1,8}", fullmatch=True))


@st.composite
def specs(draw: st.DrawFn) -> WorkerSpec:
    dp = draw(st.integers(min_value=1, max_value=4))
    events = (
        tuple(draw(st.lists(_endpoints, min_size=dp, max_size=dp))) if draw(st.booleans()) else ()
    )
    block = 1 << draw(st.integers(min_value=0, max_value=10))
    if draw(st.booleans()):
        port = draw(st.integers(min_value=1, max_value=65535))
        base = draw(st.sampled_from(["", "/v", "/a/b"]))
        host = draw(_hosts)
        return WorkerSpec(
            url=f"http://{host}:{port}{base}", kv_events=events, block_size=block, dp_size=dp
        )
    wid = draw(st.integers(min_value=0, max_value=U64_MAX))
    return WorkerSpec(instance_id=wid, kv_events=events, block_size=block, dp_size=dp)


@given(specs())
def test_the_canonical_text_round_trips(spec: WorkerSpec) -> None:
    assert parse_worker_spec(spec.text()) == spec
    assert 0 <= spec.worker_id <= U64_MAX


@st.composite
def spliced_specs(draw: st.DrawFn) -> str:
    """A valid spec's text with a few characters cut out or put in: near misses, and now and
    then still a valid spec (random text alone never is one)."""
    text = draw(specs()).text()
    start = draw(st.integers(min_value=0, max_value=len(text)))
    end = draw(st.integers(min_value=start, max_value=min(len(text), start + 3)))
    return text[:start] + draw(st.text(max_size=3)) + text[end:]


@given(st.text(max_size=80) | spliced_specs())
def test_any_text_parses_or_is_one_clear_error(text: str) -> None:
    try:
        spec = parse_worker_spec(text)
    except WorkerSpecError as exc:
        assert "\n" not in str(exc).replace(repr(text), "")
    else:
        assert parse_worker_spec(spec.text()) == spec


@given(
    st.lists(
        st.sampled_from(
            [
                "url=http://a:1",
                "kv-events=tcp://a:2",
                "block-size=8",
                "dp-size=1",
                "instance-id=5",
                "x=1",
                "",
                "=",
                "url",
            ]
        ),
        max_size=6,
    )
)
def test_item_soup_never_breaks_the_parser(items: list[str]) -> None:
    try:
        spec = parse_worker_spec(",".join(items))
    except WorkerSpecError as exc:
        assert str(exc).startswith("worker spec ")
    else:
        assert parse_worker_spec(spec.text()) == spec


def test_a_worker_table() -> None:
    spec = worker_from_table(
        {"url": "http://127.0.0.1:9001", "kv-events": ["tcp://127.0.0.1:1"], "block_size": 32}
    )
    assert spec == WorkerSpec("http://127.0.0.1:9001", None, ("tcp://127.0.0.1:1",), 32, 1)
    with pytest.raises(WorkerSpecError, match="block_size must be a string or an integer"):
        worker_from_table({"url": "http://a:1", "block_size": 1.5})


def test_url_workers_get_stable_distinct_ids() -> None:
    a, b = parse_worker_spec("url=http://a:1"), parse_worker_spec("url=http://a:2")
    assert a.worker_id == parse_worker_spec("url=http://A:1/").worker_id != b.worker_id
    assert parse_worker_spec("instance-id=42").worker_id == 42


# --- settings --------------------------------------------------------------------------------

W1, W2 = "url=http://127.0.0.1:9001", "url=http://127.0.0.1:9002"


def test_routing_is_off_by_default() -> None:
    settings = load_settings({})
    assert settings.routing == "off" and settings.worker == () and settings.tokenizer is None


def test_workers_from_flags_env_and_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = load_settings({"routing": "round-robin", "worker": [W1, W2]})
    assert [spec.url for spec in settings.worker] == [
        "http://127.0.0.1:9001",
        "http://127.0.0.1:9002",
    ]
    monkeypatch.setenv("PYLON_WORKER", f"{W1},block-size=32; {W2}")
    monkeypatch.setenv("PYLON_ROUTING", "least-loaded")
    settings = load_settings({})
    assert settings.routing == "least-loaded"
    assert [spec.block_size for spec in settings.worker] == [32, 16]
    monkeypatch.delenv("PYLON_WORKER")
    config = tmp_path / "pylon.toml"
    config.write_text(
        'routing = "least-loaded"\n'
        '[[worker]]\nurl = "http://127.0.0.1:9001"\ndp-size = 1\n'
        '[[worker]]\nurl = "http://127.0.0.1:9002"\nblock-size = 64\n'
    )
    settings = load_settings({}, config)
    assert [spec.block_size for spec in settings.worker] == [16, 64]
    assert settings.model_dump(mode="json")["worker"] == [
        "url=http://127.0.0.1:9001,block-size=16,dp-size=1",
        "url=http://127.0.0.1:9002,block-size=64,dp-size=1",
    ]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"worker": [W1]}, "--worker needs --routing round-robin, least-loaded or kv"),
        ({"routing": "round-robin"}, "--routing round-robin needs at least one --worker"),
        ({"routing": "kv"}, "--routing kv needs at least one --worker"),
        (
            {"routing": "round-robin", "worker": [W1], "upstream_health_check_interval": 1},
            "--upstream-health-check-interval checks the one engine of --routing off",
        ),
        ({"routing": "round-robin", "worker": [W1, W1 + "/"]}, "is given twice"),
        (
            {
                "routing": "round-robin",
                "worker": ["instance-id=7", "instance-id=7"],
                "upstream": "http://127.0.0.1:8000",
            },
            "worker id 7 is given twice",
        ),
        (
            {
                "routing": "round-robin",
                "worker": ["instance-id=7"],
                "backend": "vllm",
                "upstream": "http://127.0.0.1:8000",
            },
            "needs --backend dynamo",
        ),
        ({"routing": "round-robin", "worker": ["instance-id=7"]}, "needs --upstream"),
        (
            {"routing": "round-robin", "worker": [W1], "upstream": "http://127.0.0.1:8000"},
            "--upstream is not used",
        ),
        ({"routing": "kv", "worker": [W1], "tokenizer": "/tmp"}, "has no kv-events= endpoint"),
        (
            {"routing": "kv", "worker": [W1 + ",kv-events=tcp://127.0.0.1:5557"]},
            "--routing kv needs --tokenizer DIR",
        ),
        ({"tokenizer": "/tmp"}, "--tokenizer is only used by --routing kv"),
        ({"routing": "round-robin", "worker": [W1], "tokenizer": "/tmp"}, "only used by"),
        ({"routing": "random", "worker": [W1]}, "invalid setting routing"),
        ({"routing": "round-robin", "worker": ["url=http://a:1,block-size=3"]}, "power of two"),
        (
            {"routing": "round-robin", "worker": [W1], "worker_health_path": "health"},
            "not a request path",
        ),
        ({"routing": "round-robin", "worker": [W1], "worker_eject_after": 0}, "worker_eject_after"),
        ({"kv_token_data": True}, "--kv-token-data needs --routing kv"),
        (
            {"routing": "least-loaded", "worker": [W1], "kv_token_data": True},
            "--kv-token-data needs --routing kv",
        ),
        (
            {
                "routing": "kv",
                "worker": [W1 + ",kv-events=tcp://127.0.0.1:5557"],
                "tokenizer": "/tmp",
                "backend": "vllm",
                "kv_token_data": True,
            },
            "--kv-token-data needs --backend dynamo",
        ),
    ],
)
def test_routing_settings_that_cannot_take_effect_are_refused(overrides: dict, needle: str) -> None:
    with pytest.raises(SettingsError) as caught:
        load_settings(overrides)
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


def test_mixed_url_and_instance_workers_behind_a_dynamo_frontend() -> None:
    settings = load_settings(
        {
            "routing": "kv",
            "worker": [
                "instance-id=18446744073709551615,kv-events=tcp://127.0.0.1:5557",
                W1 + ",kv-events=tcp://127.0.0.1:5558",
            ],
            "upstream": "http://127.0.0.1:8000",
            "tokenizer": "/tmp",
        }
    )
    assert [spec.label for spec in settings.worker] == [
        "instance-id=18446744073709551615",
        "http://127.0.0.1:9001",
    ]

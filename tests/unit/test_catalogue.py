"""The worker catalogue while pylon serves: `Fleet.replace` (the one change), the workers file's
parse and rules, and its watch (`pylon.routing.catalogue`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pylon.core.record import RequestRecord
from pylon.routing.catalogue import (
    MAX_WORKERS_FILE_BYTES,
    CatalogueError,
    CatalogueRules,
    CatalogueWatch,
    Reload,
    WorkersFileOptions,
    check_catalogue,
    parse_workers_file,
    read_workers_file,
)
from pylon.routing.fleet import Fleet, WorkerBooking
from pylon.routing.outlier import OutlierDetector, OutlierOptions, OutlierState
from pylon.routing.spec import MAX_WORKERS, WorkerSpec, catalogue_digest, parse_worker_spec
from tests.observers import EventObserver

# A small pool: the same URL with another block size is the same worker id with another spec.
POOL = [
    parse_worker_spec(f"url=http://127.0.0.1:{port},block-size={size}")
    for port in (8001, 8002, 8003, 8004)
    for size in (16, 32)
]
ROUND_ROBIN = CatalogueRules(mode="round-robin", instance_ids=False)


def distinct_ids(specs: list[WorkerSpec]) -> list[WorkerSpec]:
    """`specs` without a second spec of a worker id already in it."""
    seen: set[int] = set()
    kept = []
    for spec in specs:
        if spec.worker_id not in seen:
            seen.add(spec.worker_id)
            kept.append(spec)
    return kept


catalogues = st.lists(st.sampled_from(POOL), min_size=1, max_size=6).map(distinct_ids)


@given(old=catalogues, new=catalogues, admitted=st.sets(st.integers(0, 5)))
def test_replace_makes_the_new_list_the_catalogue_and_keeps_what_stayed(
    old: list[WorkerSpec], new: list[WorkerSpec], admitted: set[int]
) -> None:
    fleet = Fleet.from_specs(old, None)
    for index, worker in enumerate(fleet.workers):
        worker.active = index + 1  # bookings in flight, told apart
        if index in admitted:
            fleet.set_in_rotation(worker, True)
    before = {worker.spec: worker for worker in fleet.workers}
    rotation_changes: list[int] = []
    fleet.on_change(lambda: rotation_changes.append(1))

    change = fleet.replace(new)

    assert [worker.spec for worker in fleet.workers] == new
    assert [worker.index for worker in fleet.workers] == list(range(len(new)))
    assert fleet.digest == change.digest == catalogue_digest(new)
    assert {w.spec for w in change.kept} == set(old) & set(new)
    assert {w.spec for w in change.added} == set(new) - set(old)
    assert {w.spec for w in change.removed} == set(old) - set(new)
    for worker in change.kept:  # the same object, its state intact
        assert before[worker.spec] is worker
        assert not worker.removed
    for worker in change.added:
        assert not worker.in_rotation and not worker.ever_in_rotation and worker.active == 0
    for worker in change.removed:
        assert worker.removed and not worker.in_rotation
    assert set(fleet.in_rotation) == {w for w in change.kept if w.in_rotation}
    assert fleet.active == sum(w.active for w in change.kept)  # removed bookings: out of view
    assert bool(rotation_changes) == any(before[w.spec].index in admitted for w in change.removed)


def test_a_changed_spec_for_the_same_worker_id_is_removed_and_added() -> None:
    fleet = Fleet.from_specs([POOL[0], POOL[2]], None)
    change = fleet.replace([POOL[1], POOL[2]])  # worker 8001: block size 16 -> 32
    assert [w.spec for w in change.removed] == [POOL[0]]
    assert [w.spec for w in change.added] == [POOL[1]]
    assert [w.spec for w in change.kept] == [POOL[2]]


def test_a_late_release_on_a_removed_worker_touches_only_the_detached_worker() -> None:
    fleet = Fleet.from_specs([POOL[0], POOL[2]], None)
    for worker in fleet.workers:
        fleet.set_in_rotation(worker, True)
    gone = fleet.workers[0]
    booking = WorkerBooking(gone, "round-robin", None)
    assert fleet.active == 1
    fleet.replace([POOL[2]])
    assert fleet.active == 0 and fleet.in_rotation == (fleet.workers[0],)
    booking.complete(RequestRecord("h2", 1, 0.0))
    booking.complete(RequestRecord("h2", 1, 0.0))  # exactly once, still
    assert gone.active == 0 and fleet.active == 0
    fleet.set_in_rotation(gone, True)  # a health check that was in flight: moot
    assert gone not in fleet.in_rotation and not gone.in_rotation


def test_catalogue_listeners_hear_changes_only() -> None:
    fleet = Fleet.from_specs([POOL[0]], None)
    heard: list[object] = []
    fleet.on_catalogue(heard.append)
    assert not fleet.replace([POOL[0]]).changed
    assert heard == []
    change = fleet.replace([POOL[0], POOL[2]])
    assert heard == [change]
    assert change.fields() == {
        "added": [POOL[2].label],
        "removed": [],
        "kept": 1,
        "catalogue_digest": catalogue_digest([POOL[0], POOL[2]]),
    }


def test_the_outlier_cap_follows_the_fleet_and_forgets_removed_workers() -> None:
    options = OutlierOptions(
        consecutive=1, base_ejection=1.0, max_ejection=2.0, max_ejected_share=0.5
    )
    detector = OutlierDetector(options, 1)
    assert not detector.enabled  # never the last worker
    detector.resize(4)
    assert detector.enabled and detector.cap == 2
    state = OutlierState()
    assert detector.failure(state, "broken", 0.0, 4) is not None
    assert detector.ejected == 1
    detector.forget(state)
    assert detector.ejected == 0


# --- the workers file --------------------------------------------------------------------


def test_a_workers_file_holds_worker_tables_with_the_worker_keys() -> None:
    text = b"""
[[worker]]
url = "http://127.0.0.1:8001"
kv-events = ["tcp://127.0.0.1:5557"]
block_size = 32

[[worker]]
instance-id = 7
"""
    specs = parse_workers_file(text, "f")
    assert specs == (
        parse_worker_spec("url=http://127.0.0.1:8001,kv-events=tcp://127.0.0.1:5557,block-size=32"),
        parse_worker_spec("instance-id=7"),
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (b"[[worker]\n", "not valid TOML"),
        (b"\xff", "not UTF-8"),
        (b'routing = "kv"\n', "only [[worker]] tables belong in a workers file, not 'routing'"),
        (b'worker = "url=http://a:1"\n', "worker must be [[worker]] tables"),
        (b'[[worker]]\nurl = "https://a:1"\n', "url must be http://"),
        (b"[[worker]]\nport = 1\n", "unknown key 'port'"),
    ],
)
def test_a_workers_file_that_does_not_parse_is_one_line_naming_it(text: bytes, reason: str) -> None:
    with pytest.raises(CatalogueError) as caught:
        parse_workers_file(text, "--workers-file /etc/w.toml")
    message = str(caught.value)
    assert message.startswith("--workers-file /etc/w.toml: ") and reason in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("specs", "rules", "reason"),
    [
        ([], ROUND_ROBIN, r"no \[\[worker\]\] table"),
        ([POOL[0], POOL[1]], ROUND_ROBIN, "given twice"),
        (["instance-id=5"], ROUND_ROBIN, "needs --backend dynamo and --upstream"),
        (["instance-id=5", "instance-id=5"], CatalogueRules("round-robin", True), "twice"),
        ([POOL[0]], CatalogueRules("kv", False), "has no kv-events= endpoint"),
    ],
)
def test_a_catalogue_the_start_would_refuse_is_refused(
    specs: list[WorkerSpec | str], rules: CatalogueRules, reason: str
) -> None:
    parsed = [parse_worker_spec(s) if isinstance(s, str) else s for s in specs]
    with pytest.raises(CatalogueError, match=reason):
        check_catalogue(parsed, rules, "here")


def test_the_catalogue_is_bounded() -> None:
    specs = [parse_worker_spec(f"instance-id={n}") for n in range(MAX_WORKERS + 1)]
    rules = CatalogueRules("round-robin", True)
    check_catalogue(specs[:MAX_WORKERS], rules, "here")
    with pytest.raises(CatalogueError, match=f"at most {MAX_WORKERS}"):
        check_catalogue(specs, rules, "here")


def test_a_workers_file_is_read_up_to_its_cap_and_refused_beyond(tmp_path: Path) -> None:
    """The file is read bounded: a file at the cap is read whole, one byte more is refused
    (a runaway writer cannot make pylon hold it)."""
    path = tmp_path / "workers.toml"
    path.write_bytes(b"#" * MAX_WORKERS_FILE_BYTES)
    assert len(read_workers_file(path)) == MAX_WORKERS_FILE_BYTES
    path.write_bytes(b"#" * (MAX_WORKERS_FILE_BYTES + 1))
    with pytest.raises(CatalogueError, match=f"larger than {MAX_WORKERS_FILE_BYTES} bytes"):
        read_workers_file(path)


def write_workers(path: Path, *specs: WorkerSpec) -> bytes:
    text = "".join(f'[[worker]]\nurl = "{spec.url}"\n\n' for spec in specs).encode()
    path.write_bytes(text)
    return text


def test_the_watch_applies_changed_content_and_keeps_the_catalogue_for_a_broken_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "workers.toml"
    a, b = parse_worker_spec("url=http://127.0.0.1:8001"), parse_worker_spec("url=http://h:2")
    fleet = Fleet.from_specs([a], None)
    events = EventObserver()
    watch = CatalogueWatch(fleet, WorkersFileOptions(path, 1.0, ROUND_ROBIN), events)
    watch.prime(write_workers(path, a))

    assert watch.look(trigger="watch", force=False).change is None  # the same content
    write_workers(path, a, b)
    result = watch.look(trigger="watch", force=False)
    assert result.change is not None and [w.spec for w in result.change.added] == [b]
    assert [w.spec for w in fleet.workers] == [a, b]
    (reloaded,) = events.of("workers_reloaded")
    assert reloaded["added"] == [b.label] and reloaded["kept"] == 1
    assert reloaded["catalogue_digest"] == catalogue_digest([a, b])

    path.write_bytes(b"[[worker]]\nurl = ")  # a rewrite caught half-way, or a typo
    assert watch.look(trigger="watch", force=False).failed is not None
    assert watch.look(trigger="watch", force=False) == Reload()  # the same bytes: not again
    path.write_bytes(b"")  # an empty list: refused the same way
    assert "no [[worker]] table" in (watch.look(trigger="watch", force=False).failed or "")
    path.unlink()  # gone: kept too
    assert "no such file" in (watch.look(trigger="watch", force=False).failed or "")
    assert [w.spec for w in fleet.workers] == [a, b]
    failures = events.of("reload_failed")
    assert len(failures) == 3
    assert all(str(path) in f["failed"]["workers"] for f in failures)

    write_workers(path, b)
    result = watch.reload()  # SIGHUP: read now
    assert result.change is not None and [w.spec for w in result.change.removed] == [a]
    assert watch.reload().change is None and watch.reload().failed is None  # nothing new
    assert watch.reloads == 2 and watch.failures == 3


def test_a_mirror_fleet_follows_a_pushed_snapshot_of_spec_texts() -> None:
    authority = Fleet.from_specs([POOL[0], POOL[2]], None)
    mirror = Fleet.from_specs([POOL[0], POOL[2]], None)
    authority.replace([POOL[2], POOL[5]])
    change = mirror.replace_texts(authority.spec_texts())
    assert mirror.digest == authority.digest
    assert [w.spec for w in mirror.workers] == [w.spec for w in authority.workers]
    assert [w.spec for w in change.removed] == [POOL[0]]


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_parse_or_are_one_catalogue_error(data: bytes) -> None:
    try:
        specs = parse_workers_file(data, "f")
    except CatalogueError as exc:
        assert "\n" not in str(exc)
    else:
        assert all(isinstance(spec, WorkerSpec) for spec in specs)


@given(st.lists(st.sampled_from(POOL), max_size=5))
def test_a_file_of_tables_parses_back_to_its_specs(specs: list[WorkerSpec]) -> None:
    text = "".join(
        f'[[worker]]\nurl = "{spec.url}"\nblock-size = {spec.block_size}\n\n' for spec in specs
    )
    assert parse_workers_file(text.encode(), "f") == tuple(specs)


def test_the_read_interval_without_a_catalogue_source_is_a_warning() -> None:
    from pylon.preflight import config_warnings
    from pylon.settings import load_settings

    warned = config_warnings(load_settings({"workers_file_interval": 5}))
    assert [w.fields["setting"] for w in warned if w.event == "setting_ignored"] == [
        "workers_file_interval"
    ]

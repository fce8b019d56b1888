"""The node's processes and catalogue (issue 18): the booking authority reachable only by
pylon's own user on this host, its frames bounded, the supervisor's handovers private, the
replica sync never opened by accident, and a workers file bounded and never emptying the fleet."""

from __future__ import annotations

from mutations.anchors import Never, ReplaceExpr, ReplaceStatements
from mutations.spec import Mutation

AUTHORITY = "pylon/routing/authority.py"
WIRE = "pylon/routing/booking_wire.py"
HANDOVER = "pylon/supervisor/handover.py"
MODEL = "pylon/settings/model.py"
CATALOGUE = "pylon/routing/catalogue.py"

_AUTH_T = "tests/integration/test_booking_authority.py"
_WIRE_T = "tests/unit/test_booking_wire.py"
_SUP_T = "tests/unit/test_supervisor.py"
_SYNC_T = "tests/unit/test_replica_sync.py"
_CAT_T = "tests/unit/test_catalogue.py"
_RELOAD_T = "tests/integration/test_catalogue_reload.py"
_PRIVATE = f"{_AUTH_T}::test_the_socket_is_private"
_REFUSED = f"{_SYNC_T}::test_replica_settings_that_cannot_take_effect_are_refused[*]"

MUTATIONS = [
    Mutation(
        "booking authority",
        "a peer of another uid is served",
        Never(AUTHORITY, "_Client.connection_made", "uid != self._authority.uid"),
        {"core": (f"{_AUTH_T}::test_a_peer_of_another_uid_is_refused",)},
    ),
    Mutation(
        "booking authority",
        "the socket keeps the umask's mode (others may connect)",
        ReplaceStatements(AUTHORITY, "run_authority", "os.chmod(socket_path, 0o600)", ""),
        {"core": (_PRIVATE,)},
    ),
    Mutation(
        "booking authority",
        "a socket directory others may enter is used",
        Never(
            AUTHORITY,
            "prepare_socket_dir",
            "info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)",
        ),
        {"core": (_PRIVATE,)},
    ),
    Mutation(
        "booking authority",
        "a frame's length is not capped (a peer makes it buffer without bound)",
        Never(WIRE, "FrameReader.feed", "length > MAX_FRAME"),
        {"core": (f"{_WIRE_T}::test_a_frame_over_the_cap_is_refused_from_its_length_alone",)},
    ),
    Mutation(
        "supervisor",
        "a handover (naming the key files and the reset key) readable by others",
        ReplaceExpr(HANDOVER, "Handover.write", "0o600", "0o644"),
        {
            "core": (
                f"{_SUP_T}::"
                "test_a_process_rebuilds_the_supervisors_settings_without_reading_its_environment",
            )
        },
    ),
    Mutation(
        "replica sync",
        "replica settings accepted without --routing kv (ignored: nothing shares bookings)",
        Never(MODEL, "Settings._kv_settings_unused", "getattr(self, name)"),
        {"core": (_REFUSED,)},
    ),
    Mutation(
        "replica sync",
        "a sync port without peers opened (publishes to nobody it counts)",
        Never(
            MODEL,
            "Settings._replica_sync_complete",
            "self.replica_sync_port is not None and not self.replica_peer",
        ),
        {"core": (_REFUSED,)},
    ),
    Mutation(
        "worker catalogue",
        "a workers file of any size is read",
        Never(CATALOGUE, "read_workers_file", "len(data) > MAX_WORKERS_FILE_BYTES"),
        {"core": (f"{_CAT_T}::test_a_workers_file_is_read_up_to_its_cap_and_refused_beyond",)},
    ),
    Mutation(
        "worker catalogue",
        "more workers than the cap",
        Never(CATALOGUE, "check_catalogue", "len(specs) > MAX_WORKERS"),
        {"core": (f"{_CAT_T}::test_the_catalogue_is_bounded",)},
    ),
    Mutation(
        "worker catalogue",
        "an empty workers file empties the fleet",
        Never(CATALOGUE, "check_catalogue", "not specs"),
        {
            "core": (
                f"{_CAT_T}::"
                "test_the_watch_applies_changed_content_and_keeps_the_catalogue_for_a_broken_file",
                f"{_RELOAD_T}::test_the_watch_follows_the_file_and_a_broken_file_keeps_the_catalogue",
            )
        },
    ),
]

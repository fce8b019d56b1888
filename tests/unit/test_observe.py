"""`Observers`: every observer hears every event it handles, in order; quiet ones cost nothing."""

from __future__ import annotations

from typing import Any

from pylon.core.errors import ClientError, ErrorCode
from pylon.core.record import RequestRecord
from pylon.metrics import MetricsObserver
from pylon.observe import LogObserver, Observers, _ignore_record, quiet


class Noting(LogObserver):
    def __init__(self, name: str, heard: list[tuple[str, str]]) -> None:
        super().__init__()
        self._name = name
        self._heard = heard

    def admitted(self, record: RequestRecord) -> None:  # an override: not quiet any more
        self._heard.append((self._name, "admitted"))

    def complete(self, record: RequestRecord) -> None:
        self._heard.append((self._name, "complete"))

    def transport_event(self, kind: str, protocol: str, /, **fields: Any) -> None:
        self._heard.append((self._name, f"{kind}/{protocol}/{fields}"))

    @quiet
    def crashed(self, record: RequestRecord | None, exc: BaseException | None) -> None:
        raise AssertionError("a quiet handler is never called")


def test_events_reach_every_observer_in_order() -> None:
    heard: list[tuple[str, str]] = []
    both = Observers(Noting("first", heard), Noting("second", heard))
    record = RequestRecord("h2", 1, 0.0)
    both.admitted(record)
    both.complete(record)
    both.transport_event("h2_flood", "h2", kind="ping")
    both.crashed(record, None)
    both.rejected(record, ClientError("x", code=ErrorCode.MISSING_MODEL))  # LogObserver's line
    assert heard == [
        ("first", "admitted"),
        ("second", "admitted"),
        ("first", "complete"),
        ("second", "complete"),
        ("first", "h2_flood/h2/{'kind': 'ping'}"),
        ("second", "h2_flood/h2/{'kind': 'ping'}"),
    ]


def test_one_handler_is_called_directly_and_quiet_ones_not_at_all() -> None:
    heard: list[tuple[str, str]] = []
    alone = Noting("alone", heard)
    both = Observers(LogObserver(), alone)
    assert both.admitted == alone.admitted  # LogObserver.admitted is quiet
    assert both.first_output is _ignore_record  # quiet everywhere: a C call to nothing
    heard_nothing = both.first_output(RequestRecord("h2", 1, 0.0))  # type: ignore[func-returns-value]
    assert heard_nothing is None  # as the event's type says: the compiled exchange checks it
    assert both.output.__name__ == "_ignore"
    assert both.members[1] is alone


def test_an_event_field_may_be_named_kind() -> None:
    """The fields of a connection or process event are any keywords but the line's own keys
    (`event`, `protocol`): the real observers take a field `kind` (the HTTP/2 flood guard sends
    one) in both builds. The compiled build once named its positional-only parameter `kind` and
    raised TypeError here (mypyc does not keep such a name out of `**fields`)."""
    metrics = MetricsObserver("dynamo")
    both = Observers(LogObserver(), metrics)
    both.transport_event("h2_flood", "h2", kind="ping")
    both.process_event("listening", kind="tcp", port=1)
    for observer in (LogObserver(), metrics):
        observer.transport_event("h2_flood", "h2", kind="settings")
        observer.process_event("listening", kind="tcp", port=1)
    assert metrics.counts().transport_events == {("h2", "h2_flood"): 2}

"""`ExchangeHooks`, the moments of one exchange as a subscriber hears them; the moments, their
order and `RequestRecord` are described in `pylon.core.record`.

Apart from the record only for the optional mypyc build (docs/mypyc-notes.md): a Protocol in a
compiled module becomes a compiled trait, and most subscribers that subclass this one (bookings,
the tracers, test fakes; the queue entry is compiled) are interpreted classes, which may not
inherit from one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pylon.core.errors import PylonError
    from pylon.core.record import RequestRecord


class ExchangeHooks(Protocol):
    """The moments of one exchange (see the module docstring), as a subscriber hears them.

    Subclass it to inherit a no-op for every moment a subscriber does not care about.
    """

    __slots__ = ()

    def dispatched(self, record: RequestRecord) -> None:
        return None

    def response_head(self, record: RequestRecord) -> None:
        return None

    def first_output(self, record: RequestRecord) -> None:
        return None

    def output(self, record: RequestRecord, count: int) -> None:
        return None

    def complete(self, record: RequestRecord) -> None:
        return None

    def rejected(self, record: RequestRecord, error: PylonError) -> None:
        return None

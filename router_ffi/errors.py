"""One exception hierarchy for everything that crosses the router_ffi boundary.

Nothing native escapes: `dynamo._core.SelectionServiceError`, the binding's `ValueError`s and
`OverflowError`s are translated into these at the boundary, keeping the native `kind` and
`status_code` as plain fields.
"""

from __future__ import annotations

INSTALL_HINT = "install the dynamo extra: pip install 'pylon[dynamo]'"


class RouterFfiError(Exception):
    """Base of every error router_ffi raises."""


class DependencyMissing(RouterFfiError):
    """A dependency of KV-aware routing is not importable; the message says how to install it."""

    def __init__(self, module: str, detail: str = "") -> None:
        self.module = module
        tail = f" ({detail})" if detail else ""
        super().__init__(
            f"KV-aware routing needs {module}, which is not importable{tail}: {INSTALL_HINT}"
        )


class NativeUnavailable(DependencyMissing):
    """`ai-dynamo-runtime` (Dynamo's native selection core) is not installed or does not load."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("ai-dynamo-runtime==1.6.1 (dynamo._core.SelectionService)", detail)


class InvalidConfig(RouterFfiError, ValueError):
    """An invalid worker or service setting; `str(error)` is one line fit for a start-up refusal."""


class ServiceClosed(RouterFfiError):
    """The selection core was shut down; no call reaches the native object any more."""


class NativeCallFailed(RouterFfiError):
    """The native core refused or failed a call.

    `op` names the boundary method (`select_and_reserve`, `free`, ...), `kind` and `status_code`
    are the native error's own category (e.g. `not_ready`/503, `not_found`/404,
    `conflict`/409), or `invalid`/400 for input the binding rejected.
    """

    def __init__(self, op: str, kind: str, status_code: int, message: str) -> None:
        self.op = op
        self.kind = kind
        self.status_code = status_code
        self.message = message
        super().__init__(f"{op}: {message} (kind={kind}, status={status_code})")


class NoWorkerAvailable(NativeCallFailed):
    """No schedulable worker can take the request now (native 503): answer 503, retryable."""


class SelectionTimeout(NoWorkerAvailable):
    """The native selection did not answer in time; a booking it makes later is freed at once."""

    def __init__(self, op: str, timeout_s: float) -> None:
        super().__init__(op, "timeout", 503, f"no answer within {timeout_s:g} s")


class NotFound(NativeCallFailed):
    """The native core does not know the worker or reservation (native 404)."""


class InvalidRequest(NativeCallFailed):
    """The binding rejected the request's shape or values (a bug in pylon, not a client's)."""

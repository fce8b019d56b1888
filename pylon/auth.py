"""Tunnel authentication by bearer token: `--tunnel-token-file PATH`.

Every non-health request must carry `authorization: Bearer <token>` where `<token>` is the file's
content, trimmed. The file is the rotation interface: whoever issues tokens rewrites (or renames
over) it and pylon picks the new token up within `RECHECK_SECONDS`, without a restart.

Why check-on-request with a cached `stat` rather than a poller task: the check then costs one
float comparison on the hot path, a `stat` at most once per `RECHECK_SECONDS`, and there is no
task to start, stop or leak. The token itself never reaches a log line or an exception message.
"""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Sequence
from pathlib import Path

from pylon.core.errors import ClientError, ErrorCode
from pylon.core.http import Header
from pylon.logs import get_logger

# Upper bound on how long a rotated-away token keeps working. Tests shorten it.
RECHECK_SECONDS = 1.0
AUTHORIZATION = b"authorization"
_BEARER = b"bearer "
_OWS = b" \t"


class TokenFileError(OSError):
    """The token file cannot be used at start-up (missing, unreadable, empty).

    An OSError so that `pylon serve` reports it like any other start-up I/O failure.
    """


def unauthorized() -> ClientError:
    # One detail for every failure: a caller learns nothing about why its token was refused.
    return ClientError("missing or invalid tunnel token", code=ErrorCode.UNAUTHORIZED)


class TokenAuth:
    """The current tunnel token, re-read when its file changes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._log = get_logger()
        self._state: tuple[int, int, int] | None = None
        self._unusable: tuple[int, int, int] | None = None  # the broken file last told about
        self._next_check = 0.0
        token = self._read()
        if token is None:
            raise TokenFileError(f"tunnel token file {path} is missing, unreadable or empty")
        self._token = token

    @property
    def path(self) -> Path:
        return self._path

    @property
    def consumed(self) -> frozenset[bytes]:
        """Headers this check uses up: the tunnel credential is pylon's, never the engine's."""
        return frozenset({AUTHORIZATION})

    def allows(self, headers: Sequence[Header]) -> bool:
        """True when exactly one `authorization` header carries the current token."""
        self._refresh()
        presented: bytes | None = None
        for name, value in headers:
            if len(name) == 13 and name.lower() == AUTHORIZATION:
                if presented is not None:
                    return False  # two credentials: ambiguous, refuse
                presented = value.strip(_OWS)
        if presented is None or presented[:7].lower() != _BEARER:
            return False
        return hmac.compare_digest(presented[7:].strip(_OWS), self._token)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + RECHECK_SECONDS
        state = _file_state(self._path)
        if state is None or state == self._state:
            return
        if state == self._unusable:
            return  # a broken file is told about once, not at every check while it stays so
        token = self._read()
        if token is None:
            # Mid-rotation (truncated, renamed away) or broken: keep the last good token rather
            # than lock every caller out; the next change is picked up as usual.
            self._unusable = state
            self._log.warning("tunnel_token_unusable", path=str(self._path))
            return
        if token != self._token:
            self._log.info("tunnel_token_rotated", path=str(self._path))
        self._token = token

    def reload(self) -> bool:
        """Re-read the file now, changed or not (SIGHUP): True = the token was rotated, False
        = the same token. An unusable file raises `TokenFileError` and keeps the last good
        token in use."""
        token = self._read()
        if token is None:
            raise TokenFileError(f"{self._path}: missing, unreadable, empty or more than one line")
        self._next_check = time.monotonic() + RECHECK_SECONDS
        rotated = token != self._token
        self._token = token
        return rotated

    def _read(self) -> bytes | None:
        state = _file_state(self._path)
        try:
            token = self._path.read_bytes().strip()
        except OSError:
            return None
        if not token or b"\n" in token or b"\r" in token:
            return None
        self._state = state
        return token


def _file_state(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, mtime_ns): a rename over the file changes the inode, a rewrite the rest."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)

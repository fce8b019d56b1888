"""Which build of pylon is loaded: the pure-Python one, or the optional mypyc one.

`PYLON_MYPYC=1` at install time compiles the modules listed in setup.py (docs/mypyc-notes.md);
an extension module takes precedence over the `.py` beside it. `python -m pylon.build` prints
the compiled modules, one a line (nothing for the pure-Python build): those of the request
path on every transport and codec installed.
"""

from __future__ import annotations

import sys
from importlib.machinery import EXTENSION_SUFFIXES


def compiled_modules() -> list[str]:
    """The pylon modules imported so far that were loaded from a compiled extension."""
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith("pylon.")
        and (getattr(module, "__file__", None) or "").endswith(tuple(EXTENSION_SUFFIXES))
    )


if __name__ == "__main__":
    import contextlib

    import pylon.run  # imports the whole request path
    import pylon.server.http3  # imported when a QUIC listener starts

    with contextlib.suppress(ImportError):  # the ngh2 extra (--http2-codec ngh2) is optional
        import pylon.server.http2_ngh2  # noqa: F401

    for name in compiled_modules():
        print(name)

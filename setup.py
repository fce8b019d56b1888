"""The optional mypyc build of pylon's per-request modules (docs/mypyc-notes.md).

Without PYLON_MYPYC=1 (the default) this adds nothing: the package installs as pure Python,
needing no compiler. With it, the modules below are compiled by mypyc (which ships with mypy)
into extension modules that take precedence over their `.py` files at import. mypy must be
importable by the build, so build without isolation:

    pip install -e '.[dev]'                                      # mypy comes with the dev extra
    PYLON_MYPYC=1 pip install --no-build-isolation -e '.[dev]'   # compiled, in place
"""

from __future__ import annotations

import os

from setuptools import setup

# The per-request path: each module here compiles unchanged and behaves as its source. What keeps
# the others out is in docs/mypyc-notes.md (an interpreted subclass of a compiled class is
# refused at run time; a msgspec.Struct declared in a compiled module loses its field types).
COMPILED = [
    "pylon/adapters/dynamo.py",
    "pylon/core/body.py",
    "pylon/core/contract.py",
    "pylon/core/head.py",
    "pylon/core/http.py",
    "pylon/core/intake.py",
    "pylon/core/plan.py",
    "pylon/core/queue.py",
    "pylon/core/record.py",
    "pylon/core/retry.py",
    "pylon/core/sanitize.py",
    "pylon/core/sse.py",
    "pylon/core/upstream.py",
    "pylon/core/usage.py",
    "pylon/lifecycle.py",
    "pylon/logs.py",
    "pylon/metrics/observer.py",
    "pylon/observe.py",
    "pylon/proxy/admission.py",
    "pylon/proxy/exchange.py",
    "pylon/proxy/forwarding.py",
    "pylon/proxy/relay.py",
    "pylon/proxy/sink.py",
    "pylon/server/budget.py",
    "pylon/server/h3layer.py",
    "pylon/server/http1.py",
    "pylon/server/http2.py",
    "pylon/server/http2_ngh2.py",
    "pylon/server/http3.py",
    "pylon/server/quic_sink.py",
    "pylon/server/streams.py",
    "pylon/timers.py",
    "pylon/upstream/connection.py",
    "pylon/upstream/pool.py",
]


def _ext_modules() -> list[object]:
    if os.environ.get("PYLON_MYPYC") != "1":
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        raise SystemExit(
            "PYLON_MYPYC=1 needs mypy (mypyc) importable by the build: install the dev extra "
            "first, then pip install --no-build-isolation (see docs/mypyc-notes.md)"
        ) from exc
    modules = os.environ.get("PYLON_MYPYC_MODULES")  # a space-separated subset, for measuring
    return list(mypycify(modules.split() if modules else COMPILED, opt_level="3"))


setup(ext_modules=_ext_modules())

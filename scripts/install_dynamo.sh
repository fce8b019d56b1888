#!/usr/bin/env bash
# Install real NVIDIA Dynamo 1.6.1 (frontend + mocker) into the current Python environment, for
# the end-to-end tests in tests/dynamo and scripts/dynamo_stack.py.
#
# Two steps, because `pip install ai-dynamo==1.6.1` cannot succeed offline-from-NVIDIA:
#   ai-dynamo 1.6.1 declares aisimulate==0.13.0, which on PyPI is a `wheel_stub` sdist that
#   downloads the real wheel from NVIDIA's own package index at build time. Where that index is
#   unreachable pip fails with "metadata-generation-failed -> aisimulate". Only the planner,
#   profiler, dynamo.replay and router/simulation import aisimulate; the frontend, mocker, router
#   and _core do not. So:
#   1. `pip install -e '.[dynamo]'`   pylon + ai-dynamo-runtime==1.6.1 + everything the frontend
#                                      and mocker import (msgspec, pyyaml, packaging), pyzmq for
#                                      the event-plane broker, tokenizers for the offline model,
#                                      and the test client/runner;
#   2. `pip install --no-deps ai-dynamo==1.6.1`   the Python package (dynamo.frontend,
#                                      dynamo.mocker, ...) without its declared dependencies.
#
# Usage: scripts/install_dynamo.sh            (uses $VIRTUAL_ENV, else ./.venv, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${VIRTUAL_ENV:-}" ]]; then
    PY="$VIRTUAL_ENV/bin/python"
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
echo "installing into: $("$PY" -c 'import sys; print(sys.prefix)')"
"$PY" -m pip install -e '.[dynamo]'
"$PY" -m pip install --no-deps 'ai-dynamo==1.6.1'
"$PY" -c 'import dynamo.frontend, dynamo.mocker, zmq, tokenizers; print("dynamo 1.6.1 ready")'

#!/bin/bash
# CPU per proxied request of one pylon checkout, HTTP/1.1, against the canned upstream.
#
#   scripts/bench/pylon_cpu.sh TREE [STREAM]
#
# TREE: the pylon checkout to measure (its directory goes first on PYTHONPATH). STREAM=1: the
# unpaced 20-event SSE response instead of the 1 KB JSON one. Starts the canned upstream and
# pylon (access log off), warms up with wrk for 2 s, then reads pylon's user and system CPU from
# /proc/<pid>/stat around a 6 s wrk run (32 connections) and prints
#   req N user us/req X sys us/req Y
# EXTRA: more `pylon serve` arguments. The default suits a pylon with the model gate (issue 10):
# the canned upstream lists no models, so it is given one. For an older checkout that has no
# --model or --admin-listen, pass EXTRA="". PORTS: "UPSTREAM PYLON" (default "19001 19002").
#
# Single runs on a shared machine vary by several us: alternate the checkouts being compared,
# e.g. for i in 1 2 3 4; do for T in /tmp/before "$PWD"; do scripts/bench/pylon_cpu.sh $T; done; done
set -euo pipefail
TREE=$(cd "$1" && pwd)
STREAM=${2:-0}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
read -r UP_PORT PY_PORT <<<"${PORTS:-19001 19002}"
EXTRA=${EXTRA---model mock-model --admin-listen 127.0.0.1:0}
LOG=$(mktemp)

"$PYTHON" "$REPO/scripts/bench/canned_upstream.py" --port "$UP_PORT" >/dev/null 2>&1 &
UP=$!
# shellcheck disable=SC2086  # EXTRA is a list of arguments
(cd /tmp && PYTHONPATH=$TREE exec "$PYTHON" -m pylon serve --listen "127.0.0.1:$PY_PORT" \
  --upstream "http://127.0.0.1:$UP_PORT" --backend dynamo --log-level warning $EXTRA >"$LOG" 2>&1) &
PY=$!
trap 'kill $PY $UP 2>/dev/null; wait 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:$PY_PORT/" && break; sleep 0.2; done

LUA=$REPO/scripts/bench/wrk_post.lua
URL=http://127.0.0.1:$PY_PORT/v1/chat/completions
BENCH_STREAM=$STREAM wrk -t1 -c32 -d2s -s "$LUA" "$URL" >/dev/null
read -r u0 s0 < <(awk '{print $14, $15}' "/proc/$PY/stat")
OUT=$(BENCH_STREAM=$STREAM wrk -t1 -c32 -d6s -s "$LUA" "$URL")
read -r u1 s1 < <(awk '{print $14, $15}' "/proc/$PY/stat")
N=$(sed -n 's/.*BENCH_JSON.*"requests":\([0-9]*\).*/\1/p' <<<"$OUT")
TICK=$(getconf CLK_TCK)
"$PYTHON" -c "import sys; n, u0, u1, s0, s1, t = map(float, sys.argv[1:]); \
print('req', int(n), 'user us/req', round((u1 - u0) * 1e6 / t / n, 1), \
'sys us/req', round((s1 - s0) * 1e6 / t / n, 1))" "$N" "$u0" "$u1" "$s0" "$s1" "$TICK"

#!/bin/bash
# Instructions per proxied request of one pylon checkout, HTTP/1.1, counted by callgrind.
#
#   scripts/bench/pylon_instructions.sh TREE [STREAM] [REQUESTS]
#
# Why: on a shared 2-core VM the CPU time of one request moves by 20-30% between runs of the
# same build (even a pure Python loop does), so a change of a few percent cannot be seen in
# `pylon_cpu.sh` without dozens of rounds. The user-space instructions pylon executes per
# request do not depend on how busy the box is: two runs of one build agree within 0.3%.
# They leave out the kernel (system CPU, the same syscalls per request for every build compared
# so far) and cache misses, so they complement the timed runs rather than replace them.
#
# TREE: the pylon checkout to measure (first on PYTHONPATH). STREAM=1: the 20-event SSE
# response instead of the 1 KB JSON one. REQUESTS: how many are counted (default 2000, after
# 300 uncounted to warm up). Runs pylon (access log off) under `valgrind --tool=callgrind`
# in front of the canned upstream, drives it with h2load over HTTP/1.1 (8 connections), zeroes
# the counters after the warm-up and dumps them after the counted requests; prints
#   Ir/req N
# Needs valgrind and h2load (Debian: valgrind nghttp2-client). ~45 s per run.
# PACE_MS=1: the upstream writes the stream's events 1 ms apart (each a read and a write through
# pylon: the per-token relay cost), with STREAM=1.
# PROTOCOL=h2c: the same requests over HTTP/2 (cleartext, prior knowledge) instead of HTTP/1.1.
# EXTRA: more `pylon serve` arguments; the default suits a pylon with the model gate (issue 10);
# for an older checkout pass EXTRA="". PORTS: "UPSTREAM PYLON" (default "19011 19012").
set -euo pipefail
TREE=$(cd "$1" && pwd)
STREAM=${2:-0}
REQUESTS=${3:-2000}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
read -r UP_PORT PY_PORT <<<"${PORTS:-19011 19012}"
EXTRA=${EXTRA---model mock-model --admin-listen 127.0.0.1:0}
WORK=$(mktemp -d)

"$PYTHON" "$REPO/scripts/bench/canned_upstream.py" --port "$UP_PORT" --pace-ms "${PACE_MS:-0}" \
  >/dev/null 2>&1 &
UP=$!
# shellcheck disable=SC2086  # EXTRA is a list of arguments
(cd "$WORK" && PYTHONPATH=$TREE exec valgrind --tool=callgrind --callgrind-out-file="$WORK/cg" \
  "$PYTHON" -m pylon serve --listen "127.0.0.1:$PY_PORT" --upstream "http://127.0.0.1:$UP_PORT" \
  --backend dynamo --log-level "${LOG_LEVEL:-warning}" $EXTRA >"$WORK/log" 2>&1) &
PY=$!
trap 'kill $PY $UP 2>/dev/null; wait 2>/dev/null; [ -n "${KEEP:-}" ] && cp "$WORK"/cg.* "$KEEP"/ 2>/dev/null; rm -rf "$WORK"' EXIT
for _ in $(seq 240); do curl -s -o /dev/null "http://127.0.0.1:$PY_PORT/" && break; sleep 0.5; done

STREAMED=false
[ "$STREAM" = 1 ] && STREAMED=true
printf '{"model":"mock-model","messages":[{"role":"user","content":"hi"}],"stream":%s,"max_tokens":20}' \
  "$STREAMED" >"$WORK/body"
H1=--h1
[ "${PROTOCOL:-http1}" = h2c ] && H1=""
drive() {
  # shellcheck disable=SC2086  # H1 is one flag or none
  h2load $H1 -n "$1" -c 8 -d "$WORK/body" -H 'content-type: application/json' \
    -H 'x-model: mock-model' -H 'x-request-id: bench-1' \
    "http://127.0.0.1:$PY_PORT/v1/chat/completions" | grep '^requests:'
}
drive 300 >/dev/null
callgrind_control -z "$PY" >/dev/null 2>&1
RESULT=$(drive "$REQUESTS")
callgrind_control -d "$PY" >/dev/null 2>&1
grep -q " $REQUESTS succeeded" <<<"$RESULT" || { echo "not every request succeeded: $RESULT" >&2; exit 1; }
for _ in $(seq 20); do
  DUMP=$(find "$WORK" -name 'cg.*' | head -1)
  [ -n "$DUMP" ] && grep -q '^totals:\|^summary:' "$DUMP" && break
  sleep 0.5
done
IR=$(grep -m1 '^totals:\|^summary:' "$DUMP" | awk '{print $2}')
echo "Ir/req $((IR / REQUESTS))"

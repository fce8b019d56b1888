-- wrk script: POST a chat-completions body with pylon tunnel headers.
-- env BENCH_STREAM=1 -> "stream": true.  done() prints one JSON line
-- prefixed with "BENCH_JSON " (latencies in microseconds).
local stream = os.getenv("BENCH_STREAM") == "1"
local body = '{"model":"mock-model","messages":[{"role":"user","content":"hi"}],'
  .. '"stream":' .. (stream and "true" or "false") .. ',"max_tokens":20}'
local n = 0

wrk.method = "POST"
wrk.body = body
wrk.headers["content-type"] = "application/json"
wrk.headers["x-model"] = "mock-model"

request = function()
  n = n + 1
  wrk.headers["x-request-id"] = "bench-" .. n
  return wrk.format(nil, nil, nil, body)
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
end

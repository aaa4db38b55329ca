-- bench/wrk/chat.lua with a session header: 64 sessions in turn (bench/cluster-latency.sh),
-- so a replica with `cluster:` reads each request's binding from Redis before picking.
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Say hello in one short sentence, please."}]}'
local n = 0
request = function()
  n = n + 1
  wrk.headers["x-session-id"] = "s" .. (n % 64)
  return wrk.format()
end

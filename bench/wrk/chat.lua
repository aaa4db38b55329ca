-- A small non-streaming chat request (bench/mirroring.sh).
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Say hello in one short sentence, please."}]}'

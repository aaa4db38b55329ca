//! The Lua scripts of the shared state: each one runs atomically on Redis, on Redis's clock.

/// Takes a slot: drops the expired leases, then adds this one if fewer than the limit
/// remain. KEYS[1] the lease set; ARGV limit, member, lease ms. Redis's own clock.
pub(super) const ACQUIRE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
  return 1
end
return 0
";

/// The heartbeat: the replica's score in the replica set, the departed dropped, and the
/// renewal of its live leases (KEYS[3..] their sets, ARGV[5..] their members).
/// KEYS[1] the replica set; ARGV replica id, lease ms, forget-after ms. A lease is renewed
/// only while it is there (a lease released meanwhile is not brought back), except when the
/// replica itself was not registered: Redis lost its data (restarted empty) or forgot the
/// replica, and its live leases are added again, so the fleet counts the requests that still
/// hold them (one released while the heartbeat was under way is removed again after it).
/// KEYS[2] is the store's epoch: a random value the first replica to find it absent sets
/// (ARGV[4] its proposal); a replica that sees it change knows Redis lost its data.
/// Returns {1 when it re-registered else 0, the epoch}.
pub(super) const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fresh = redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  epoch = ARGV[4]
  redis.call('SET', KEYS[2], epoch)
end
local ttl = tonumber(ARGV[2])
for i = 3, #KEYS do
  if fresh == 1 then
    redis.call('ZADD', KEYS[i], now + ttl, ARGV[i + 2])
  else
    redis.call('ZADD', KEYS[i], 'XX', now + ttl, ARGV[i + 2])
  end
  redis.call('PEXPIRE', KEYS[i], ttl * 2)
end
return {fresh, epoch}
";

/// The replica set with Redis's time: `{now, id, score, id, score, ...}`.
pub(super) const MEMBERS: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
table.insert(r, 1, tostring(now))
return r
";

/// Publishes this replica's figures (ARGV[4..]: field, value) in its hash `ARGV[1] ..
/// replica id` and returns every other registered replica's, flat. KEYS[1] the replica set;
/// ARGV the hashes' prefix (`<prefix>:load:` for the in-flight figures per instance,
/// `<prefix>:fair:` for the throttling queues' figures per flow), replica id, ms to keep them.
pub(super) const SYNC: &str = r"
local own = ARGV[1] .. ARGV[2]
redis.call('DEL', own)
if #ARGV > 3 then
  local args = {}
  for i = 4, #ARGV do args[#args + 1] = ARGV[i] end
  redis.call('HSET', own, unpack(args))
  redis.call('PEXPIRE', own, tonumber(ARGV[3]))
end
local out = {}
for _, r in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if r ~= ARGV[2] then
    local h = redis.call('HGETALL', ARGV[1] .. r)
    for i = 1, #h do out[#out + 1] = h[i] end
  end
end
return out
";

/// A tenant's fleet-wide limits: its per-minute buckets in one hash (`tenant:<name>`:
/// fields `r`, `i`, `o` the levels of requests, input and output tokens, `at` when they were
/// last refilled, by Redis's clock) refilled and taken like the local ones
/// ([`crate::tenants`]), and its requests in flight as leases (`tenant:<name>:inflight`)
/// like the throttling slots. KEYS[1] the hash, KEYS[2] the lease set, KEYS[3] (optional) a
/// session binding read in the same round trip; ARGV the three per-minute limits (0: none),
/// the concurrency limit (0: none), the input and output tokens to reserve, the lease
/// member and the lease ms. Returns {admitted 1/0, the limit refusing (1 requests, 2 input,
/// 3 output, 4 concurrency), ms until it would admit, the session's binding or nil, and
/// for each per-minute limit what remains after this request (-1: no such limit, or
/// refused)}.
pub(super) const TENANT_ADMIT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local session = false
if #KEYS >= 3 then session = redis.call('GET', KEYS[3]) end
local conc = tonumber(ARGV[4])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= conc then return {0, 4, 1000, session, -1, -1, -1} end
end
local h = redis.call('HMGET', KEYS[1], 'r', 'i', 'o', 'at')
local dt = math.max(now - (tonumber(h[4]) or now), 0)
local needs = {1, tonumber(ARGV[5]), tonumber(ARGV[6])}
local levels = {}
local any = false
for k = 1, 3 do
  local limit = tonumber(ARGV[k])
  if limit > 0 then
    any = true
    local l = math.min((tonumber(h[k]) or limit) + dt * limit / 60000, limit)
    local need = math.min(needs[k], limit)
    if l < need then
      return {0, k, math.ceil((need - l) * 60000 / limit), session, -1, -1, -1}
    end
    levels[k] = l - needs[k]
  end
end
if any then
  local f = {'r', 'i', 'o'}
  for k = 1, 3 do
    if levels[k] then redis.call('HSET', KEYS[1], f[k], tostring(levels[k])) end
  end
  redis.call('HSET', KEYS[1], 'at', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
if conc > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[8]), ARGV[7])
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[8]) * 2)
end
local left = {-1, -1, -1}
for k = 1, 3 do
  if levels[k] then left[k] = math.max(0, math.floor(levels[k])) end
end
return {1, 0, 0, session, left[1], left[2], left[3]}
";

/// Settles a tenant's request in its fleet-wide buckets: gives back what was reserved and
/// not used (`ARGV[4..6]` per bucket, negative: used more than reserved), after refilling
/// all three to now. KEYS[1] the hash; ARGV[1..3] the per-minute limits (0: none).
pub(super) const TENANT_SETTLE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h = redis.call('HMGET', KEYS[1], 'r', 'i', 'o', 'at')
local dt = math.max(now - (tonumber(h[4]) or now), 0)
local f = {'r', 'i', 'o'}
for k = 1, 3 do
  local limit = tonumber(ARGV[k])
  if limit > 0 then
    local l = math.min((tonumber(h[k]) or limit) + dt * limit / 60000, limit)
    l = math.min(l + tonumber(ARGV[k + 3]), limit)
    redis.call('HSET', KEYS[1], f[k], tostring(l))
  end
end
redis.call('HSET', KEYS[1], 'at', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return 1
";

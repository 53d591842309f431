-- token_bucket.lua: the classic per-request token bucket, one Redis round trip per request (as in
-- the well-known Express + ioredis rate-limiter examples). sluice does not use it to decide: it is
-- the baseline its batched sync is benchmarked against (redis-benchmark, bench/).
--
-- KEYS: the bucket key.
-- ARGV: capacity (tokens), refill_per_second, cost (default 1), now_override_us (0 or absent = TIME).
-- Returns: {allowed (0/1), whole tokens left}.

local capacity = tonumber(ARGV[1])
local refill_per_second = tonumber(ARGV[2])
local cost = tonumber(ARGV[3]) or 1
local now = tonumber(ARGV[4]) or 0
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
elseif now > ts then
  tokens = math.min(capacity, tokens + (now - ts) * refill_per_second / 1000000)
end

local allowed = 0
if tokens >= cost then
  tokens = tokens - cost
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
-- (capped: a larger number would reach Redis in exponent notation)
redis.call('PEXPIRE', KEYS[1], math.min(math.ceil((capacity - tokens) / refill_per_second * 1000) + 1000, 1099511627776))
return {allowed, math.floor(tokens)}

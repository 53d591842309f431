-- sliding_log.lua: one strict decision for one entry whose limits are sliding logs: admits
-- `cost` if every log has room for it, recording it in each; otherwise records nothing. The
-- arithmetic is core/src/log.rs's (a request counts while now < its arrival + period), written
-- in the same order so both decide alike (see counter-service/tests/vectors.rs).
--
-- KEYS: the entry's limit keys, in limit order:
--       sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<requests>/sliding_log
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), cost, n_limits,
--       then n_limits x (requests, period_ms), then penalty_ms (0 or absent: none), its key
--       after the limit keys in KEYS (as check.lua).
-- Each key is a sorted set: one member per admitted request (`<arrival us>:<n>`, n telling apart
--   requests of the same microsecond), scored by its arrival in us. Members that no longer count
--   are removed when the key is next decided; the key expires a second after its newest
--   request stops counting. A log is never leased (cached rules refuse it), so nothing else
--   writes these keys.
-- Returns: {allowed (0/1), remaining, retry_after_ms, reset_ms}, integers, from the limit that
--   speaks as in core's limiter: when admitted, the one with the fewest requests left; when
--   denied, the denying one that makes the client wait longest.
--   remaining: requests left in the log after the decision;
--   retry_after_ms: when denied, until enough of its oldest requests stop counting, else 0;
--   reset_ms: until its newest request stops counting, 0 if none counts.
--   Times are core's microseconds rounded up to milliseconds.
--
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock,
-- penalty_before and penalty_after.

local now = clock(ARGV[1])
local cost = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local penalized, penalty_us, penalty_key = penalty_before(KEYS[n + 1], ARGV[4 + 2 * n], now)
if penalized ~= nil then
  return penalized
end

-- Scores and members are written with every digit: Lua's own tostring keeps only 14.
local function us(value)
  return string.format('%.0f', value)
end

local logs = {}
local allowed = true
for i = 1, n do
  local l = {
    key = KEYS[i],
    requests = tonumber(ARGV[2 + 2 * i]),
    length = tonumber(ARGV[3 + 2 * i]) * 1000,
  }
  -- What no longer counts: arrived at or before now - length.
  redis.call('ZREMRANGEBYSCORE', l.key, '-inf', us(now - l.length))
  l.held = redis.call('ZCARD', l.key)
  l.ok = cost <= l.requests and l.held + cost <= l.requests
  if not l.ok then
    allowed = false
  end
  logs[i] = l
end

-- The arrival of the `rank`-th oldest request that counts (1-based).
local function arrival(key, rank)
  local found = redis.call('ZRANGE', key, rank - 1, rank - 1, 'WITHSCORES')
  return tonumber(found[2])
end

local written = {}
for i = 1, n do
  local l = logs[i]
  l.retry = 0
  if not l.ok then
    if cost > l.requests then
      l.retry = l.length
    else
      -- The place the request needs frees when the (held + cost - requests)-th oldest goes.
      l.retry = math.max(arrival(l.key, l.held + cost - l.requests) + l.length - now, 1)
    end
  end
  local counted = l.held
  if l.ok then
    counted = counted + cost
  end
  l.remaining = l.requests - counted
  l.reset = 0
  if l.ok then
    l.reset = l.length
  elseif l.held > 0 then
    l.reset = arrival(l.key, l.held) + l.length - now
  end
  -- Two equal limits share a key: it records the request once.
  if allowed and not written[l.key] then
    written[l.key] = true
    local taken = redis.call('ZCOUNT', l.key, us(now), us(now))
    for j = 1, cost do
      redis.call('ZADD', l.key, us(now), us(now) .. ':' .. (taken + j))
    end
    redis.call('PEXPIRE', l.key, math.ceil(l.length / 1000) + 1000)
  end
end

-- The limit that speaks, as core's limiter chooses it.
local chosen = nil
for i = 1, n do
  local l = logs[i]
  local tighter
  if chosen == nil then
    tighter = true
  elseif allowed then
    tighter = l.remaining < chosen.remaining
  else
    tighter = (not l.ok) and l.retry > chosen.retry
  end
  if tighter and (allowed or not l.ok) then
    chosen = l
  end
end

return penalty_after({
  allowed and 1 or 0,
  chosen.remaining,
  math.ceil(chosen.retry / 1000),
  math.ceil(chosen.reset / 1000),
}, true, penalty_us, penalty_key, now)

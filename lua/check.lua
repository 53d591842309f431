-- check.lua: one strict decision for one entry: spends `cost` tokens from every limit if every
-- limit has them, after setting aside the unexpired grants (leases) of the proxies.
--
-- KEYS: the entry's limit keys, in limit order:
--       sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), cost, n_limits,
--       then n_limits x (requests, period_ms, burst).
-- Returns: {allowed (0/1), remaining, retry_after_ms, reset_ms}, integers:
--   remaining: whole tokens left after the decision (the most restrictive limit, never below 0);
--   retry_after_ms: when denied, until `cost` tokens are there on every limit, else 0;
--   reset_ms: until every bucket is full again.
--
-- The bucket arithmetic is written in the order of core/src/bucket.rs (Bucket::take) so both agree
-- bit for bit (see counter-service/tests/vectors.rs).

-- A key lives until its bucket is full again and every lease expired, plus a second, and never
-- more than two of the longest periods (2 x 366 days; lua/sync.lua bounds the debt).
local MAX_TTL_MS = 2 * 366 * 86400000

local function clock(override)
  local value = tonumber(override)
  if value ~= nil and value ~= 0 then
    return value
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local now = clock(ARGV[1])
local cost = tonumber(ARGV[2])
local n = tonumber(ARGV[3])

local limits = {}
local allowed = true
for i = 1, n do
  local key = KEYS[i]
  local requests = tonumber(ARGV[1 + 3 * i])
  local period_ms = tonumber(ARGV[2 + 3 * i])
  local burst = tonumber(ARGV[3 + 3 * i])
  local flat = redis.call('HGETALL', key)
  local fields = {}
  for j = 1, #flat, 2 do
    fields[flat[j]] = flat[j + 1]
  end
  -- leases of the proxies that are still running
  local reserved = 0
  local unreported = 0
  local lease_end = now
  for j = 1, #flat, 2 do
    local field = flat[j]
    if string.sub(field, 1, 2) == 'x:' then
      local expiry = tonumber(flat[j + 1]) or 0
      if expiry > now then
        local q = string.sub(field, 3)
        local g = tonumber(fields['g:' .. q]) or 0
        reserved = reserved + g
        -- what the proxy likely spent and has not reported yet (as in sync.lua)
        local d = tonumber(fields['d:' .. q]) or 0
        local s = tonumber(fields['s:' .. q]) or now
        unreported = unreported + math.min(g, d * (now - s) / 1000000)
        if expiry > lease_end then
          lease_end = expiry
        end
      end
    end
  end
  -- refill; a new key starts full
  local tokens = tonumber(fields['tokens'])
  local ts = tonumber(fields['ts'])
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now
  elseif now > ts then
    -- the burst caps the tokens without the proxies' unreported spend, as in sync.lua
    tokens = math.min(burst + unreported, tokens + (now - ts) * requests / (period_ms * 1000))
    ts = now
  end
  local available = tokens - reserved
  if not (available >= cost) then
    allowed = false
  end
  limits[i] = {
    key = key, requests = requests, period_ms = period_ms, burst = burst,
    tokens = tokens, ts = ts, available = available, lease_ms = math.ceil((lease_end - now) / 1000),
  }
end

local remaining = nil
local retry_after_ms = 0
local reset_ms = 0
for i = 1, n do
  local l = limits[i]
  if allowed then
    l.tokens = l.tokens - cost
    l.available = l.available - cost
  else
    local wait = math.ceil((cost - l.available) * l.period_ms / l.requests)
    if wait > retry_after_ms then
      retry_after_ms = wait
    end
  end
  redis.call('HSET', l.key, 'tokens', l.tokens, 'ts', l.ts)
  local refill_ms = math.max(0, math.ceil((l.burst - l.tokens) * l.period_ms / l.requests))
  redis.call('PEXPIRE', l.key, math.min(refill_ms + l.lease_ms + 1000, MAX_TTL_MS))
  if remaining == nil or l.available < remaining then
    remaining = l.available
  end
  if refill_ms > reset_ms then
    reset_ms = refill_ms
  end
end

remaining = math.floor(remaining or 0)
if remaining < 0 then
  remaining = 0
end
return {allowed and 1 or 0, remaining, retry_after_ms, reset_ms}

-- check.lua: one strict decision for one entry: spends `cost` tokens from every limit if every
-- limit has them, after setting aside the unexpired grants (the cached proxies' quota) of the proxies.
--
-- KEYS: the entry's limit keys, in limit order:
--       sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>
--       then, if the entry has a penalty, its penalty key (prelude's penalty_before).
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), cost, n_limits,
--       then n_limits x (requests, period_ms, burst), then penalty_ms (0 or absent: none).
--       A key in its penalty is denied before anything is read or spent; a denial starts one
--       if the check would be denied without the largest debtor's unleased debt too (prelude's
--       settle_debts): one proxy credential's reports of spend it was never leased deny the key
--       while they weigh, but start no penalty alone.
--       Then the asking proxy's id (empty or absent: none), as sync.lua names its l:q fields:
--       a check denied only because of the lease that proxy holds on the key (every limit would
--       have the cost with that lease's grant) starts no penalty, and answers the lease.
-- Returns: {allowed (0/1), remaining, retry_after_ms, reset_ms}, integers, then, when the
-- asking proxy's own unexpired lease was set aside by a denial that it covers, lease_tokens and
-- lease_ttl_ms: the grant the proxy may spend (its sync's answer may not have reached it yet).
--   remaining: whole tokens left after the decision (the most restrictive limit, never below 0);
--   retry_after_ms: when denied, until `cost` tokens are there on every limit, else 0;
--   reset_ms: until every bucket is full again.
--
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its math_max,
-- math_floor, math_ceil, clock, load_leases, lease_unpack, stored_bucket, refill_bucket, settle_debts, ms_to_full, expire_key,
-- whole_remaining, penalty_before and penalty_after.
-- The bucket arithmetic is written in the order of core/src/bucket.rs (Bucket::take) so both agree
-- bit for bit (see counter-service/tests/vectors.rs).

local now = clock(ARGV[1])
local cost = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local penalized, penalty_us, penalty_key = penalty_before(KEYS[n + 1], ARGV[4 + 3 * n], now)
if penalized ~= nil then
  return penalized
end
local asker = ARGV[5 + 3 * n]
local asker_field = nil
if asker ~= nil and asker ~= '' then
  asker_field = 'l:' .. asker
end

local limits = {}
local allowed = true
-- whether a limit would deny the check without its largest debtor's unleased debt too, or
-- without the asking proxy's own lease
local over = false
-- the asking proxy's own unexpired grant on every limit (the least of them) and its time left
local own, own_ttl_us = nil, nil
for i = 1, n do
  local key = KEYS[i]
  local requests = tonumber(ARGV[1 + 3 * i])
  local period_ms = tonumber(ARGV[2 + 3 * i])
  local burst = tonumber(ARGV[3 + 3 * i])
  -- leases of the proxies that are still running, and what they likely spent and have not
  -- reported yet (as in sync.lua)
  local _, stored_tokens, stored_ts, _, _, _, reserved, unreported, _, lease_end, _, debts =
    load_leases(key, now, nil, nil)
  -- refill; a new key starts full. The burst caps the tokens without the proxies' unreported
  -- spend, as in sync.lua.
  local tokens, ts = stored_bucket(stored_tokens, stored_ts, burst, now)
  local written = ts
  tokens, ts = refill_bucket(tokens, ts, now, requests, period_ms, burst + unreported)
  local available = tokens - reserved
  local owed = 0
  if debts ~= nil then
    -- less what the refill repaid since the key was last written
    local paid = math_max(now - written, 0) * requests / (period_ms * 1000)
    owed = settle_debts(key, debts, paid, tokens, tokens, burst)
  end
  if not (available >= cost) then
    allowed = false
    local mine = 0
    if asker_field ~= nil then
      local g, expiry = nil, nil
      local field = redis.call('HGET', key, asker_field)
      if field then
        g, expiry = lease_unpack(field)
      end
      if g ~= nil and expiry > now then
        mine = g
        if own == nil or g < own then
          own = g
        end
        if own_ttl_us == nil or expiry - now < own_ttl_us then
          own_ttl_us = expiry - now
        end
      else
        own = 0
      end
    end
    if not (available + owed + mine >= cost) then
      over = true
    end
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
  local full_ms = ms_to_full(l.tokens, l.requests, l.period_ms, l.burst)
  expire_key(l.key, full_ms, l.lease_ms)
  if remaining == nil or l.available < remaining then
    remaining = l.available
  end
  if full_ms > reset_ms then
    reset_ms = full_ms
  end
end

local answer = penalty_after(
  {allowed and 1 or 0, whole_remaining(remaining), retry_after_ms, reset_ms},
  over, penalty_us, penalty_key, now)
if not allowed and not over and own ~= nil and own >= cost then
  answer[5] = math_floor(own)
  answer[6] = math_ceil(own_ttl_us / 1000)
end
return answer

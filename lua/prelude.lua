-- prelude.lua: the pieces check.lua and sync.lua share, written once so they cannot drift apart.
-- It is not a script of its own: the service puts it in front of each script's text and loads
-- the combined text (its SHA is the SHA of the combined text; see counter-service/src/scripts.rs).
-- It defines only locals, reads neither KEYS nor ARGV and calls Redis only when its functions do.
--
-- The bucket arithmetic is written in the order of core/src/bucket.rs so both agree bit for bit
-- (see counter-service/tests/vectors.rs).

-- A key lives until its bucket is full again and every lease expired, plus a second, and never
-- more than two of the longest periods (2 x 366 days; sync.lua bounds the debt).
local MAX_TTL_MS = 2 * 366 * 86400000

-- The time in us: Redis TIME, the one clock, unless `override` (an ARGV string) is non-zero,
-- which only tests send.
local function clock(override)
  local value = tonumber(override)
  if value ~= nil and value ~= 0 then
    return value
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The hash of one key: the flat HGETALL reply (its fields in the order Redis gave them) and the
-- same as a table of field -> value.
local function load_hash(key)
  local flat = redis.call('HGETALL', key)
  local fields = {}
  for i = 1, #flat, 2 do
    fields[flat[i]] = flat[i + 1]
  end
  return flat, fields
end

-- The unexpired leases on one key (a loaded hash) of every proxy but `except` (nil: of every
-- proxy), at `now` (us). Returns:
--   reserved: the sum of their grants (g:q);
--   unreported: an estimate of what they spent from them since their last sync (s:q) and have
--     not reported yet: their demand (d:q, tokens/s) over that time, at most the grant;
--   demand: the sum of their demands;
--   lease_end: when the last of them expires (us), `now` if none.
-- If `stale_before` is given, the fields of the other proxies whose lease expired at or before it
-- are deleted (HDEL), so a hash stays bounded by the proxies active on the key.
local function leases(key, flat, fields, now, except, stale_before)
  local reserved = 0
  local unreported = 0
  local demand = 0
  local lease_end = now
  for i = 1, #flat, 2 do
    local field = flat[i]
    if string.sub(field, 1, 2) == 'x:' then
      local q = string.sub(field, 3)
      local expiry = tonumber(flat[i + 1]) or 0
      if q ~= except then
        if expiry > now then
          local g = tonumber(fields['g:' .. q]) or 0
          reserved = reserved + g
          local d = tonumber(fields['d:' .. q]) or 0
          local s = tonumber(fields['s:' .. q]) or now
          unreported = unreported + math.min(g, d * (now - s) / 1000000)
          demand = demand + d
          if expiry > lease_end then
            lease_end = expiry
          end
        elseif stale_before ~= nil and expiry <= stale_before then
          redis.call('HDEL', key, 'g:' .. q, 'x:' .. q, 'w:' .. q, 'd:' .. q, 's:' .. q)
        end
      end
    end
  end
  return reserved, unreported, demand, lease_end
end

-- The stored bucket of a loaded hash (tokens, ts), or, for a new key, a full one (`burst`)
-- stamped `born` (us).
local function stored_bucket(fields, burst, born)
  local tokens = tonumber(fields['tokens'])
  local ts = tonumber(fields['ts'])
  if tokens == nil or ts == nil then
    return burst, born
  end
  return tokens, ts
end

-- The refill of core/src/bucket.rs: if `now` is after `ts`, the tokens grow at requests per
-- period up to `cap` and ts moves to `now`; otherwise (also a clock that went back) nothing
-- changes. Returns tokens, ts.
local function refill_bucket(tokens, ts, now, requests, period_ms, cap)
  if now > ts then
    return math.min(cap, tokens + (now - ts) * requests / (period_ms * 1000)), now
  end
  return tokens, ts
end

-- How long (ms, whole, at least 0) the refill takes to bring `tokens` up to `burst`.
local function ms_to_full(tokens, requests, period_ms, burst)
  return math.max(0, math.ceil((burst - tokens) * period_ms / requests))
end

-- Lets a key expire once its bucket would be full again (`full_ms`) and its leases expired
-- (`lease_ms`), plus a second, and never later than MAX_TTL_MS.
local function expire_key(key, full_ms, lease_ms)
  redis.call('PEXPIRE', key, math.min(full_ms + lease_ms + 1000, MAX_TTL_MS))
end

-- The `remaining` of a reply: whole tokens, never below 0 (0 if there is no limit; Redis would
-- truncate a fraction anyway).
local function whole_remaining(remaining)
  remaining = math.floor(remaining or 0)
  if remaining < 0 then
    remaining = 0
  end
  return remaining
end

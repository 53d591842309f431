-- keys.lua: one key's state as the service keeps it, for the admin API (`GET
-- /admin/v1/keys/{rule}?key=…`), or that state and then the key reset (`DELETE`): every limit
-- key of the entry deleted in this one call, so its counts, debts and leases go together and the
-- next sync or strict check of any proxy finds a new key.
--
-- KEYS: the limit keys of one entry (one rule's key), in limit order, as sync.lua, check.lua,
--       sync_window.lua, window.lua and sliding_log.lua name them (counter-service/src/keys.rs):
--       every one under the entry's hash tag, so in one Redis Cluster slot. The script reads
--       and deletes these keys and no other. Then the entry's penalty key (its first limit's
--       key and `:penalty`, as lua/prelude.lua describes it), when there is a limit.
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), op ("show" or
--       "reset"), max_leases (most leases answered per limit), then per key: kind (bucket,
--       fixed, week, month, sliding or log), requests, period_ms, burst.
-- Returns: a JSON text: {"now_ms": …, "deleted": keys deleted (0 for show), "limits": [one
--   object per key, in order], "penalty": the key's penalty if one runs ({from_ms, until_ms,
--   ttl_ms}: when it started and ends, as the proxy that started it set it), else absent},
--   each limit:
--   exists: whether Redis holds the key (a key of another type counts as absent; type names it);
--   bucket: tokens (refilled to now, at most burst; below 0: a debt), debt (0 or more),
--     reset_ms (until the bucket is full again; 0 if it is);
--   fixed, week, month: count (in the window of now), window_start_ms, reset_ms (until the
--     window ends, 0 if it counts nothing);
--   sliding: count (weighted), previous, current, window_start_ms, reset_ms (until it counts
--     nothing);
--   log: count (requests that count now), reset_ms (until the newest stops counting);
--   buckets and windows: leases, the unexpired leases of the proxies, by proxy id, at most
--     max_leases ({proxy, tokens, expires_in_ms}), leases_total (all of them; more than
--     answered: the answer was cut).
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its math_floor,
-- math_ceil, math_max, clock, load_hash, lease_unpack, lease_numbers, stored_bucket,
-- refill_bucket, ms_to_full and window_state.

local now = clock(ARGV[1])
local op = ARGV[2]
local max_leases = tonumber(ARGV[3])

-- The unexpired leases of a loaded hash (its flat HGETALL reply and its fields), one per proxy:
-- the l:q fields of token buckets, the p:q text of earlier versions, and the four fields (g:q,
-- x:q...) of windows and earliest versions. Sorted by proxy id, cut at max_leases; and how many.
local function held(flat, fields)
  local by_proxy = {}
  local found = {}
  for i = 1, #flat, 2 do
    local field = flat[i]
    local tag = string.sub(field, 1, 2)
    local q = string.sub(field, 3)
    local grant, expiry = nil, nil
    if tag == 'l:' then
      grant, expiry = lease_unpack(flat[i + 1])
    elseif tag == 'p:' then
      grant, expiry = lease_numbers(flat[i + 1])
    elseif tag == 'x:' then
      grant, expiry = tonumber(fields['g:' .. q]), tonumber(flat[i + 1])
    end
    if expiry ~= nil and expiry > now then
      local lease = by_proxy[q]
      if lease == nil then
        lease = {proxy = q, tokens = 0, expiry = expiry}
        by_proxy[q] = lease
        found[#found + 1] = lease
      end
      if expiry >= lease.expiry then
        lease.tokens, lease.expiry = math_floor(grant or 0), expiry
      end
    end
  end
  table.sort(found, function(a, b) return a.proxy < b.proxy end)
  local answered = {}
  for i = 1, math.min(#found, max_leases) do
    local lease = found[i]
    answered[i] = {proxy = lease.proxy, tokens = lease.tokens,
      expires_in_ms = math_ceil((lease.expiry - now) / 1000)}
  end
  return answered, #found
end

local function ms(us)
  return math_ceil(us / 1000)
end

local limits = {}
local arg = 4
local n = (#ARGV - 3) / 4
for i = 1, n do
  local key = KEYS[i]
  local kind = ARGV[arg]
  local requests = tonumber(ARGV[arg + 1])
  local period_ms = tonumber(ARGV[arg + 2])
  local burst = tonumber(ARGV[arg + 3])
  arg = arg + 4
  local wanted = 'hash'
  if kind == 'log' then
    wanted = 'zset'
  end
  local found = redis.call('TYPE', key).ok
  local l = {exists = found == wanted}
  if found ~= 'none' and found ~= wanted then
    l.type = found
  end
  local flat, fields = {}, {}
  if l.exists and wanted == 'hash' then
    flat, fields = load_hash(key)
  end
  if kind == 'bucket' then
    local tokens, ts = stored_bucket(fields['tokens'], fields['ts'], burst, now)
    tokens = refill_bucket(tokens, ts, now, requests, period_ms, burst)
    l.tokens = tokens
    l.debt = math_max(0, -tokens)
    l.reset_ms = ms_to_full(tokens, requests, period_ms, burst)
  elseif kind == 'log' then
    local length = period_ms * 1000
    l.count, l.reset_ms = 0, 0
    if l.exists then
      l.count = redis.call('ZCOUNT', key, '(' .. string.format('%.0f', now - length), '+inf')
      local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if l.count > 0 and newest[2] ~= nil then
        l.reset_ms = math_max(0, ms(tonumber(newest[2]) + length - now))
      end
    end
  else
    local w = {window = kind, length = period_ms * 1000}
    window_state(w, fields, now)
    l.count = w.weighted
    l.window_start_ms = math_floor(w.start / 1000)
    l.reset_ms = 0
    if kind == 'sliding' then
      l.previous, l.current = w.previous, w.current
      if w.current > 0 then
        l.reset_ms = ms(w.finish + w.length - now)
      elseif w.previous > 0 then
        l.reset_ms = ms(w.finish - now)
      end
    elseif w.count > 0 then
      l.reset_ms = ms(w.finish - now)
    end
  end
  if kind ~= 'log' then
    l.leases, l.leases_total = held(flat, fields)
  end
  limits[i] = l
end

local penalty = nil
local penalty_key = KEYS[n + 1]
if penalty_key ~= nil and redis.call('TYPE', penalty_key).ok == 'hash' then
  local stored = redis.call('HMGET', penalty_key, 'from', 'until')
  local from, till = tonumber(stored[1]), tonumber(stored[2])
  if from ~= nil and till ~= nil and till > now then
    penalty = {from_ms = math_floor(from / 1000), until_ms = math_ceil(till / 1000),
      ttl_ms = ms(till - now)}
  end
end

local deleted = 0
if op == 'reset' and #KEYS > 0 then
  deleted = redis.call('DEL', unpack(KEYS))
end

return cjson.encode({now_ms = math_floor(now / 1000), deleted = deleted, limits = limits,
  penalty = penalty})

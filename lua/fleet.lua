-- fleet.lua: records one proxy's load report and answers the fleet's load level: the mean, over
-- the credentials with a fresh report, of each credential's mean utilization over its proxies
-- whose report is fresh. Every credential weighs 1 however many proxy ids it reports under.
-- Two keys in one Redis Cluster hash slot (the {fleet} tag), so one call on one node.
--
-- KEYS: [1] the credentials hash, sluice:fleet:{fleet}:credentials: one field per credential
--       (its aggregate, below) and the field "=" (the fleet's totals, below);
--       [2] this credential's proxies hash, sluice:fleet:{fleet}:proxies:<credential>: one field
--       per proxy id (as the service keeps it), its last report.
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), credential,
--       proxy id, utilization, shed_rate, latency_ms, window_ms, max_proxies, refresh_ms.
--       The service has validated the report and clamped utilization and shed_rate to [0, 1]
--       (clamped here again). window_ms is how long the report stays fresh: the service decides
--       it (max(1 s, 3 x the interval it answered), at most its --fleet-report-max-age-ms), never
--       the proxy. max_proxies is how many proxy ids one credential may have reports under;
--       refresh_ms how often an aggregate is rebuilt from what it sums (100 ms).
-- Returns: {level, proxies, recorded, credentials}:
--   level: the mean over the fresh credentials of their mean utilization, in [0, 1], as a string
--     (Redis would truncate a Lua number to an integer); "0" if no report is fresh;
--   proxies: how many proxies' reports are counted, this one's included when recorded;
--   recorded: 1 if this report was recorded, 0 if its credential already had max_proxies fresh
--     reports under other ids;
--   credentials: how many credentials the level is the mean of.
--
-- A report's value is "utilization,shed_rate,latency_ms,window_ms,time_ms", time_ms being when it
-- was recorded (Redis TIME, in ms); it is fresh while younger than its window_ms (a time ahead of
-- the clock, after a failover to a node whose clock is behind, counts unless a whole window
-- ahead).
--
-- The cost of a call does not grow with what one credential writes. A credential's aggregate,
-- "sum,count,freshest_ms,scanned_ms" (the sum and count of its fresh reports' utilizations, when
-- the freshest of them goes stale, when they were last read), is kept up to date at each report
-- (the report's old value out, its new one in) and rebuilt from the proxies hash (at most
-- max_proxies fields, the stale ones deleted) when it is refresh_ms old, at the credential's own
-- report. The totals, "total,credentials,proxies,computed_ms" (the sum of the credentials' means,
-- how many, the sum of their counts), are kept up to date the same way and rebuilt from the
-- credentials hash (one field per credential: the operator's tokens file, not the callers, sets
-- how many) when refresh_ms old, dropping the credentials whose freshest report went stale. So a
-- report that goes stale stops counting at most refresh_ms after its credential's next report, and
-- a credential that stops reporting at most refresh_ms after its freshest report's window.
--
-- A credential holds at most max_proxies reports. When it has that many fresh ones, its report
-- under a proxy id not yet recorded is refused (the call still answers the level) rather than
-- its oldest evicted: whoever sends reports under many ids fills its own credential only, and the
-- proxies under another credential are always recorded. A proxy already recorded always
-- replaces its own report. Each key expires when its freshest report would be stale, so a fleet
-- that stops reporting leaves nothing behind.
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock,
-- math_min, math_max and math_floor.

local credentials_key = KEYS[1]
local proxies_key = KEYS[2]
local now_ms = math_floor(clock(ARGV[1]) / 1000)
local credential = ARGV[2]
local proxy = ARGV[3]
local TOTALS = '='

local function unit(x)
  if x == nil or x ~= x then
    return 0
  end
  return math_min(1, math_max(0, x))
end

-- (through its text, so what is added now is exactly what is taken out when it is replaced)
local utilization_text = tostring(unit(tonumber(ARGV[4])))
local utilization = tonumber(utilization_text)
local shed_rate = unit(tonumber(ARGV[5]))
local latency_ms = math_max(0, tonumber(ARGV[6]) or 0)
local window_ms = math_max(1, math_floor(tonumber(ARGV[7]) or 1))
local max_proxies = tonumber(ARGV[8]) or 0
local refresh_ms = tonumber(ARGV[9]) or 0

-- The n numbers of a comma-separated value (a report, an aggregate, the totals), or nil if it is
-- missing (HMGET answers false) or does not parse.
local function numbers(value, n)
  if type(value) ~= 'string' then
    return nil
  end
  local out = {}
  for part in string.gmatch(value, '[^,]+') do
    local x = tonumber(part)
    if x == nil or x ~= x then
      return nil
    end
    out[#out + 1] = x
  end
  if #out ~= n then
    return nil
  end
  return out
end

local function fresh(report)
  local age = now_ms - report[5]
  return age < report[4] and age > -report[4]
end

local function mean(sum, count)
  if count > 0 then
    return unit(sum / count)
  end
  return nil
end

local function delete(key, fields)
  -- (in slices: unpack of a long list could overflow Lua's stack)
  for first = 1, #fields, 1000 do
    redis.call('HDEL', key, unpack(fields, first, math_min(first + 999, #fields)))
  end
end

local function fmt(x)
  return string.format('%.17g', x)
end

local stored = redis.call('HMGET', credentials_key, credential, TOTALS)
local aggregate = numbers(stored[1], 4)
local totals = numbers(stored[2], 4)

-- The credential's part in the totals before this report.
local old_mean, old_count = nil, 0
if aggregate ~= nil then
  old_mean = mean(aggregate[1], aggregate[2])
  if old_mean ~= nil then
    old_count = aggregate[2]
  end
end

local value = table.concat({utilization_text, tostring(shed_rate), tostring(latency_ms),
  tostring(window_ms), tostring(now_ms)}, ',')
local until_ms = now_ms + window_ms
local recorded = 0
local sum, count, freshest, scanned
if aggregate == nil or now_ms - aggregate[4] >= refresh_ms or now_ms < aggregate[4] then
  -- 1a. the credential's aggregate, rebuilt: its other proxies' fresh reports are summed, the
  -- stale ones (and any value that does not parse) deleted
  local flat = redis.call('HGETALL', proxies_key)
  sum, count, freshest, scanned = 0, 0, 0, now_ms
  local mine = false
  local stale = {}
  for i = 1, #flat, 2 do
    local field = flat[i]
    if field == proxy then
      mine = true
    else
      local report = numbers(flat[i + 1], 5)
      if report ~= nil and fresh(report) then
        sum = sum + unit(report[1])
        count = count + 1
        freshest = math_max(freshest, report[5] + report[4])
      else
        stale[#stale + 1] = field
      end
    end
  end
  delete(proxies_key, stale)
  if mine or count < max_proxies then
    recorded = 1
  end
else
  -- 1b. the credential's aggregate, kept up to date: this proxy's last report out (every report
  -- in the hash counts: the last rebuild deleted the stale ones, and it was recorded since or
  -- was fresh then), its new one in
  sum, count, freshest, scanned = aggregate[1], aggregate[2], aggregate[3], aggregate[4]
  local old = redis.call('HGET', proxies_key, proxy)
  if old or redis.call('HLEN', proxies_key) < max_proxies then
    recorded = 1
    local report = numbers(old, 5)
    if report ~= nil and report[5] + report[4] > scanned then
      sum = sum - unit(report[1])
      count = count - 1
    end
  end
end
if recorded == 1 then
  redis.call('HSET', proxies_key, proxy, value)
  sum = sum + utilization
  count = count + 1
  freshest = math_max(freshest, until_ms)
  if redis.call('PTTL', proxies_key) < window_ms then
    redis.call('PEXPIRE', proxies_key, window_ms)
  end
end
if count <= 0 then
  sum, count = 0, 0
end
local new_mean = mean(sum, count)

-- 2. the totals: rebuilt from the credentials' aggregates when refresh_ms old (the credentials
-- whose freshest report is stale deleted), else this credential's old part out, its new one in
local total, credentials, proxies, computed
local changes = {}
if new_mean ~= nil then
  changes = {credential, table.concat({fmt(sum), tostring(count), tostring(freshest),
    tostring(scanned)}, ',')}
else
  redis.call('HDEL', credentials_key, credential)
end
if totals == nil or now_ms - totals[4] >= refresh_ms or now_ms < totals[4] then
  if #changes > 0 then
    redis.call('HSET', credentials_key, changes[1], changes[2])
    changes = {}
  end
  local flat = redis.call('HGETALL', credentials_key)
  total, credentials, proxies, computed = 0, 0, 0, now_ms
  local stale = {}
  for i = 1, #flat, 2 do
    local field = flat[i]
    if field ~= TOTALS then
      local other = numbers(flat[i + 1], 4)
      local m = nil
      if other ~= nil and other[3] > now_ms then
        m = mean(other[1], other[2])
      end
      if m ~= nil then
        total = total + m
        credentials = credentials + 1
        proxies = proxies + other[2]
      else
        stale[#stale + 1] = field
      end
    end
  end
  delete(credentials_key, stale)
else
  total, credentials, proxies, computed = totals[1], totals[2], totals[3], totals[4]
  if old_mean ~= nil then
    total = total - old_mean
    credentials = credentials - 1
    proxies = proxies - old_count
  end
  if new_mean ~= nil then
    total = total + new_mean
    credentials = credentials + 1
    proxies = proxies + count
  end
  if credentials <= 0 then
    total, credentials, proxies = 0, 0, 0
  end
end
changes[#changes + 1] = TOTALS
changes[#changes + 1] = table.concat({fmt(total), tostring(credentials), tostring(proxies),
  tostring(computed)}, ',')
redis.call('HSET', credentials_key, unpack(changes))
if redis.call('PTTL', credentials_key) < window_ms then
  redis.call('PEXPIRE', credentials_key, window_ms)
end

-- 3. the level: the mean of the credentials' means
local level = 0
if credentials > 0 then
  level = unit(total / credentials)
end
return {string.format('%.17g', level), proxies, recorded, credentials}

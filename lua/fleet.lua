-- fleet.lua: records one proxy's load report and answers the fleet's load level: the mean
-- utilization of the proxies whose report is fresh, clamped to [0, 1].
-- One key, so one call on one node of a Redis Cluster.
--
-- KEYS: the fleet hash, sluice:fleet:load: one field per proxy id (as the service keeps it,
--       namespaced by the proxy's credential).
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), proxy id,
--       utilization, shed_rate, latency_ms, interval_ms, fresh_intervals, min_fresh_ms,
--       max_fields.
--       The service has validated the report (finite, in bounds), and sends as interval_ms the
--       longest the proxy waits before its next sync (the hint it is answered, never below its
--       clamped interval).
-- Returns: {level, fresh, recorded}:
--   level: the mean utilization of the fresh reports, clamped to [0, 1], as a string (Redis
--     would truncate a Lua number to an integer); "0" if no report is fresh;
--   fresh: how many proxies' reports are fresh, this one's included when recorded;
--   recorded: 1 if this report was recorded, 0 if the hash was full (see below).
--
-- A field's value is "utilization,shed_rate,latency_ms,interval_ms,time_ms", time_ms being when
-- it was recorded (Redis TIME, in ms). A report is fresh while it is younger than
-- max(min_fresh_ms, fresh_intervals x its interval_ms): a proxy that missed that many syncs is
-- gone or cut off, and its load is no longer the fleet's. Every call deletes the stale fields
-- (and any value that does not parse), and lets the key expire when its freshest report would
-- be stale, so a fleet that stops reporting leaves nothing behind.
--
-- The hash holds at most max_fields reports. When it is full of fresh reports, the report of a
-- proxy not yet in it is refused (not recorded; the proxy is still answered the others' level)
-- rather than the oldest evicted: with eviction, whoever sends reports under many proxy ids
-- could push out the reports of the proxies really running and set the level alone; refusing
-- keeps every running proxy counted, and a newcomer gets in as soon as a report goes stale. A
-- proxy already in the hash always replaces its own report. Each call reads the whole hash, so
-- the cap also bounds the time one call holds Redis.
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock and
-- load_hash.

local now_ms = math.floor(clock(ARGV[1]) / 1000)
local key = KEYS[1]
local proxy = ARGV[2]
local utilization = tonumber(ARGV[3])
local shed_rate = tonumber(ARGV[4])
local latency_ms = tonumber(ARGV[5])
local interval_ms = tonumber(ARGV[6])
local fresh_intervals = tonumber(ARGV[7])
local min_fresh_ms = tonumber(ARGV[8])
local max_fields = tonumber(ARGV[9])

-- How long the report of a proxy that syncs every `interval` ms stays fresh.
local function window_ms(interval)
  return math.max(min_fresh_ms, fresh_intervals * interval)
end

-- The utilization, interval_ms and time_ms of a stored value, or nil if it does not parse.
local function parse(value)
  local u, _, _, interval, at = string.match(value,
    '^([^,]+),([^,]+),([^,]+),([^,]+),([^,]+)$')
  u, interval, at = tonumber(u), tonumber(interval), tonumber(at)
  if u == nil or interval == nil or at == nil then
    return nil
  end
  return u, interval, at
end

-- 1. the other proxies' reports: the fresh ones are summed, the stale ones deleted. A time
-- ahead of the clock (a failover to a node whose clock is behind) counts as fresh, unless it is
-- a whole window ahead.
local flat, fields = load_hash(key)
local sum = 0
local fresh = 0
local expire_ms = 0
local stale = {}
for i = 1, #flat, 2 do
  local field = flat[i]
  if field ~= proxy then
    local u, interval, at = parse(flat[i + 1])
    local age = nil
    local window = 0
    if u ~= nil then
      age = now_ms - at
      window = window_ms(interval)
    end
    if age ~= nil and age < window and age > -window then
      sum = sum + u
      fresh = fresh + 1
      expire_ms = math.max(expire_ms, window - age)
    else
      stale[#stale + 1] = field
    end
  end
end
-- (in slices: unpack of a whole full hash could overflow Lua's stack)
for first = 1, #stale, 1000 do
  redis.call('HDEL', key, unpack(stale, first, math.min(first + 999, #stale)))
end

-- 2. this proxy's report: replaces its own, or takes a free place
local recorded = 0
if fields[proxy] ~= nil or fresh < max_fields then
  local value = table.concat({tostring(utilization), tostring(shed_rate), tostring(latency_ms),
    tostring(interval_ms), tostring(now_ms)}, ',')
  redis.call('HSET', key, proxy, value)
  recorded = 1
  sum = sum + utilization
  fresh = fresh + 1
  expire_ms = math.max(expire_ms, window_ms(interval_ms))
end
if fresh > 0 then
  redis.call('PEXPIRE', key, math.max(1, math.ceil(expire_ms)))
end

-- 3. the level of the fresh reports
local level = 0
if fresh > 0 then
  level = math.min(1, math.max(0, sum / fresh))
end
return {string.format('%.17g', level), fresh, recorded}

-- window.lua: one strict decision for one entry whose limits are windows (fixed_window,
-- sliding_window): counts `cost` in every window if every window has room for it, otherwise
-- counts nothing. The arithmetic is core/src/algorithm.rs's (`fixed`, `sliding`) and the
-- windows are core/src/window.rs's (UTC clock and calendar), written in the same order so both
-- decide alike (see counter-service/tests/vectors.rs).
--
-- KEYS: the entry's limit keys, in limit order:
--       sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>/<algorithm>[/<calendar>]
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), cost, n_limits,
--       then n_limits x (requests, period_ms, window), the window one of: fixed (period_ms long,
--       aligned to the Unix epoch, so to the UTC clock), week (from Monday 00:00 UTC), month
--       (from the 1st 00:00 UTC), sliding (period_ms long, aligned to the epoch).
-- Each key is a hash. fixed, week, month: n (requests counted in the window), w (its start, us).
--   sliding: p (the previous window's count), c (the current window's), w (the current window's
--   number since the epoch). It is written only when a request is counted, and expires a second
--   after its window ends (sliding: after the next window, which still weighs its count).
-- Returns: {allowed (0/1), remaining, retry_after_ms, reset_ms}, integers, from the limit that
--   speaks as in core's limiter: when admitted, the one with the fewest requests left; when
--   denied, the denying one that makes the client wait longest.
--   remaining: whole requests left after the decision;
--   retry_after_ms: when denied, until the request would be admitted, else 0;
--   reset_ms: until the window no longer counts a request (fixed: its end; sliding: the end of
--   the window after the one that holds a count), 0 if none.
--   Times are core's microseconds rounded up to milliseconds.
--
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock and
-- expire_key.

local DAY_US = 86400000000

-- Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm), for dates from
-- 1970 on, as core/src/window.rs.
local function days_from_civil(year, month, day)
  if month <= 2 then
    year = year - 1
  end
  local era = math.floor(year / 400)
  local yoe = year - era * 400
  local mp = (month + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + day - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return math.max(era * 146097 + doe - 719468, 0)
end

-- The date of a day since 1970-01-01: year, month 1..12, day 1..31.
local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local day = doy - math.floor((153 * mp + 2) / 5) + 1
  local month = mp + 3
  if mp >= 10 then
    month = mp - 9
  end
  local year = yoe + era * 400
  if month <= 2 then
    year = year + 1
  end
  return year, month, day
end

-- The start and the end (exclusive) of the window that holds `now` (us). `length` (us) is a
-- fixed window's length. math.fmod is exact on doubles: the times stay whole microseconds.
local function bounds(window, length, now)
  local days = (now - math.fmod(now, DAY_US)) / DAY_US
  if window == 'week' then
    -- Day 0 was a Thursday: Monday is 3 days later in the week's count.
    local since_monday = (days + 3) % 7
    local start = math.max(days - since_monday, 0) * DAY_US
    return start, start + 7 * DAY_US
  elseif window == 'month' then
    local year, month = civil_from_days(days)
    local start = days_from_civil(year, month, 1) * DAY_US
    if month == 12 then
      year, month = year + 1, 1
    else
      month = month + 1
    end
    return start, days_from_civil(year, month, 1) * DAY_US
  end
  local start = now - math.fmod(now, length)
  return start, start + length
end

local now = clock(ARGV[1])
local cost = tonumber(ARGV[2])
local n = tonumber(ARGV[3])

-- Each window in the window of `now` (a new one starts empty), and whether it has room.
local windows = {}
local allowed = true
for i = 1, n do
  local w = {
    key = KEYS[i],
    requests = tonumber(ARGV[1 + 3 * i]),
    length = tonumber(ARGV[2 + 3 * i]) * 1000,
    window = ARGV[3 + 3 * i],
  }
  if w.window == 'sliding' then
    local stored = redis.call('HMGET', w.key, 'p', 'c', 'w')
    local was = tonumber(stored[3])
    w.elapsed = math.fmod(now, w.length)
    w.start = now - w.elapsed
    w.number = w.start / w.length
    w.previous, w.current = 0, 0
    if was == w.number then
      w.previous, w.current = tonumber(stored[1]) or 0, tonumber(stored[2]) or 0
    elseif was == w.number - 1 then
      w.previous = tonumber(stored[2]) or 0
    end
    local into = w.elapsed / w.length
    w.weighted = w.previous * (1 - into) + w.current
    -- Counts are whole and the weight exact to a microsecond: a hair of tolerance keeps a
    -- request at exactly the limit from being refused by rounding (as core).
    w.ok = w.weighted + cost <= w.requests + 1e-9
  else
    local stored = redis.call('HMGET', w.key, 'n', 'w')
    w.start, w.finish = bounds(w.window, w.length, now)
    w.count = 0
    if tonumber(stored[2]) == w.start then
      w.count = tonumber(stored[1]) or 0
    end
    w.ok = w.count + cost <= w.requests
  end
  if not w.ok then
    allowed = false
  end
  windows[i] = w
end

-- Each window's verdict (core's `fixed` and `sliding`), counting the request if all have room.
for i = 1, n do
  local w = windows[i]
  if w.window == 'sliding' then
    local counted = w.weighted
    if w.ok then
      counted = w.weighted + cost
    end
    if allowed then
      w.current = w.current + cost
    end
    w.retry = 0
    if not w.ok then
      if w.current + cost <= w.requests and w.previous > 0 then
        -- Later in this window, once enough of the previous one has slid out.
        local into = 1 - (w.requests - cost - w.current) / w.previous
        w.retry = math.max(math.ceil(into * w.length - w.elapsed), 1)
      else
        -- In the next window, once enough of this one has slid out.
        local into = 1 - (w.requests - cost) / math.max(w.current, 1)
        w.retry = math.ceil(w.length + math.max(into, 0) * w.length - w.elapsed)
      end
    end
    w.reset = 0
    if w.current > 0 then
      w.reset = w.start + 2 * w.length - now
    elseif w.previous > 0 then
      w.reset = w.start + w.length - now
    end
    w.remaining = math.floor(math.max(w.requests - counted, 0))
    if allowed then
      redis.call('HSET', w.key, 'p', w.previous, 'c', w.current, 'w', w.number)
      expire_key(w.key, math.ceil((w.start + 2 * w.length - now) / 1000), 0)
    end
  else
    local until_end = w.finish - now
    local counted = w.count
    if w.ok then
      counted = w.count + cost
    end
    w.remaining = math.max(w.requests - counted, 0)
    w.retry = 0
    if not w.ok then
      w.retry = until_end
    end
    w.reset = 0
    if counted > 0 then
      w.reset = until_end
    end
    if allowed then
      redis.call('HSET', w.key, 'n', w.count + cost, 'w', w.start)
      expire_key(w.key, math.ceil(until_end / 1000), 0)
    end
  end
end

-- The limit that speaks, as core's limiter chooses it.
local chosen = nil
for i = 1, n do
  local w = windows[i]
  local tighter
  if chosen == nil then
    tighter = true
  elseif allowed then
    tighter = w.remaining < chosen.remaining
  else
    tighter = (not w.ok) and w.retry > chosen.retry
  end
  if tighter and (allowed or not w.ok) then
    chosen = w
  end
end

return {
  allowed and 1 or 0,
  chosen.remaining,
  math.ceil(chosen.retry / 1000),
  math.ceil(chosen.reset / 1000),
}

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
--       (from the 1st 00:00 UTC), sliding (period_ms long, aligned to the epoch); then
--       penalty_ms (0 or absent: none), its key after the limit keys in KEYS (as check.lua:
--       a denial starts it if the check would be denied without the largest debtor's unleased
--       debt too, prelude's window_debts).
-- Each key is a hash. fixed, week, month: n (requests counted in the window), w (its start, us).
--   sliding: p (the previous window's count), c (the current window's), w (the current window's
--   number since the epoch). It is written only when a request is counted, and expires a second
--   after its window ends (sliding: after the next window, which still weighs its count).
--   The same hash holds the leases of the proxies whose rule of the same limit is cached
--   (sync_window.lua: g:p, x:p, d:p, s:p): a strict check sets their unexpired leases aside, as
--   requests of the window, so the two never admit more than the window together.
-- Returns: {allowed (0/1), remaining, retry_after_ms, reset_ms}, integers, from the limit that
--   speaks as in core's limiter: when admitted, the one with the fewest requests left; when
--   denied, the denying one that makes the client wait longest.
--   remaining: whole requests left after the decision (and the leases held);
--   retry_after_ms: when denied, until the request would be admitted, else 0;
--   reset_ms: until the window no longer counts a request (fixed: its end; sliding: the end of
--   the window after the one that holds a count), 0 if none.
--   Times are core's microseconds rounded up to milliseconds.
--
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock,
-- load_hash, leases, window_state (the windows and their counts), window_debts, expire_key,
-- penalty_before and penalty_after.

local now = clock(ARGV[1])
local cost = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local penalized, penalty_us, penalty_key = penalty_before(KEYS[n + 1], ARGV[4 + 3 * n], now)
if penalized ~= nil then
  return penalized
end

-- Each window in the window of `now` (a new one starts empty), and whether it has room once the
-- unexpired leases of the proxies (cached rules of the same limit, sync_window.lua) are set
-- aside: they may spend them until they expire, at the latest when the window ends.
local windows = {}
local allowed = true
-- whether a window would deny the check without its largest debtor's unleased debt too
local over = false
for i = 1, n do
  local w = {
    key = KEYS[i],
    requests = tonumber(ARGV[1 + 3 * i]),
    length = tonumber(ARGV[2 + 3 * i]) * 1000,
    window = ARGV[3 + 3 * i],
  }
  local flat, fields = load_hash(w.key)
  window_state(w, fields, now)
  w.held = leases(w.key, flat, fields, now, nil, nil)
  -- Counts are whole and the weight exact to a microsecond: a hair of tolerance keeps a
  -- request at exactly the limit from being refused by rounding (as core).
  w.ok = w.weighted + w.held + cost <= w.requests + 1e-9
  local owed = window_debts(w.key, flat, w, now, nil, 0)
  if not w.ok then
    allowed = false
    if not (w.weighted - owed + w.held + cost <= w.requests + 1e-9) then
      over = true
    end
  end
  windows[i] = w
end

-- Each window's verdict (core's `fixed` and `sliding`), counting the request if all have room.
-- The leases held count as requests of the current window (they are spent in it), but only
-- the requests counted are stored.
for i = 1, n do
  local w = windows[i]
  if w.window == 'sliding' then
    local counted = w.weighted + w.held
    if w.ok then
      counted = counted + cost
    end
    if allowed then
      w.current = w.current + cost
    end
    local current = w.current + w.held
    w.retry = 0
    if not w.ok then
      if current + cost <= w.requests and w.previous > 0 then
        -- Later in this window, once enough of the previous one has slid out.
        local into = 1 - (w.requests - cost - current) / w.previous
        w.retry = math.max(math.ceil(into * w.length - w.elapsed), 1)
      else
        -- In the next window, once enough of this one has slid out.
        local into = 1 - (w.requests - cost) / math.max(current, 1)
        w.retry = math.ceil(w.length + math.max(into, 0) * w.length - w.elapsed)
      end
    end
    w.reset = 0
    if current > 0 then
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
    local counted = w.count + w.held
    if w.ok then
      counted = counted + cost
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

return penalty_after({
  allowed and 1 or 0,
  chosen.remaining,
  math.ceil(chosen.retry / 1000),
  math.ceil(chosen.reset / 1000),
}, over, penalty_us, penalty_key, now)

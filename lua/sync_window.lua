-- sync_window.lua: applies one proxy's reported spend to the global windows (fixed_window,
-- sliding_window) of a batch of entries, and answers each entry with a quota lease (a grant):
-- the cached rules of windows. sync.lua does the same for token buckets; the service sends each
-- entry of a batch to the one of the two its algorithm needs (one call per Redis Cluster hash
-- slot and script: every key of one call is in one slot).
--
-- What a lease of a window is. The service keeps each window's global count in the hash that
-- window.lua decides strict checks on (the same key, so strict checks and cached syncs of one
-- limit see one count): a fixed window its count and start, a sliding window the previous and
-- current windows' counts and the current window's number, aligned as core/src/window.rs. A
-- proxy's report (`spent`) is added to the window of `now` (but see late reports below).
-- A lease is a share of what is left in the window once every other proxy's unexpired lease is
-- set aside (`requests - weighted count - others' leases`, never below 0): what the proxy wants
-- (its recent demand, spent + denied, over 1.25 intervals, as sync.lua), or its demand-share of
-- what is left if that is more (the others' demand is of every proxy that synced within a lease
-- TTL: their leases ended with the last window, but they are still asking). It expires at the
-- sooner of the lease TTL and the end of the window (of every limit of the entry), so it is
-- never spent in the next window; its ttl_ms is rounded down to the millisecond. Nothing is
-- borrowed: at every grant, the count and the unexpired leases together are at most `requests`.
--
-- A report that arrives after its window ended. The last requests of a window are reported at
-- the proxy's first sync in the next one, which cannot tell which came before the boundary. But
-- the proxy's lease ended with the old window, so what it spent before the boundary came from
-- that lease (g:p, at most), and what it spent after, from its fallback. So when the proxy's
-- last sync (s:p) was before the window's start, min(spent, g:p) belongs to the old window:
-- a fixed window drops it (that window is over), a sliding window adds it to the previous
-- window's count (which still weighs) when the last sync was in it; the rest is counted in the
-- new window. The error: fallback requests after the boundary may be taken for the unspent
-- part of the old lease and go uncounted. They are requests admitted outside a lease, which
-- the bound below already counts as overshoot; and the new window is never charged for a
-- request of the old one that a lease covered.
--
-- The bound. The requests admitted from leases of a window never exceed `requests` less what
-- was counted before them. Overshoot comes only from requests admitted outside a lease of the
-- window and not yet reported when another proxy's lease was granted: a proxy's fallback (from
-- the window's start, where every lease ended, until its first sync answer in the window, at
-- most one sync interval plus a round trip; and whenever it cannot reach the service), an old
-- lease spent while its answer was on its way past the window's end (a proxy times its lease
-- from the answer's arrival), and a lease that expired before its proxy reported it. So in one
-- window the fleet admits at most `requests + sum over proxies of those requests`, and every
-- one of them is counted when reported, withholding leases until the window ends.
--
-- KEYS: every limit key of every entry, in entry order then limit order:
--       sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>/<algorithm>[/<calendar>]
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), proxy id,
--       interval_ms, grant_ttl_ms, report_window_ms, entry count, debtor (as sync.lua),
--       then per entry: n_limits, spent, denied, epoch, counter (its round, as sync.lua), then
--       n_limits x (requests, period_ms, window), then penalty_ms (its key after the entry's
--       limit keys in KEYS when not 0, as sync.lua),
--       the window one of fixed, week, month, sliding (as window.lua). The service has clamped
--       interval_ms and cut spent and denied to what the entry's limits make possible over
--       report_window_ms (as for sync.lua).
-- Returns: a flat array of integers, seven per entry in order: grant, ttl_ms, remaining,
--   reset_ms, from the limit with the fewest requests left, 1 if the entry was a replay of a
--   report already applied (nothing counted; as sync.lua) else 0, token_ms, and penalty_ms
--   (the milliseconds left of the entry's penalty, as sync.lua; started, as there, from the
--   counts without the largest debtor's unleased debt, prelude's window_debts):
--   remaining: whole requests left in the window once the report is counted (the lease is not
--     subtracted: the proxy subtracts what it spends from it, as for a token bucket);
--   reset_ms: core's Verdict.reset_us once the leases are spent: until the window ends (fixed),
--     until the weighted count is 0 (sliding: the end of the next window), 0 if none;
--   token_ms: until every window admits one request more than `remaining` (0: every one does
--     now), the longest of room_after's: once the proxies spent the `remaining` requests this
--     answer counts (none if it is 0), the wait for the next one, whichever window is short, as
--     sync.lua's token_ms for buckets. A fixed window's is its end; a sliding window's comes
--     when enough of its previous window has slid out, where reset_ms (when none of it counts)
--     is far later: 20 an hour used up waits the hour's end and 180 s, reset_ms another hour.
--
-- Each key is a hash: the window's counts (window.lua's n, w or p, c, w), and per proxy p: g:p
-- (outstanding grant), x:p (its expiry, us), d:p (demand, requests/s), s:p (last sync, us), and
-- r:p (the last round applied, when the proxy labels its reports; see sync.lua), and per
-- debtor d, u:d (what its proxies counted beyond their leases, prelude's window_debts). A
-- fixed window's count, or a sliding window's current one, never exceeds requests plus what
-- one report may count (requests x (1 + report_window_ms / period_ms)). The key expires a second
-- after the window ends (sliding: after the next window, which still weighs its count); every
-- lease ends before.
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock,
-- load_hash, leases, window_state (the windows and their counts), proxy_demand, expire_key,
-- round_is_new, round_text, forget_rounds, window_debts, penalty_end and penalty_start.

local now = clock(ARGV[1])
local proxy = ARGV[2]
local interval_ms = tonumber(ARGV[3])
local grant_ttl_ms = tonumber(ARGV[4])
local report_window_ms = tonumber(ARGV[5])
local count = tonumber(ARGV[6])
local debtor = ARGV[7]
local interval_us = interval_ms * 1000
local grant_ttl_us = grant_ttl_ms * 1000
local stale_before = now - grant_ttl_us
-- the other proxies' last rounds are kept for the report window, then forgotten
local forget_before = now - report_window_ms * 1000

local g_field = 'g:' .. proxy
local x_field = 'x:' .. proxy
local d_field = 'd:' .. proxy
local s_field = 's:' .. proxy
local r_field = 'r:' .. proxy

-- The demand (requests/s) of every proxy but `except` that synced at or after `since`, from a
-- loaded hash: its lease may have ended with the last window, but it is still asking, and the
-- first proxy to sync in a new window must not take the whole window from it.
local function recent_demand(flat, fields, except, since)
  local demand = 0
  for i = 1, #flat, 2 do
    local field = flat[i]
    if string.sub(field, 1, 2) == 's:' and string.sub(field, 3) ~= except
        and (tonumber(flat[i + 1]) or 0) >= since then
      demand = demand + (tonumber(fields['d:' .. string.sub(field, 3)]) or 0)
    end
  end
  return demand
end

-- How long (us) until window `w` (after window_state and the report) admits one request once
-- it counts `more` requests more now: 0 if it does at once; a fixed window, at its end; a
-- sliding window, once enough of its previous window has slid out (later in this window), or of
-- this one (in the next). It is core's Bucket::check of a request of cost 1 (its retry_after_us,
-- core/src/algorithm.rs `fixed` and `sliding`) on the window charged `more`, written in the
-- same order so both agree (counter-service/tests/vectors.rs).
local function room_after(w, more, now)
  local requests = w.requests
  if w.window == 'sliding' then
    local current = w.current + more
    local weighted = w.previous * (1 - w.elapsed / w.length) + current
    if weighted + 1 <= requests + 1e-9 then
      return 0
    elseif current + 1 <= requests and w.previous > 0 then
      local into = 1 - (requests - 1 - current) / w.previous
      return math.max(math.ceil(into * w.length - w.elapsed), 1)
    end
    local into = 1 - (requests - 1) / math.max(current, 1)
    return math.ceil(w.length + math.max(into, 0) * w.length - w.elapsed)
  end
  if w.count + more + 1 <= requests then
    return 0
  end
  return w.finish - now
end

local result = {}
local arg = 8
local key_index = 1
for _ = 1, count do
  local n = tonumber(ARGV[arg])
  local spent = tonumber(ARGV[arg + 1])
  local denied = tonumber(ARGV[arg + 2])
  local epoch = tonumber(ARGV[arg + 3])
  local counter = tonumber(ARGV[arg + 4])
  arg = arg + 5
  local labeled = epoch ~= 0 or counter ~= 0
  -- whether this report is new (decided on the entry's first key: all are written together)
  local new = true
  -- whether some of the report was spent from the lease granted at the proxy's last sync
  local from_lease = false

  -- 1. each window at `now`, with the report counted in it
  local windows = {}
  local demand_fields = nil
  local lease_end = now + grant_ttl_us
  for i = 1, n do
    local w = {
      key = KEYS[key_index],
      requests = tonumber(ARGV[arg]),
      length = tonumber(ARGV[arg + 1]) * 1000,
      window = ARGV[arg + 2],
    }
    key_index = key_index + 1
    local most = w.requests + w.requests * report_window_ms / tonumber(ARGV[arg + 1])
    arg = arg + 3
    local flat, fields = load_hash(w.key)
    if i == 1 then
      demand_fields = fields
      new = round_is_new(fields[r_field], epoch, counter)
      if not new then
        spent, denied = 0, 0
      end
    end
    window_state(w, fields, now)
    -- the unexpired leases of the other proxies (every one ends with this window at the
    -- latest); the fields of proxies silent for a grant TTL are dropped
    w.others = leases(w.key, flat, fields, now, proxy, stale_before)
    w.others_demand = recent_demand(flat, fields, proxy, stale_before)
    forget_rounds(w.key, flat, proxy, forget_before)
    -- what the proxy's lease of the old window covered, if it last synced there
    local last_sync = tonumber(fields[s_field])
    local leased = math.min(spent, tonumber(fields[g_field]) or 0)
    if leased > 0 then
      from_lease = true
    end
    local late = 0
    if last_sync ~= nil and last_sync < w.start then
      late = leased
    end
    local added = 0
    if w.window == 'sliding' then
      if late > 0 and last_sync >= w.start - w.length then
        w.previous = math.min(w.previous + late, most)
      end
      local was = w.current
      w.current = math.min(w.current + spent - late, most)
      added = w.current - was
      w.weighted = w.previous * (1 - w.elapsed / w.length) + w.current
    else
      local was = w.count
      w.count = math.min(w.count + spent - late, most)
      added = w.count - was
      w.weighted = w.count
    end
    -- the debts beyond leases (what this window counted beyond the part of the proxy's lease
    -- it holds), the largest of which a penalty does not count
    w.owed = window_debts(w.key, flat, w, now, debtor, math.max(0, added - (leased - late)))
    if w.finish < lease_end then
      lease_end = w.finish
    end
    windows[i] = w
  end
  local penalty_us = tonumber(ARGV[arg]) * 1000
  arg = arg + 1
  local penalty_key = nil
  if penalty_us > 0 then
    penalty_key = KEYS[key_index]
    key_index = key_index + 1
  end

  -- 2. the proxy's demand on this entry (requests/s) and what it wants for 1.25 intervals, as
  -- in sync.lua.
  local demand, want = proxy_demand(tonumber(demand_fields[s_field]),
    tonumber(demand_fields[d_field]), now, interval_us, interval_ms, spent, denied)

  -- 3. the grant: what the proxy wants, or its demand-share of what is left if that is more,
  -- never more than any window has left once the others' leases are set aside; and for no
  -- longer than the sooner of the lease TTL and the end of every window (whole milliseconds).
  local ttl_ms = math.floor((lease_end - now) / 1000)
  local grant = nil
  -- whether a window would have nothing to grant without its largest debtor's unleased debt
  local starved = false
  for i = 1, n do
    local w = windows[i]
    local fraction = 0
    if demand > 0 then
      fraction = demand / (demand + w.others_demand)
    end
    -- a hair of tolerance, as core and window.lua: the weight is exact to a microsecond
    local available = math.floor(w.requests - w.weighted - w.others + 1e-9)
    if math.floor(w.requests - w.weighted + w.owed - w.others + 1e-9) <= 0 then
      starved = true
    end
    local share = math.floor(available * fraction)
    local g = math.min(available, math.max(want, share))
    if grant == nil or g < grant then
      grant = g
    end
  end
  grant = grant or 0
  if grant < 0 or ttl_ms <= 0 then
    grant = 0
  end

  -- 3b. the penalty, as sync.lua: a key in its penalty gets nothing; one this report shows over
  -- (denials with nothing to grant, or its spend of a lease counted past a window's requests),
  -- without the largest debtor's unleased debt, starts it
  local penalty_ms = 0
  if penalty_key ~= nil then
    local ends = penalty_end(penalty_key, penalty_us)
    if ends <= now then
      local past = false
      for i = 1, n do
        if windows[i].weighted - windows[i].owed > windows[i].requests + 1e-9 then
          past = true
        end
      end
      if (denied > 0 and grant == 0 and starved) or (from_lease and past) then
        ends = penalty_start(penalty_key, now, penalty_us)
      end
    end
    if ends > now then
      grant = 0
      penalty_ms = math.ceil((ends - now) / 1000)
    end
  end
  local expiry = now + ttl_ms * 1000

  -- 4. write back; the key lives until its window no longer counts, and every lease ends before
  local chosen = nil
  for i = 1, n do
    local w = windows[i]
    local held = w.others + grant
    w.remaining = math.floor(math.max(w.requests - w.weighted + 1e-9, 0))
    w.reset = 0
    if w.window == 'sliding' then
      redis.call('HSET', w.key, 'p', w.previous, 'c', w.current, 'w', w.number,
        g_field, grant, x_field, expiry, d_field, demand, s_field, now)
      if new and labeled then
        redis.call('HSET', w.key, r_field, round_text(epoch, counter, now))
      end
      expire_key(w.key, math.ceil((w.start + 2 * w.length - now) / 1000), 0)
      if w.current + held > 0 then
        w.reset = w.start + 2 * w.length - now
      elseif w.previous > 0 then
        w.reset = w.finish - now
      end
    else
      redis.call('HSET', w.key, 'n', w.count, 'w', w.start,
        g_field, grant, x_field, expiry, d_field, demand, s_field, now)
      if new and labeled then
        redis.call('HSET', w.key, r_field, round_text(epoch, counter, now))
      end
      expire_key(w.key, math.ceil((w.finish - now) / 1000), 0)
      if w.count + held > 0 then
        w.reset = w.finish - now
      end
    end
    if chosen == nil or w.remaining < chosen.remaining then
      chosen = w
    end
  end

  -- 5. when every window has room for one request more than the `remaining` answered (us)
  local token_us = 0
  for i = 1, n do
    local wait = room_after(windows[i], chosen.remaining, now)
    if wait > token_us then
      token_us = wait
    end
  end

  -- 6. the answer, integers only (Redis truncates Lua numbers in replies)
  result[#result + 1] = grant
  result[#result + 1] = math.max(ttl_ms, 0)
  result[#result + 1] = chosen.remaining
  result[#result + 1] = math.ceil(chosen.reset / 1000)
  if new then
    result[#result + 1] = 0
  else
    result[#result + 1] = 1
  end
  result[#result + 1] = math.ceil(token_us / 1000)
  result[#result + 1] = penalty_ms
end

return result

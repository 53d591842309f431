-- sync.lua: applies one proxy's reported spend to the global token buckets of a batch of entries,
-- and answers each entry with a quota lease (a grant) sized by the proxy's demand.
-- The service makes one call per Redis Cluster hash slot: every key of one call is in one slot.
--
-- KEYS: every limit key of every entry, in entry order then limit order:
--       sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), proxy id,
--       interval_ms, grant_ttl_ms, report_window_ms, entry count, debtor (the proxy's
--       credential, or its id under one shared token: prelude's settle_debts),
--       then per entry: n_limits, spent, denied, epoch, counter (its round: 0 0 when the proxy
--       sends none), then n_limits x (requests, period_ms, burst), then penalty_ms (the
--       rule's penalty, 0: none; if not 0, the entry's penalty key follows its limit keys in
--       KEYS, see the prelude's penalty_end).
--       The service has clamped interval_ms to its bounds and cut spent and denied to what the
--       entry's limits make possible over report_window_ms (the longest time one report may
--       cover: the lease lifetime plus an outage allowance).
-- Returns: a flat array of integers, seven per entry in order: grant, ttl_ms, remaining, reset_ms,
--   1 if the entry was a replay of a report already applied (nothing counted) else 0, and
--   token_ms: until every limit holds remaining + 1 tokens (0: every one does now), the longest
--   of the limits' ceil((remaining + 1 - tokens) x period_ms / requests), as core's
--   Bucket::check sizes the wait of a request of that cost (and check.lua its retry_after_ms):
--   once the proxies spent the `remaining` tokens this answer counts (none if it is 0), the wait
--   for the next one, whichever limit is short, where reset_ms (the longest time to full) is
--   not one; and penalty_ms: the milliseconds left of the entry's penalty (0: none), its grant
--   then empty. A penalty starts when the service sees the key over its limit itself: the
--   report's denials when it has nothing to grant (as a strict check would deny), or its spend
--   of a lease putting the key in debt (the proxies admitted more than the key held); in both,
--   without the largest debtor's unleased debt (prelude's settle_debts: what a proxy reports
--   spent beyond the lease the service granted it at its last sync is counted, but kept apart
--   per debtor). Seven per entry.
--
-- Each key is a hash: tokens (float, negative = debt), ts (us), and per proxy p one field l:p,
-- seven doubles packed (prelude's lease_pack): its outstanding grant, the grant's expiry (us),
-- its demand (tokens/s), its last sync (us), and the last round applied on the key (epoch,
-- counter, when it was written; 0 0 0 for a proxy that labels no reports with rounds). A report
-- whose round is not newer (prelude's round_is_newer) is a replay of one already applied (its
-- answer was lost), and counts nothing. The field outlives the lease: it is kept for the report
-- window after the round was written, so a batch resent after an outage of up to that long (the
-- breaker's cool-down, a replica's restart) is recognized; the lease in it counts only until its
-- expiry. A key written by an earlier version holds a proxy's lease as text in p:p ("g x d s")
-- with its round in r:p ("<epoch> <counter> <written>"), or in four fields, g:p, x:p, d:p, s:p:
-- they are read the same, and a proxy's own are replaced by its l:p at its next sync. Per
-- debtor d, u:d holds what its proxies reported beyond the lease each was granted, as long as
-- it weighs (prelude's settle_debts).
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its math_min,
-- math_max, math_floor, math_ceil, clock, hash_fields, load_leases, lease_pack, lease_unpack, lease_numbers,
-- round_numbers, round_is_newer, stored_bucket, refill_bucket, ms_to_full, expire_key,
-- whole_remaining, proxy_demand, settle_debts, penalty_end and penalty_start.
-- The bucket arithmetic is written in the order of core/src/bucket.rs so both agree bit for bit.
--
-- Bounds, whatever a proxy reports: a limit's tokens never go below -(burst + requests x
-- report_window_ms / period_ms), the most one report can legitimately debit; a lease never
-- exceeds burst + requests x 1.5 x interval_ms / period_ms; a key lives at most the time its
-- bucket takes to refill from there, plus the lease TTL and a second, and never more than two
-- of the longest periods (2 x 366 days, the prelude's MAX_TTL_MS).

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

local l_field = 'l:' .. proxy
-- the proxy's fields in earlier layouts
local p_field = 'p:' .. proxy
local g_field = 'g:' .. proxy
local x_field = 'x:' .. proxy
local w_field = 'w:' .. proxy
local d_field = 'd:' .. proxy
local s_field = 's:' .. proxy
local r_field = 'r:' .. proxy

local result = {}
local answered = 0
local limits = {}
local arg = 8
local key_index = 1
for _ = 1, count do
  local n = tonumber(ARGV[arg])
  local spent = tonumber(ARGV[arg + 1])
  local denied = tonumber(ARGV[arg + 2])
  local epoch = tonumber(ARGV[arg + 3])
  local counter = tonumber(ARGV[arg + 4])
  arg = arg + 5
  -- whether this report is new (decided on the entry's first key: all are written together),
  -- and the round to keep in the proxy's lease field
  local new = true
  local round_epoch, round_counter, round_written = 0, 0, 0
  -- what the proxy reports spent beyond the lease it was granted at its last sync
  local unleased = 0

  local last_sync, previous = nil, nil
  for i = 1, n do
    local key = KEYS[key_index]
    key_index = key_index + 1
    local requests = tonumber(ARGV[arg])
    local period_ms = tonumber(ARGV[arg + 1])
    local burst = tonumber(ARGV[arg + 2])
    arg = arg + 3
    -- the most one report can debit from this limit, and so the deepest its debt may go
    local most = burst + requests * report_window_ms / period_ms
    -- the unexpired leases of the other proxies, and an estimate of what they spent from them
    -- since their last sync; the fields of proxies silent for a grant TTL are dropped
    local flat, stored_tokens, stored_ts, mine, mine_text, my_round, others, unreported,
      others_demand, _, older, debts = load_leases(key, now, proxy, stale_before, forget_before)
    if i == 1 then
      -- the proxy's last sync, demand, round and grant: from its l: field, or from the p: and
      -- r: fields of an earlier version (the later of the two where it has both), or the four
      local e, c, w = nil, nil, nil
      local leased = nil
      if mine ~= nil then
        local _
        leased, _, previous, last_sync, e, c, w = lease_unpack(mine)
      end
      if mine_text ~= nil then
        local g, _, d, s = lease_numbers(mine_text)
        if s ~= nil and (last_sync == nil or s > last_sync) then
          last_sync, previous, leased = s, d, g
        end
      end
      if my_round ~= nil then
        local re, rc, rw = round_numbers(my_round)
        if rw ~= nil and (w == nil or rw > w) then
          e, c, w = re, rc, rw
        end
      end
      if last_sync == nil and older then
        local fields = hash_fields(flat)
        last_sync, previous = tonumber(fields[s_field]), tonumber(fields[d_field])
        leased = tonumber(fields[g_field])
      end
      new = round_is_newer(e, c, epoch, counter)
      if not new then
        spent, denied = 0, 0
      end
      unleased = spent - math_min(spent, leased or 0)
      if new and (epoch ~= 0 or counter ~= 0) then
        round_epoch, round_counter, round_written = epoch, counter, now
      else
        round_epoch, round_counter, round_written = e or 0, c or 0, w or 0
      end
    end
    local debit = math_min(spent, most)
    -- 1. refill (a new key starts full), then debit what the proxy spent since its last sync.
    -- The stored tokens still hold what proxies spent and have not reported yet (this proxy's
    -- `spent`, the others' estimate): the burst caps the tokens without them, so a refill is
    -- not lost to a cap the exact bucket would not have reached.
    -- A new key: its first requests came up to an interval ago, decided by the proxies'
    -- fallbacks; the bucket starts full then, and refills over that interval what they spent.
    local tokens, ts = stored_bucket(stored_tokens, stored_ts, burst, now - interval_us)
    -- what the refill repaid of the debts beyond leases since the key was last written
    local paid = math_max(now - ts, 0) * requests / (period_ms * 1000)
    tokens, ts = refill_bucket(tokens, ts, now, requests, period_ms, burst + debit + unreported)
    local refilled = tokens
    tokens = math_max(math_min(tokens - debit, burst + unreported), -most)
    -- the debts beyond leases, the largest of which a penalty does not count
    local owed = settle_debts(key, debts, paid, refilled, tokens, burst, debtor,
      math_max(0, debit - (spent - unleased)))
    -- one table per limit position, reused by every entry (no table made per entry)
    local l = limits[i]
    if l == nil then
      l = {}
      limits[i] = l
    end
    l.key, l.requests, l.period_ms, l.burst = key, requests, period_ms, burst
    l.tokens, l.ts, l.others, l.others_demand, l.older = tokens, ts, others, others_demand, older
    l.owed = owed
    l.earlier = mine_text ~= nil or my_round ~= nil
  end
  local penalty_us = tonumber(ARGV[arg]) * 1000
  arg = arg + 1
  local penalty_key = nil
  if penalty_us > 0 then
    penalty_key = KEYS[key_index]
    key_index = key_index + 1
  end

  -- 2. the proxy's demand on this entry (tokens/s) and what it wants for 1.25 intervals
  local demand, want = proxy_demand(last_sync, previous, now, interval_us, interval_ms, spent,
    denied)
  -- A proxy that had to deny also gets what the refill would otherwise lose to the burst cap
  -- before the next sync: tokens nobody holds are worth nothing once the bucket is full.
  if denied > 0 then
    local surplus = nil
    for i = 1, n do
      local l = limits[i]
      local s = l.tokens + l.requests * interval_ms / l.period_ms - l.burst
      if surplus == nil or s < surplus then
        surplus = s
      end
    end
    if surplus ~= nil and surplus > 0 then
      want = want + math_floor(surplus)
    end
  end

  -- 3. the grant: what the proxy wants, or its share of the free tokens by demand if that is
  -- more (a proxy is never starved while the bucket holds plenty), never more than any limit
  -- still holds once the other proxies' leases are set aside.
  local grant = nil
  -- whether a limit would have nothing to grant without its largest debtor's unleased debt
  local starved = false
  for i = 1, n do
    local l = limits[i]
    -- The proxy's share of the fleet's demand also entitles it to that share of the refill
    -- due before its next sync: a lease is spent over the interval, as the refill arrives.
    local fraction = 0
    if demand > 0 then
      fraction = demand / (demand + l.others_demand)
    end
    local refill = l.requests * interval_ms * 1.5 / l.period_ms
    local available = math_floor(l.tokens - l.others + refill * fraction)
    if math_floor(l.tokens + l.owed - l.others + refill * fraction) <= 0 then
      starved = true
    end
    local share = math_floor(available * fraction)
    -- never more than the bucket holds for it, nor more than a full bucket and the refill
    local g = math_min(available, math_max(want, share), math_floor(l.burst + refill))
    if grant == nil or g < grant then
      grant = g
    end
  end
  grant = grant or 0
  if grant < 0 then
    grant = 0
  end

  -- 3b. the penalty: a key in its penalty gets nothing; one this report shows over starts it,
  -- as the service sees the key without the largest debtor's unleased debt: denials with
  -- nothing to grant, or spend of a lease into debt
  local penalty_ms = 0
  if penalty_key ~= nil then
    local ends = penalty_end(penalty_key, penalty_us)
    if ends <= now then
      local debt = false
      for i = 1, n do
        if limits[i].tokens + limits[i].owed < 0 then
          debt = true
        end
      end
      if (denied > 0 and grant == 0 and starved) or (spent > unleased and debt) then
        ends = penalty_start(penalty_key, now, penalty_us)
      end
    end
    if ends > now then
      grant = 0
      penalty_ms = math_ceil((ends - now) / 1000)
    end
  end

  -- 4. write back; an idle key vanishes once it would be full again and every lease expired
  local remaining = nil
  local reset_ms = 0
  local lease = lease_pack(grant, now + grant_ttl_us, demand, now, round_epoch, round_counter,
    round_written)
  for i = 1, n do
    local l = limits[i]
    redis.call('HSET', l.key, 'tokens', l.tokens, 'ts', l.ts, l_field, lease)
    if l.earlier then
      redis.call('HDEL', l.key, p_field, r_field)
    end
    if l.older then
      redis.call('HDEL', l.key, g_field, x_field, w_field, d_field, s_field)
    end
    local full_ms = ms_to_full(l.tokens, l.requests, l.period_ms, l.burst)
    expire_key(l.key, full_ms, grant_ttl_ms)
    if remaining == nil or l.tokens < remaining then
      remaining = l.tokens
    end
    if full_ms > reset_ms then
      reset_ms = full_ms
    end
  end
  local next_token = whole_remaining(remaining) + 1
  local token_ms = 0
  for i = 1, n do
    local l = limits[i]
    local wait = math.ceil((next_token - l.tokens) * l.period_ms / l.requests)
    if wait > token_ms then
      token_ms = wait
    end
  end

  -- 5. the answer, integers only (Redis truncates Lua numbers in replies)
  result[answered + 1] = grant
  result[answered + 2] = grant_ttl_ms
  result[answered + 3] = whole_remaining(remaining)
  result[answered + 4] = reset_ms
  if new then
    result[answered + 5] = 0
  else
    result[answered + 5] = 1
  end
  result[answered + 6] = token_ms
  result[answered + 7] = penalty_ms
  answered = answered + 7
end

return result

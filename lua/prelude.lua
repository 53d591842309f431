-- prelude.lua: the pieces the service scripts share, written once so they cannot drift apart.
-- It is not a script of its own: the service puts it in front of each script's text and loads
-- the combined text (its SHA is the SHA of the combined text; see counter-service/src/scripts.rs).
-- It defines only locals, reads neither KEYS nor ARGV and calls Redis only when its functions do.
--
-- The bucket arithmetic is written in the order of core/src/bucket.rs so both agree bit for bit
-- (see counter-service/tests/vectors.rs). The windows (window_state: the UTC clock and calendar
-- of core/src/window.rs, the counts of core/src/algorithm.rs) are the ones window.lua decides
-- strict checks on and sync_window.lua leases from, on the same keys.

-- A key lives until its bucket is full again and every lease expired, plus a second, and never
-- more than two of the longest periods (2 x 366 days; sync.lua bounds the debt).
local MAX_TTL_MS = 2 * 366 * 86400000

-- The math the scripts do per key, as locals: a global function costs two table reads a call.
local math_min, math_max, math_floor, math_ceil = math.min, math.max, math.floor, math.ceil

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

-- A flat HGETALL reply (field, value, field, value...) as a table of field -> value.
local function hash_fields(flat)
  local fields = {}
  for i = 1, #flat, 2 do
    fields[flat[i]] = flat[i + 1]
  end
  return fields
end

-- The hash of one key: the flat HGETALL reply (its fields in the order Redis gave them) and the
-- same as a table of field -> value.
local function load_hash(key)
  local flat = redis.call('HGETALL', key)
  return flat, hash_fields(flat)
end

-- The unexpired leases on one key (a loaded hash) of every proxy but `except` (nil: of every
-- proxy), at `now` (us), kept in four fields per proxy q: g:q (its grant), x:q (the grant's
-- expiry, us), d:q (its demand, tokens/s), s:q (its last sync, us), as sync_window.lua writes
-- them and sync.lua did before (a proxy with a p:q field, see load_leases, is left to it). Returns:
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
      if q ~= except and fields['p:' .. q] == nil then
        if expiry > now then
          local g = tonumber(fields['g:' .. q]) or 0
          reserved = reserved + g
          local d = tonumber(fields['d:' .. q]) or 0
          local s = tonumber(fields['s:' .. q]) or now
          unreported = unreported + math_min(g, d * (now - s) / 1000000)
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

-- A token bucket's lease of proxy q and its last round are one field, l:q: seven doubles packed
-- little-endian (struct '<ddddddd', 56 bytes): its grant, the grant's expiry (us), its demand
-- (tokens/s), its last sync (us), and the epoch, counter and time written (us) of the last
-- round applied on the key (see round_is_new; 0 0 0 for a proxy that sends no rounds). Packed,
-- it is read back exactly and at the cost of one call, not a pattern match and four tonumber per
-- proxy on every key a sync touches. (Earlier versions of sync.lua kept the lease as text, p:q =
-- "g x d s", and the round beside it, r:q = "e c w", and before that the lease in four fields
-- g:q, x:q, d:q, s:q: load_leases and `leases` read them all.)
local LEASE_PACKING = '<ddddddd'
local LEASE_BYTES = 56

local function lease_pack(grant, expiry, demand, last_sync, epoch, counter, written)
  return struct.pack(LEASE_PACKING, grant, expiry, demand, last_sync, epoch, counter, written)
end

-- The numbers of an l:q field: grant, expiry, demand, last sync, epoch, counter, written (nil
-- for a malformed one: struct.unpack would raise an error on a short string).
local function lease_unpack(value)
  if #value ~= LEASE_BYTES then
    return nil
  end
  local g, x, d, s, e, c, w = struct.unpack(LEASE_PACKING, value)
  return g, x, d, s, e, c, w
end

-- The numbers of a p:q field: grant, expiry, demand, last sync (nil for a malformed one).
local function lease_numbers(text)
  local g, x, d, s = string.match(text, '^(%S+) (%S+) (%S+) (%S+)$')
  return tonumber(g), tonumber(x), tonumber(d), tonumber(s)
end

-- The hash of a token bucket's key and its leases, in one pass over its HGETALL reply, picking
-- the fields a script needs rather than building a table of them all: the l:q fields (see
-- lease_pack), and the p:q and r:q fields and the four-field leases of earlier versions too (a
-- key written before, or by a replica not yet upgraded). Returns:
--   flat: the HGETALL reply (field, value, field, value...; see hash_fields);
--   tokens, ts: the stored bucket's fields (strings; nil on a new key; see stored_bucket);
--   mine: the l:q field of `except` (the proxy syncing), nil if it has none;
--   mine_text, my_round: its p:q and r:q fields (earlier versions), nil if it has none;
--   reserved: the sum of the grants of the unexpired leases of every proxy but `except`;
--   unreported: an estimate of what they spent from them since their last sync and have not
--     reported yet: each one's demand (tokens/s) over that time, at most its grant;
--   demand: the sum of their demands;
--   lease_end: when the last of them expires (us), `now` if none;
--   older: whether the hash holds a lease in the four-field layout;
--   debts: the debtors' u:d fields (field -> value, see settle_debts), nil if it has none.
-- A proxy whose lease is in both an l:q and a p:q field (its syncs went to replicas of both
-- versions during an upgrade) is counted twice, so the leases granted meanwhile are smaller,
-- never larger; the older field goes at its next sync to an upgraded replica, or expires.
-- (The names of a proxy's fields are made once per script call, in proxy_fields.)
-- If `stale_before` and `forget_before` are given, the fields of the other proxies whose lease
-- expired at or before `stale_before` and whose round was written at or before `forget_before`
-- (kept for the report window, longer than the lease) are deleted.
local proxy_fields = {}
local function load_leases(key, now, except, stale_before, forget_before)
  local flat = redis.call('HGETALL', key)
  local tokens, ts, mine, mine_text, my_round = nil, nil, nil, nil, nil
  local reserved, unreported, demand, lease_end = 0, 0, 0, now
  local older = false
  local debts = nil
  local except_l, except_p, except_r = nil, nil, nil
  if except ~= nil then
    local names = proxy_fields[except]
    if names == nil then
      names = {'l:' .. except, 'p:' .. except, 'r:' .. except}
      proxy_fields[except] = names
    end
    except_l, except_p, except_r = names[1], names[2], names[3]
  end
  for i = 1, #flat, 2 do
    local field = flat[i]
    -- 'l:' (108, 58), 'p:' (112, 58), 'r:' (114, 58) and 'x:' (120, 58), by bytes: no
    -- substring is made
    local b1, b2 = string.byte(field, 1, 2)
    local g, expiry, d, s, written = nil, nil, nil, nil, nil
    if b2 == 58 and b1 == 108 then
      if field == except_l then
        mine = flat[i + 1]
      else
        local _
        g, expiry, d, s, _, _, written = lease_unpack(flat[i + 1])
        expiry = expiry or 0
      end
    elseif b2 == 58 and b1 == 112 then
      if field == except_p then
        mine_text = flat[i + 1]
      else
        g, expiry, d, s = lease_numbers(flat[i + 1])
        expiry = expiry or 0
        written = 0
      end
    elseif b2 == 58 and b1 == 114 then
      if field == except_r then
        my_round = flat[i + 1]
      elseif forget_before ~= nil then
        local written_round = tonumber(string.match(flat[i + 1], '^%d+ %d+ (%d+)$'))
        if written_round == nil or written_round <= forget_before then
          redis.call('HDEL', key, field)
        end
      end
    elseif b2 == 58 and b1 == 120 then
      older = true
    elseif b2 == 58 and b1 == 117 then
      -- 'u:' (117, 58): a debtor's unleased debt (see settle_debts)
      debts = debts or {}
      debts[field] = flat[i + 1]
    elseif field == 'tokens' then
      tokens = flat[i + 1]
    elseif field == 'ts' then
      ts = flat[i + 1]
    end
    if expiry ~= nil then
      if expiry > now then
        g = g or 0
        d = d or 0
        s = s or now
        reserved = reserved + g
        unreported = unreported + math_min(g, d * (now - s) / 1000000)
        demand = demand + d
        if expiry > lease_end then
          lease_end = expiry
        end
      elseif stale_before ~= nil and forget_before ~= nil and expiry <= stale_before
        and (written or 0) <= forget_before then
        -- with any field an earlier version left for the same proxy
        local q = string.sub(field, 3)
        redis.call('HDEL', key, field, 'g:' .. q, 'x:' .. q, 'w:' .. q, 'd:' .. q, 's:' .. q)
      end
    end
  end
  if older then
    local r, u, d, e = leases(key, flat, hash_fields(flat), now, except, stale_before)
    reserved, unreported, demand = reserved + r, unreported + u, demand + d
    if e > lease_end then
      lease_end = e
    end
  end
  return flat, tokens, ts, mine, mine_text, my_round, reserved, unreported, demand, lease_end,
    older, debts
end

-- Whether a report labeled with round (epoch, counter) is newer than the round (e, c) last
-- applied (nil, or 0 0: none): see round_is_new.
local function round_is_newer(e, c, epoch, counter)
  if (epoch == 0 and counter == 0) or e == nil or c == nil or (e == 0 and c == 0) then
    return true
  end
  return e ~= epoch or counter > c
end

-- Whether a proxy's report labeled with its round (epoch, counter: the two halves of the
-- entry's `round`, each below 2^32, so exact as Lua numbers) is new on a key whose r:q field is
-- `stored` ("<epoch> <counter> <written, us>" of the last report applied there, nil if none): the same epoch
-- and a higher counter, or another epoch (the proxy started its rounds over). A report without
-- a label (0 0, from an older proxy) is always new. One that is not new was applied before (a
-- batch resent after its answer was lost): the scripts then count nothing and answer the grant.
-- r:q outlives the proxy's lease fields: it is deleted once it is older than the report window
-- (the longest one report may cover; `load_leases` and `forget_rounds`), or with the key.
local function round_is_new(stored, epoch, counter)
  if stored == nil then
    return true
  end
  local e, c = string.match(stored, '^(%d+) (%d+)')
  return round_is_newer(tonumber(e), tonumber(c), epoch, counter)
end

-- The numbers of an r:q field: epoch, counter, written (nil for a malformed one).
local function round_numbers(text)
  local e, c, w = string.match(text, '^(%d+) (%d+) (%d+)$')
  return tonumber(e), tonumber(c), tonumber(w)
end

-- The r:q text of a round applied at `now` (us).
local function round_text(epoch, counter, now)
  return string.format('%d %d %d', epoch, counter, now)
end

-- Deletes the last rounds (r:q) of every proxy but `except` written at or before `forget_before`
-- (us), from a loaded hash (the flat HGETALL reply), as `load_leases` does for token buckets.
local function forget_rounds(key, flat, except, forget_before)
  local except_r = 'r:' .. except
  for i = 1, #flat, 2 do
    local field = flat[i]
    local b1, b2 = string.byte(field, 1, 2)
    if b2 == 58 and b1 == 114 and field ~= except_r then
      local written = tonumber(string.match(flat[i + 1], '^%d+ %d+ (%d+)$'))
      if written == nil or written <= forget_before then
        redis.call('HDEL', key, field)
      end
    end
  end
end

-- Unleased debt. A proxy's report counts what it spent since its last sync: from the lease the
-- service granted it then (its grant, at most) and beyond it from its fallback (no lease, one
-- that expired, the service unreachable), or from nothing at all (a made-up report): the service
-- cannot tell those two apart, so it counts the whole (the count stays honest) and keeps the part
-- beyond the lease apart, per debtor (the proxy's credential; its proxy id under one shared
-- token, see counter-service/src/sync_handler.rs), in the limit key's hash: u:<debtor>, at most
-- MAX_DEBTORS of them (the debt of any further debtor goes to u:*, one more). A penalty starts
-- only from the count as the service sees it without the largest debtor's unleased debt: what it
-- leased, what strict checks spent, and the others' claims; so one debtor's claims never start
-- a penalty alone, and every lease and strict check still does. The refill repays a debt first:
-- it weighs until the limit's rate (requests per period) has made up for it, and never once the
-- bucket is full again, so an honest proxy's fallback holds the key's penalty back at most for
-- the time the limit takes to refill what the fallback admitted beyond its lease.
-- A token bucket's u:d is a number of tokens, never more than the bucket is below its burst (see
-- settle_debts). A window's is text, "<window> <current> <previous> <at>" (window_debts): the
-- window it was counted in (a fixed window's start, a sliding one's number), the debt counted in
-- it and, for a sliding window, in the window before (never more than the window's own counts),
-- and when it was last repaid (us).
local MAX_DEBTORS = 16

-- The field a debtor's debt is kept in, among the loaded `debts` (field -> value, nil: none):
-- its own, or u:* once MAX_DEBTORS others have one.
local function debt_field(debts, debtor)
  local field = 'u:' .. debtor
  if debts == nil or debts[field] ~= nil then
    return field
  end
  local count = 0
  for _ in pairs(debts) do
    count = count + 1
  end
  if count >= MAX_DEBTORS then
    return 'u:*'
  end
  return field
end

-- A bucket's debts (the loaded u:d fields, nil: none) once `paid` tokens were refilled since they
-- were last settled (the refill repays them first), the bucket refilled to `refilled` tokens
-- and then debited to `tokens`, `added` more (the part of the debit beyond the lease) owed by
-- `debtor` (nil: none): each debt less `paid`, cut to what the refilled bucket is below its burst
-- (without the debit it would be full), the debtor's own then to what the debited one is below
-- it; written back where it changed (deleted at 0). Returns the largest debt.
local function settle_debts(key, debts, paid, refilled, tokens, burst, debtor, added)
  local field = nil
  if debtor ~= nil and added > 0 then
    field = debt_field(debts, debtor)
  end
  if debts == nil and field == nil then
    return 0
  end
  local largest = 0
  local cap = math_max(0, burst - refilled)
  local room = math_max(0, burst - tokens)
  local found = false
  for name, value in pairs(debts or {}) do
    local was = tonumber(value) or 0
    local owed = math_min(was - paid, cap)
    if name == field then
      owed = math_min(owed + added, room)
      found = true
    end
    if owed <= 0 then
      redis.call('HDEL', key, name)
    elseif owed ~= was then
      redis.call('HSET', key, name, owed)
    end
    largest = math_max(largest, owed)
  end
  if field ~= nil and not found then
    local owed = math_min(added, room)
    if owed > 0 then
      redis.call('HSET', key, field, owed)
      largest = math_max(largest, owed)
    end
  end
  return largest
end

-- The stored bucket (the hash's tokens and ts fields, as load_leases returns them), or, for a
-- new key, a full one (`burst`) stamped `born` (us).
local function stored_bucket(tokens, ts, burst, born)
  tokens = tonumber(tokens)
  ts = tonumber(ts)
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
    return math_min(cap, tokens + (now - ts) * requests / (period_ms * 1000)), now
  end
  return tokens, ts
end

-- How long (ms, whole, at least 0) the refill takes to bring `tokens` up to `burst`.
local function ms_to_full(tokens, requests, period_ms, burst)
  return math_max(0, math_ceil((burst - tokens) * period_ms / requests))
end

-- Lets a key expire once its bucket would be full again (`full_ms`) and its leases expired
-- (`lease_ms`), plus a second, and never later than MAX_TTL_MS.
local function expire_key(key, full_ms, lease_ms)
  redis.call('PEXPIRE', key, math_min(full_ms + lease_ms + 1000, MAX_TTL_MS))
end

-- The `remaining` of a reply: whole tokens, never below 0 (0 if there is no limit; Redis would
-- truncate a fraction anyway).
local function whole_remaining(remaining)
  remaining = math_floor(remaining or 0)
  if remaining < 0 then
    remaining = 0
  end
  return remaining
end

-- A rule's `penalty` keeps a key denied for a while once it went over. An entry's penalty has
-- its own key (counter-service/src/keys.rs: its first limit's key and `:penalty`, same hash tag),
-- given after the entry's limit keys when the entry carries a penalty (penalty_ms > 0, the ARGV
-- after its limits): a hash of `from` (when the key went over, us) and `until` (from + the
-- penalty of the proxy that started it, us), expiring with it. Each script honours it until
-- min(until, from + its own entry's penalty): a proxy whose rule has a longer penalty cannot
-- lengthen another's. It is started only where a script sees the key over its limit itself.

-- The end (us) of the penalty at `key` for an entry whose penalty is `penalty_us` (0: none).
local function penalty_end(key, penalty_us)
  local stored = redis.call('HMGET', key, 'from', 'until')
  local from, till = tonumber(stored[1]), tonumber(stored[2])
  if from == nil or till == nil then
    return 0
  end
  return math_min(till, from + penalty_us)
end

-- Starts a penalty of `penalty_us` at `now` (us) at `key`; returns its end (us).
local function penalty_start(key, now, penalty_us)
  local till = now + penalty_us
  redis.call('HSET', key, 'from', now, 'until', till)
  redis.call('PEXPIRE', key, math_ceil(penalty_us / 1000) + 1000)
  return till
end

-- The penalty of a strict check's entry, before it is decided (`key`: its penalty key, the one
-- after its limit keys; `penalty_ms`: the ARGV after its limits, nil or 0 for none): the answer
-- of a key in its penalty ({0, 0, wait, wait}, wait the milliseconds left, as core's
-- `penalized`), nil if it is not; and the entry's penalty (us, 0 if none) and its key, for
-- penalty_after.
local function penalty_before(key, penalty_ms, now)
  local penalty_us = (tonumber(penalty_ms) or 0) * 1000
  if penalty_us <= 0 or key == nil then
    return nil, 0, nil
  end
  local ends = penalty_end(key, penalty_us)
  if ends > now then
    local wait = math_ceil((ends - now) / 1000)
    return {0, 0, wait, wait}, penalty_us, key
  end
  return nil, penalty_us, key
end

-- A strict check's answer ({allowed, remaining, retry_after_ms, reset_ms}) once decided: a
-- denial starts the entry's penalty, and waits for it (as core's `judge`), if `over`: the check
-- would be denied without the largest debtor's unleased debt too (see settle_debts).
local function penalty_after(answer, over, penalty_us, key, now)
  if answer[1] == 0 and over and penalty_us > 0 and key ~= nil then
    penalty_start(key, now, penalty_us)
    local penalty_ms = math_ceil(penalty_us / 1000)
    answer[3] = math_max(answer[3], penalty_ms)
    answer[4] = math_max(answer[4], penalty_ms)
  end
  return answer
end

-- A proxy's demand on an entry (per second: spent + denied) and what it wants for 1.25
-- intervals: over the time since its last sync (an early one too), or one interval for the
-- first. Demand rises at once and falls slowly: a proxy whose traffic jumps is not starved while
-- an average catches up, and one whose traffic stops releases its lease over a few syncs.
local function proxy_demand(last_sync, previous, now, interval_us, interval_ms, spent, denied)
  local since = interval_us
  if last_sync ~= nil then
    since = math_max(now - last_sync, 1000)
  end
  local rate = (spent + denied) * 1000000 / since
  local demand = rate
  if last_sync ~= nil and previous ~= nil then
    demand = math_max(rate, 0.5 * previous + 0.5 * rate)
  end
  return demand, math_ceil(demand * interval_ms / 1000 * 1.25) + 1
end

local DAY_US = 86400000000

-- Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm), for dates from
-- 1970 on, as core/src/window.rs.
local function days_from_civil(year, month, day)
  if month <= 2 then
    year = year - 1
  end
  local era = math_floor(year / 400)
  local yoe = year - era * 400
  local mp = (month + 9) % 12
  local doy = math_floor((153 * mp + 2) / 5) + day - 1
  local doe = yoe * 365 + math_floor(yoe / 4) - math_floor(yoe / 100) + doy
  return math_max(era * 146097 + doe - 719468, 0)
end

-- The date of a day since 1970-01-01: year, month 1..12, day 1..31.
local function civil_from_days(days)
  local z = days + 719468
  local era = math_floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math_floor((doe - math_floor(doe / 1460) + math_floor(doe / 36524)
    - math_floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math_floor(yoe / 4) - math_floor(yoe / 100))
  local mp = math_floor((5 * doy + 2) / 153)
  local day = doy - math_floor((153 * mp + 2) / 5) + 1
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

-- The start and the end (exclusive) of the window that holds `now` (us). `window` is fixed
-- (`length` us long, aligned to the Unix epoch, so to the UTC clock), week (from Monday 00:00
-- UTC) or month (from the 1st 00:00 UTC). math.fmod is exact on doubles: the times stay whole
-- microseconds.
local function window_bounds(window, length, now)
  local days = (now - math.fmod(now, DAY_US)) / DAY_US
  if window == 'week' then
    -- Day 0 was a Thursday: Monday is 3 days later in the week's count.
    local since_monday = (days + 3) % 7
    local start = math_max(days - since_monday, 0) * DAY_US
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

-- The stored counts of window `w` (a table: window, one of fixed, week, month, sliding; length,
-- us) at `now`, from its loaded hash `fields`, set in `w` (a new window starts empty):
--   every window: start, finish (its bounds, us) and weighted (what it counts now);
--   fixed, week, month: count (n, when the stored start w is this window's);
--   sliding: previous and current (p, c, rolled to the window of `now` by its number w),
--     number (the window's since the epoch), elapsed (us into it), and weighted =
--     previous x (1 - elapsed / length) + current.
local function window_state(w, fields, now)
  if w.window == 'sliding' then
    local was = tonumber(fields['w'])
    w.elapsed = math.fmod(now, w.length)
    w.start = now - w.elapsed
    w.finish = w.start + w.length
    w.number = w.start / w.length
    w.previous, w.current = 0, 0
    if was == w.number then
      w.previous, w.current = tonumber(fields['p']) or 0, tonumber(fields['c']) or 0
    elseif was == w.number - 1 then
      w.previous = tonumber(fields['c']) or 0
    end
    w.weighted = w.previous * (1 - w.elapsed / w.length) + w.current
  else
    w.start, w.finish = window_bounds(w.window, w.length, now)
    w.count = 0
    if tonumber(fields['w']) == w.start then
      w.count = tonumber(fields['n']) or 0
    end
    w.weighted = w.count
  end
end

-- A window's debts (see settle_debts) from its loaded hash (the flat HGETALL reply), for window
-- `w` after window_state (at `now`, us) and the report counted, `added` more of the count (the
-- part of the report beyond the lease) owed by `debtor` (nil: none): each rolled to the window
-- of `now` (a fixed window's debt ends with it; a sliding window's current one becomes the
-- previous one), repaid at the limit's rate (requests per period) since it was last (within
-- this window), cut to the window's counts, and written back (deleted at 0). Returns the
-- largest debt as the window weighs it now.
local function window_debts(key, flat, w, now, debtor, added)
  local sliding = w.window == 'sliding'
  local id = w.start
  local counted = w.count
  if sliding then
    id, counted = w.number, w.current
  end
  local debts = nil
  for i = 1, #flat, 2 do
    local b1, b2 = string.byte(flat[i], 1, 2)
    if b2 == 58 and b1 == 117 then
      debts = debts or {}
      debts[flat[i]] = flat[i + 1]
    end
  end
  local field = nil
  if debtor ~= nil and added > 0 then
    field = debt_field(debts, debtor)
  end
  if debts == nil and field == nil then
    return 0
  end
  local largest = 0
  local found = false
  local function settle(name, was, current, previous, paid)
    local rest = math_max(paid - current, 0)
    current = math_max(current - paid, 0)
    previous = math_max(previous - rest, 0)
    if name == field then
      current = current + added
      found = true
    end
    current = math_min(current, counted)
    previous = math_min(previous, w.previous or 0)
    if current <= 0 and previous <= 0 then
      if was ~= nil then
        redis.call('HDEL', key, name)
      end
    else
      redis.call('HSET', key, name, string.format('%d %.17g %.17g %d', id, current, previous, now))
    end
    local weighed = current
    if sliding then
      weighed = previous * (1 - w.elapsed / w.length) + current
    end
    largest = math_max(largest, weighed)
  end
  local rate = w.requests / w.length
  for name, value in pairs(debts or {}) do
    local at, current, previous, since = string.match(value, '^(%S+) (%S+) (%S+) (%S+)$')
    at, current, previous = tonumber(at), tonumber(current) or 0, tonumber(previous) or 0
    since = tonumber(since) or now
    if at ~= id then
      if sliding and at == id - 1 then
        current, previous = 0, current
      else
        current, previous = 0, 0
      end
      since = math_max(since, w.start)
    end
    settle(name, value, current, previous, math_max(now - since, 0) * rate)
  end
  if field ~= nil and not found then
    settle(field, nil, 0, 0, 0)
  end
  return largest
end

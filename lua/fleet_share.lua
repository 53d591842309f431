-- fleet_share.lua: records that one proxy divides its fallbacks among the fleet and answers how
-- many such proxies synced recently: what a fleet-share fallback divides its limits by. Two keys
-- in one Redis Cluster hash slot (the {fleet} tag), so one call on one node.
--
-- KEYS: [1] the fleet's members, sluice:fleet:{fleet}:share: a sorted set of proxy ids (as the
--       service keeps them, namespaced by their credential), each scored by when it goes stale
--       (ms, Redis TIME);
--       [2] this credential's members, sluice:fleet:{fleet}:share:<credential>: the same, for
--       the proxy ids of one credential only.
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), proxy id,
--       window_ms, max_proxies, max_window_ms.
--       window_ms is how long this sync counts: the service decides it (max(1 s, 3 x the
--       interval it answered), at most its --fleet-report-max-age-ms = max_window_ms), never the
--       proxy. max_proxies is how many proxy ids one credential may count under
--       (--fleet-max-proxies-per-credential).
-- Returns: {proxies, recorded}:
--   proxies: how many proxy ids are counted now, this one's included when recorded;
--   recorded: 1 if this proxy is counted, 0 if its credential already had max_proxies other
--     ids counted.
--
-- A member counts while its score is ahead of the clock, and no further ahead than
-- max_window_ms (a score further ahead, written before a failover to a node whose clock is
-- behind, is dropped). Each call first drops what is stale from both sets, so each holds only
-- members that count: the answer is exact at the call, and its cost grows with what it drops,
-- not with the fleet (ZCARD is O(1), ZREMRANGEBYSCORE O(log n + dropped)).
--
-- A credential counts at most max_proxies ids. When it has that many, a sync under an id not yet
-- counted is not recorded (the call still answers the count) rather than its oldest evicted:
-- whoever syncs under many ids fills its own credential only, and the ids of another credential
-- are always recorded. An id already counted always renews its own entry. So one credential adds
-- at most max_proxies to the count, and cannot take anything from it. Each key expires when its
-- freshest member would be stale, so a fleet that stops syncing leaves nothing behind.
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock,
-- math_max and math_floor.

local fleet_key = KEYS[1]
local mine_key = KEYS[2]
local now_ms = math_floor(clock(ARGV[1]) / 1000)
local proxy = ARGV[2]
local window_ms = math_max(1, math_floor(tonumber(ARGV[3]) or 1))
local max_proxies = tonumber(ARGV[4]) or 0
local max_window_ms = math_max(window_ms, math_floor(tonumber(ARGV[5]) or 0))
local until_ms = now_ms + window_ms

-- 1. what no longer counts: stale, or from a clock a whole window ahead
for _, key in ipairs({fleet_key, mine_key}) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms)
  redis.call('ZREMRANGEBYSCORE', key, '(' .. (now_ms + max_window_ms), '+inf')
end

-- 2. this proxy, if it is counted already or its credential has room
local recorded = 0
if redis.call('ZSCORE', mine_key, proxy) or redis.call('ZCARD', mine_key) < max_proxies then
  recorded = 1
  redis.call('ZADD', mine_key, until_ms, proxy)
  redis.call('ZADD', fleet_key, until_ms, proxy)
  for _, key in ipairs({fleet_key, mine_key}) do
    if redis.call('PTTL', key) < window_ms then
      redis.call('PEXPIRE', key, window_ms)
    end
  end
end

-- 3. the count
return {redis.call('ZCARD', fleet_key), recorded}

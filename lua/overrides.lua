-- overrides.lua: the live overrides operators set through the service's admin API: reads them
-- (every sync, and the admin API's GET), sets one, or deletes one. Every key is under the one
-- hash tag {overrides}, so on a Redis Cluster the whole set lives on one node and changes in
-- one atomic call.
--
-- KEYS: 1 version: a string, the version of the set (absent: 0);
--       2 bypass: a string, "1" (every proxy admits everything) or "0" (absent: not set);
--       3 limits: a hash, target ("rule" or "rule/tier") -> the limits' JSON array;
--       4 keys: a hash, rule U+001F the key's parts joined by U+001F -> "block" or "allow";
--       5 meta: a hash, entry -> "set_at_ms expires_at_ms json" (expires_at_ms 0: never; the
--         json says who set it and why);
--       6 expiry: a sorted set, entry -> expires_at_ms, of the entries set with a ttl;
--       7 audit: a list of JSON entries, newest first, capped.
--       An entry is named "bypass", "limits" U+001F target, or "keys" U+001F its keys field.
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), audit_cap, op,
--       then per op:
--   read: cached_version, proxy_version, with_meta ("1": also answer the meta hash);
--   set: kind ("bypass", "limits" or "keys"), field (unused for bypass), value, ttl_ms (0: no
--        expiry), meta json, max_entries (most entries of the kind; 0: no bound), audit json;
--   delete: kind, field, audit json.
--   An audit json is an object without its opening brace ("who":…,"action":…}): the script
--   puts at_ms and the version in front.
-- Returns: {version, expired, ...}: the version after the call (a string), and the entries it
--   found expired and removed; then per op:
--   read: bypass (the bypass value, "" if not set), fresh, limits, keys, meta: fresh is 0 and
--     the three lists empty when the version is cached_version or proxy_version (the caller has
--     the set, or needs none); else 1 and the flat HGETALL replies (meta empty unless with_meta);
--   set: done (1; 0 when a new entry would exceed max_entries: nothing is set), set_at_ms,
--     expires_at_ms (0: no expiry);
--   delete: done (1; 0 when there was no such entry).
--
-- Expiry: every call first removes the entries whose expires_at_ms is at or before now, so an
-- expired entry is never answered. Every change, an expiry included, increments the version in
-- the same call (a reader never sees a new set with an old version), and is appended to the
-- audit list, capped at audit_cap entries; an expiry is recorded as done by "(ttl)", a name no
-- credential can have. The version starts from the clock in milliseconds the first time (when
-- the key is absent), so a Redis that lost its data never hands out again a version a proxy
-- already holds.
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock.

local now_ms = math.floor(clock(ARGV[1]) / 1000)
local audit_cap = tonumber(ARGV[2])
local op = ARGV[3]
local SEP = '\31'
local VERSION, BYPASS, LIMITS, KEYS_HASH = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local META, EXPIRY, AUDIT = KEYS[5], KEYS[6], KEYS[7]

-- An integer as JSON and Redis take it (never in exponent notation).
local function int(n)
  return string.format('%d', n)
end

local function hash_of(kind)
  if kind == 'limits' then
    return LIMITS
  end
  return KEYS_HASH
end

local function entry_name(kind, field)
  if kind == 'bypass' then
    return 'bypass'
  end
  return kind .. SEP .. field
end

local function exists(kind, field)
  if kind == 'bypass' then
    return redis.call('EXISTS', BYPASS) == 1
  end
  return redis.call('HEXISTS', hash_of(kind), field) == 1
end

local function remove(kind, field)
  if kind == 'bypass' then
    redis.call('DEL', BYPASS)
  else
    redis.call('HDEL', hash_of(kind), field)
  end
  local name = entry_name(kind, field)
  redis.call('HDEL', META, name)
  redis.call('ZREM', EXPIRY, name)
end

-- The parts of a string split at every U+001F.
local function split(text)
  local parts = {}
  for part in string.gmatch(text .. SEP, '([^' .. SEP .. ']*)' .. SEP) do
    parts[#parts + 1] = part
  end
  return parts
end

-- The audit entries of this call, oldest first (without at_ms and version).
local changes = {}

-- 1. the expired entries are removed
local expired = redis.call('ZRANGEBYSCORE', EXPIRY, '-inf', int(now_ms))
for _, name in ipairs(expired) do
  local kind, field = string.match(name, '^([^' .. SEP .. ']+)' .. SEP .. '(.*)$')
  if kind == nil then
    kind, field = name, ''
  end
  remove(kind, field)
  local target, value = 'bypass', 'null'
  if kind == 'limits' then
    target = field
  elseif kind == 'keys' then
    local parts = split(field)
    target = table.remove(parts, 1)
    value = '{"key":' .. cjson.encode(parts) .. '}'
  end
  local action = 'expire ' .. kind
  if kind == 'keys' then
    action = 'expire key'
  end
  changes[#changes + 1] = '"who":"(ttl)","action":"' .. action .. '","target":' ..
    cjson.encode(target) .. ',"value":' .. value .. '}'
end

-- The version after this call: incremented once if anything changed, with the audit entries.
local function finish()
  if #changes == 0 then
    return redis.call('GET', VERSION) or '0'
  end
  if redis.call('EXISTS', VERSION) == 0 then
    redis.call('SET', VERSION, int(now_ms))
  end
  local version = int(redis.call('INCR', VERSION))
  for _, change in ipairs(changes) do
    redis.call('LPUSH', AUDIT, '{"at_ms":' .. int(now_ms) .. ',"version":' .. version .. ',' ..
      change)
  end
  redis.call('LTRIM', AUDIT, 0, audit_cap - 1)
  return version
end

-- 2. the operation
if op == 'read' then
  local version = finish()
  local bypass = redis.call('GET', BYPASS) or ''
  if version == ARGV[4] or version == ARGV[5] then
    return {version, expired, bypass, 0, {}, {}, {}}
  end
  local meta = {}
  if ARGV[6] == '1' then
    meta = redis.call('HGETALL', META)
  end
  return {version, expired, bypass, 1, redis.call('HGETALL', LIMITS),
    redis.call('HGETALL', KEYS_HASH), meta}
elseif op == 'set' then
  local kind, field, value = ARGV[4], ARGV[5], ARGV[6]
  local ttl_ms, meta, max_entries = tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
  if kind ~= 'bypass' and max_entries > 0 and not exists(kind, field)
      and redis.call('HLEN', hash_of(kind)) >= max_entries then
    return {finish(), expired, 0, 0, 0}
  end
  if kind == 'bypass' then
    redis.call('SET', BYPASS, value)
  else
    redis.call('HSET', hash_of(kind), field, value)
  end
  local name = entry_name(kind, field)
  local expires_at_ms = 0
  if ttl_ms > 0 then
    expires_at_ms = now_ms + ttl_ms
    redis.call('ZADD', EXPIRY, int(expires_at_ms), name)
  else
    redis.call('ZREM', EXPIRY, name)
  end
  redis.call('HSET', META, name, int(now_ms) .. ' ' .. int(expires_at_ms) .. ' ' .. meta)
  changes[#changes + 1] = ARGV[10]
  return {finish(), expired, 1, now_ms, expires_at_ms}
elseif op == 'delete' then
  local kind, field = ARGV[4], ARGV[5]
  if not exists(kind, field) then
    return {finish(), expired, 0}
  end
  remove(kind, field)
  changes[#changes + 1] = ARGV[6]
  return {finish(), expired, 1}
end
return redis.error_reply('overrides.lua: unknown op ' .. tostring(op))

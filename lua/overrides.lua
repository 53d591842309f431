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
--       7 audit: a list of JSON entries, newest first, capped;
--       8 log: the change log, a list, newest first: "version entry", one per entry of the set
--         (limits or keys) a call changed, the version being the one after that call;
--       9 sizes: a hash: set_bytes (the set's size, see below; counted from the hashes when
--         absent), log_bytes (the log's), log_from (the log holds every change after this
--         version: a proxy at log_from or later can be answered a delta), key_limits (how many
--         limits entries are a key's own limits, their target "key:..."; absent: 0).
--       An entry is named "bypass", "limits" U+001F target, or "keys" U+001F its keys field.
-- ARGV: now_override_us (0 = Redis TIME, the one clock; non-zero only in tests), audit_cap,
--       max_set_bytes (most bytes of the set), max_entry_bytes (most bytes of one entry),
--       log_cap (most entries of the log), log_max_bytes (most bytes of the log), op, then per
--       op:
--   read: cached_version, proxy_version, with_meta ("1": also answer the meta hash), delta
--         ("1": the proxy takes deltas);
--   set: kind ("bypass", "limits" or "keys"), field (unused for bypass), value, ttl_ms (0: no
--        expiry), meta json, max_entries (most entries of the kind; 0: no bound; a key's own
--        limits, "key:..." in limits, are bounded apart from the other limits), audit json;
--   delete: kind, field, audit json.
--   An audit json is an object without its opening brace ("who":…,"action":…}): the script
--   puts at_ms and the version in front.
-- Returns: {version, expired, ...}: the version after the call (a string), and the entries it
--   found expired and removed; then per op:
--   read: bypass (the bypass value, "" if not set), answer, limits, keys, more, set_bytes,
--     log_from ("" if none):
--     answer 0: nothing (the version is proxy_version, or cached_version and no delta is
--       answered): the three lists empty;
--     answer 1: the whole set: the flat HGETALL replies of limits and keys, and more the meta
--       hash's (empty unless with_meta);
--     answer 2: a delta from proxy_version (answered when delta is "1", proxy_version is neither
--       0 nor the version, the log holds every change since it, and the delta is not larger
--       than the set, or 1 KiB): limits and keys the entries changed since then, as they are now (flat
--       field, value), more the names of those removed;
--     then expires: flat (keys field, expires_at_ms) of the key entries answered (the whole
--       set's, or those the delta sets) that expire (empty when nothing is answered);
--   set: done, set_at_ms, expires_at_ms (0: no expiry), bytes: done 1; 0 when a new entry would
--     exceed max_entries; -1 when the entry takes more than max_entry_bytes (bytes: its size);
--     -2 when the set would take more than max_set_bytes (bytes: what it would take). Refused,
--     nothing is set;
--   delete: done (1; 0 when there was no such entry).
--
-- Sizes: an entry's size is what it adds to the set's JSON as proxies receive it: its name and
-- value JSON-escaped (cjson escapes '/' too, so this is at least what serde_json sends), a colon
-- and a comma; a key's name counts its rule too, which covers the rule's own name and braces in
-- the JSON; a key set with a ttl also counts its expiry as proxies receive it (its name again and
-- the time, expiry_bytes). The set's size is the sum over its entries; a set (a new entry, or a larger value)
-- that would take it past max_set_bytes is refused, a smaller one is always taken.
--
-- Expiry: every call first removes the entries whose expires_at_ms is at or before now, so an
-- expired entry is never answered. Every change, an expiry included, increments the version in
-- the same call (a reader never sees a new set with an old version), is appended to the
-- audit list, capped at audit_cap entries, and (a change of the set) to the log, trimmed from its
-- oldest end to log_cap entries and log_max_bytes; an expiry is recorded as done by "(ttl)", a
-- name no credential can have. The version starts from the clock in milliseconds the first time
-- (when the key is absent), so a Redis that lost its data never hands out again a version a
-- proxy already holds.
-- Runs after lua/prelude.lua (the service loads the two as one script) and uses its clock.

local now_ms = math.floor(clock(ARGV[1]) / 1000)
local audit_cap = tonumber(ARGV[2])
local max_set_bytes, max_entry_bytes = tonumber(ARGV[3]), tonumber(ARGV[4])
local log_cap, log_max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6])
local op = ARGV[7]
local SEP = '\31'
local VERSION, BYPASS, LIMITS, KEYS_HASH = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local META, EXPIRY, AUDIT, LOG, SIZES = KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]

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

-- The kind and field of an entry's name.
local function parse_name(name)
  local kind, field = string.match(name, '^([^' .. SEP .. ']+)' .. SEP .. '(.*)$')
  if kind == nil then
    return name, ''
  end
  return kind, field
end

-- What an entry adds to the set's JSON (see Sizes above); the bypass is not in the set.
local function entry_bytes(kind, field, value)
  if kind == 'limits' then
    return #cjson.encode(field) + #value + 2
  elseif kind == 'keys' then
    return #cjson.encode(field) + #value + 4
  end
  return 0
end

-- What a key entry's expiry adds to the set's JSON: its name again, its time (counted as 16
-- digits), a colon and a comma.
local function expiry_bytes(kind, field)
  if kind == 'keys' then
    return #cjson.encode(field) + 18
  end
  return 0
end

-- Whether a limits entry is a key's own limits (target "key:RULE..."), counted apart.
local function keyed(kind, field)
  return kind == 'limits' and string.sub(field, 1, 4) == 'key:'
end

local function keyed_count()
  return tonumber(redis.call('HGET', SIZES, 'key_limits')) or 0
end

-- How many entries of the kind `field` is one of there are (a key's own limits apart).
local function held(kind, field)
  if keyed(kind, field) then
    return keyed_count()
  elseif kind == 'limits' then
    return redis.call('HLEN', LIMITS) - keyed_count()
  end
  return redis.call('HLEN', hash_of(kind))
end

-- Whether the entry named `name` expires.
local function expires(name)
  return redis.call('ZSCORE', EXPIRY, name) ~= false
end

-- The set's size, read (or counted from the hashes) once per call, before any change.
local set_bytes = nil
local function set_size()
  if set_bytes == nil then
    set_bytes = tonumber(redis.call('HGET', SIZES, 'set_bytes'))
    if set_bytes == nil then
      set_bytes = 0
      for _, kind in ipairs({'limits', 'keys'}) do
        local flat = redis.call('HGETALL', hash_of(kind))
        for i = 1, #flat, 2 do
          set_bytes = set_bytes + entry_bytes(kind, flat[i], flat[i + 1])
          if kind == 'keys' and expires(entry_name(kind, flat[i])) then
            set_bytes = set_bytes + expiry_bytes(kind, flat[i])
          end
        end
      end
      if set_bytes > 0 then
        -- kept, so later calls do not count again (an empty set is counted at no cost)
        redis.call('HSET', SIZES, 'set_bytes', int(set_bytes))
      end
    end
  end
  return set_bytes
end

-- Called before a change of the set by `by` bytes.
local function resize(by)
  set_bytes = set_size() + by
  redis.call('HSET', SIZES, 'set_bytes', int(set_bytes))
end

-- The names of the entries of the set this call changed, for the log.
local changed = {}

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
    local old = redis.call('HGET', hash_of(kind), field)
    if old then
      local bytes = entry_bytes(kind, field, old)
      if expires(entry_name(kind, field)) then
        bytes = bytes + expiry_bytes(kind, field)
      end
      resize(-bytes)
      if keyed(kind, field) then
        redis.call('HINCRBY', SIZES, 'key_limits', -1)
      end
    end
    redis.call('HDEL', hash_of(kind), field)
    changed[#changed + 1] = entry_name(kind, field)
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
  local kind, field = parse_name(name)
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

-- Appends this call's changes of the set to the log under `version`, and trims it.
local function log_changes(version)
  if #changed == 0 then
    return
  end
  if redis.call('HEXISTS', SIZES, 'log_from') == 0 then
    -- the log starts here: it holds every change after the version before this call
    redis.call('HSET', SIZES, 'log_from', int(tonumber(version) - 1))
  end
  local log_bytes = tonumber(redis.call('HGET', SIZES, 'log_bytes')) or 0
  for _, name in ipairs(changed) do
    local item = version .. ' ' .. name
    redis.call('LPUSH', LOG, item)
    log_bytes = log_bytes + #item
  end
  local length = redis.call('LLEN', LOG)
  local from = nil
  while length > 0 and (length > log_cap or log_bytes > log_max_bytes) do
    local oldest = redis.call('RPOP', LOG)
    log_bytes = log_bytes - #oldest
    length = length - 1
    from = string.match(oldest, '^(%d+) ')
  end
  if from ~= nil then
    redis.call('HSET', SIZES, 'log_from', from)
  end
  redis.call('HSET', SIZES, 'log_bytes', int(log_bytes))
end

-- The version after this call: incremented once if anything changed, with the audit entries
-- and the log.
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
  log_changes(version)
  return version
end

-- The changes since version `since` as a delta {limits, keys, removed}, or nil when the log
-- does not hold them all or the delta would be larger than the set. Reads the log newest
-- first, a page at a time, down to `since`.
local function delta_since(since)
  local from = tonumber(redis.call('HGET', SIZES, 'log_from'))
  if from == nil or since < from then
    return nil
  end
  local seen, names = {}, {}
  local page, start, done = 64, 0, false
  while not done do
    local items = redis.call('LRANGE', LOG, start, start + page - 1)
    for _, item in ipairs(items) do
      local version, name = string.match(item, '^(%d+) (.*)$')
      if version == nil or tonumber(version) <= since then
        done = true
        break
      end
      if not seen[name] then
        seen[name] = true
        names[#names + 1] = name
      end
    end
    if #items < page then
      done = true
    end
    start = start + page
  end
  local limits, keys, removed, expiries, bytes = {}, {}, {}, {}, 0
  for _, name in ipairs(names) do
    local kind, field = parse_name(name)
    local value = redis.call('HGET', hash_of(kind), field)
    if value then
      local into = keys
      if kind == 'limits' then
        into = limits
      end
      into[#into + 1] = field
      into[#into + 1] = value
      bytes = bytes + entry_bytes(kind, field, value)
      local at = nil
      if kind == 'keys' then
        at = redis.call('ZSCORE', EXPIRY, name)
      end
      if at then
        expiries[#expiries + 1] = field
        expiries[#expiries + 1] = int(tonumber(at))
        bytes = bytes + expiry_bytes(kind, field)
      end
    else
      removed[#removed + 1] = name
      bytes = bytes + #cjson.encode(name) + 1
    end
  end
  if bytes > math.max(set_size(), 1024) then
    return nil
  end
  return {limits, keys, removed, expiries}
end

-- Every key entry that expires: flat (keys field, expires_at_ms).
local function key_expiries()
  local out = {}
  local flat = redis.call('ZRANGE', EXPIRY, 0, -1, 'WITHSCORES')
  for i = 1, #flat, 2 do
    local kind, field = parse_name(flat[i])
    if kind == 'keys' then
      out[#out + 1] = field
      out[#out + 1] = int(tonumber(flat[i + 1]))
    end
  end
  return out
end

-- 2. the operation
if op == 'read' then
  local cached, proxy, with_meta, delta = ARGV[8], ARGV[9], ARGV[10], ARGV[11]
  local version = finish()
  local bypass = redis.call('GET', BYPASS) or ''
  local log_from = redis.call('HGET', SIZES, 'log_from') or ''
  if version == proxy then
    return {version, expired, bypass, 0, {}, {}, {}, set_size(), log_from, {}}
  end
  local since = tonumber(proxy)
  if delta == '1' and since ~= nil and since > 0 and since < tonumber(version) then
    local changes_since = delta_since(since)
    if changes_since ~= nil then
      return {version, expired, bypass, 2, changes_since[1], changes_since[2], changes_since[3],
        set_size(), log_from, changes_since[4]}
    end
  end
  if version == cached then
    return {version, expired, bypass, 0, {}, {}, {}, set_size(), log_from, {}}
  end
  local meta = {}
  if with_meta == '1' then
    meta = redis.call('HGETALL', META)
  end
  return {version, expired, bypass, 1, redis.call('HGETALL', LIMITS),
    redis.call('HGETALL', KEYS_HASH), meta, set_size(), log_from, key_expiries()}
elseif op == 'set' then
  local kind, field, value = ARGV[8], ARGV[9], ARGV[10]
  local ttl_ms, meta, max_entries = tonumber(ARGV[11]), ARGV[12], tonumber(ARGV[13])
  if kind == 'bypass' then
    redis.call('SET', BYPASS, value)
  else
    local bytes = entry_bytes(kind, field, value)
    if bytes > max_entry_bytes then
      return {finish(), expired, -1, 0, 0, bytes}
    end
    local old = redis.call('HGET', hash_of(kind), field)
    if not old and max_entries > 0 and held(kind, field) >= max_entries then
      return {finish(), expired, 0, 0, 0, 0}
    end
    local old_bytes = 0
    if old then
      old_bytes = entry_bytes(kind, field, old)
      if expires(entry_name(kind, field)) then
        old_bytes = old_bytes + expiry_bytes(kind, field)
      end
    end
    if ttl_ms > 0 then
      bytes = bytes + expiry_bytes(kind, field)
    end
    local total = set_size() - old_bytes + bytes
    if bytes > old_bytes and total > max_set_bytes then
      return {finish(), expired, -2, 0, 0, total}
    end
    resize(bytes - old_bytes)
    if not old and keyed(kind, field) then
      redis.call('HINCRBY', SIZES, 'key_limits', 1)
    end
    redis.call('HSET', hash_of(kind), field, value)
    changed[#changed + 1] = entry_name(kind, field)
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
  changes[#changes + 1] = ARGV[14]
  return {finish(), expired, 1, now_ms, expires_at_ms, 0}
elseif op == 'delete' then
  local kind, field = ARGV[8], ARGV[9]
  if not exists(kind, field) then
    return {finish(), expired, 0}
  end
  remove(kind, field)
  changes[#changes + 1] = ARGV[10]
  return {finish(), expired, 1}
end
return redis.error_reply('overrides.lua: unknown op ' .. tostring(op))

//! The Lua scripts of `lua/`, compiled in and run by SHA (`redis::Script` sends `EVALSHA` and
//! loads the script on `NOSCRIPT`, so a restarted or new Redis node is served too).
//!
//! `check.lua` and `sync.lua` share their clock, hash and lease load, refill and expiry through
//! `lua/prelude.lua` (`fleet.lua` its clock and hash load; `fleet_share.lua` its clock; `window.lua` and `sync_window.lua` its
//! clock, hash load, lease scan, windows and expiry; `sliding_log.lua` and `overrides.lua` its clock; `keys.lua` its clock, hash and lease reads, refill and windows): each script the service runs is the
//! prelude's text followed by the script's own, joined here at compile time. The SHA is the one of that combined text, and a `NOSCRIPT`
//! reload sends that same text, on one Redis and on every node of a cluster alike.

use redis::Script;

/// The text every service script starts with: `lua/prelude.lua`.
pub const PRELUDE_LUA: &str = include_str!("../../lua/prelude.lua");
/// `lua/sync.lua` alone, without the prelude (it does not run so).
pub const SYNC_BODY_LUA: &str = include_str!("../../lua/sync.lua");
/// `lua/check.lua` alone, without the prelude (it does not run so).
pub const CHECK_BODY_LUA: &str = include_str!("../../lua/check.lua");
/// `lua/fleet.lua` alone, without the prelude (it does not run so).
pub const FLEET_BODY_LUA: &str = include_str!("../../lua/fleet.lua");
/// `lua/fleet_share.lua` alone, without the prelude (it does not run so).
pub const FLEET_SHARE_BODY_LUA: &str = include_str!("../../lua/fleet_share.lua");
/// `lua/window.lua` alone, without the prelude (it does not run so).
pub const WINDOW_BODY_LUA: &str = include_str!("../../lua/window.lua");
/// `lua/sliding_log.lua` alone, without the prelude (it does not run so).
pub const SLIDING_LOG_BODY_LUA: &str = include_str!("../../lua/sliding_log.lua");
/// `lua/sync_window.lua` alone, without the prelude (it does not run so).
pub const SYNC_WINDOW_BODY_LUA: &str = include_str!("../../lua/sync_window.lua");
/// `lua/overrides.lua` alone, without the prelude (it does not run so).
pub const OVERRIDES_BODY_LUA: &str = include_str!("../../lua/overrides.lua");
/// `lua/keys.lua` alone, without the prelude (it does not run so).
pub const KEYS_BODY_LUA: &str = include_str!("../../lua/keys.lua");

/// The script of one proxy's batch, one call per hash slot: the prelude, then `lua/sync.lua`.
pub const SYNC_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/sync.lua")
);
/// The script of the window entries (`fixed_window`, `sliding_window`) of one proxy's batch, one
/// call per hash slot: the prelude, then `lua/sync_window.lua`.
pub const SYNC_WINDOW_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/sync_window.lua")
);
/// The script of one strict decision: the prelude, then `lua/check.lua`.
pub const CHECK_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/check.lua")
);
/// The script of one strict decision on windows (`fixed_window`, `sliding_window`): the
/// prelude, then `lua/window.lua`.
pub const WINDOW_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/window.lua")
);
/// The script of one strict decision on sliding logs: the prelude, then `lua/sliding_log.lua`.
pub const SLIDING_LOG_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/sliding_log.lua")
);
/// The script of one load report and the fleet's level: the prelude, then `lua/fleet.lua`.
pub const FLEET_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/fleet.lua")
);
/// The script that counts the proxies dividing their fallbacks among the fleet: the prelude,
/// then `lua/fleet_share.lua`.
pub const FLEET_SHARE_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/fleet_share.lua")
);
/// The script of the live overrides (read, set, delete): the prelude, then `lua/overrides.lua`.
pub const OVERRIDES_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/overrides.lua")
);
/// The script of the admin API's one key (its state, its reset): the prelude, then
/// `lua/keys.lua`.
pub const KEYS_LUA: &str = concat!(
    include_str!("../../lua/prelude.lua"),
    "\n",
    include_str!("../../lua/keys.lua")
);
/// `lua/token_bucket.lua`: the per-request baseline for benchmarks (not used by the service; it
/// stands alone, without the prelude, as `redis-benchmark` loads it).
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");

/// The scripts the service runs, hashed once.
pub struct Scripts {
    pub sync: Script,
    pub sync_window: Script,
    pub check: Script,
    pub fleet: Script,
    pub fleet_share: Script,
    pub window: Script,
    pub sliding_log: Script,
    pub overrides: Script,
    pub keys: Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        Scripts {
            sync: Script::new(SYNC_LUA),
            sync_window: Script::new(SYNC_WINDOW_LUA),
            check: Script::new(CHECK_LUA),
            fleet: Script::new(FLEET_LUA),
            fleet_share: Script::new(FLEET_SHARE_LUA),
            window: Script::new(WINDOW_LUA),
            sliding_log: Script::new(SLIDING_LOG_LUA),
            overrides: Script::new(OVERRIDES_LUA),
            keys: Script::new(KEYS_LUA),
        }
    }
}

impl Default for Scripts {
    fn default() -> Scripts {
        Scripts::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts that run after the prelude, without it.
    const BODIES: [(&str, &str); 9] = [
        ("sync.lua", SYNC_BODY_LUA),
        ("sync_window.lua", SYNC_WINDOW_BODY_LUA),
        ("check.lua", CHECK_BODY_LUA),
        ("fleet.lua", FLEET_BODY_LUA),
        ("fleet_share.lua", FLEET_SHARE_BODY_LUA),
        ("window.lua", WINDOW_BODY_LUA),
        ("sliding_log.lua", SLIDING_LOG_BODY_LUA),
        ("overrides.lua", OVERRIDES_BODY_LUA),
        ("keys.lua", KEYS_BODY_LUA),
    ];

    /// The names the prelude defines at its top level (`local function f`, `local NAME = …`).
    fn prelude_names() -> Vec<&'static str> {
        PRELUDE_LUA
            .lines()
            .filter(|line| line.starts_with("local "))
            .flat_map(declared)
            .collect()
    }

    /// The local names one line of Lua declares: `local function f(…)` gives `f`,
    /// `local a, b = …` gives `a` and `b`; any other line none.
    fn declared(line: &str) -> Vec<&str> {
        let Some(rest) = line.trim_start().strip_prefix("local ") else {
            return Vec::new();
        };
        if let Some(function) = rest.strip_prefix("function ") {
            return function.split('(').take(1).map(str::trim).collect();
        }
        let names = rest.split('=').next().unwrap_or_default();
        names
            .split(',')
            .map(str::trim)
            .filter(|name| !name.is_empty())
            .collect()
    }

    /// Whether `name` occurs in `text` as a whole identifier.
    fn has_word(text: &str, name: &str) -> bool {
        let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
        text.match_indices(name).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + name.len()..].chars().next();
            !before.is_some_and(word) && !after.is_some_and(word)
        })
    }

    /// A script's leading comment (its header) and its code without comments.
    fn header_and_code(lua: &str) -> (String, String) {
        let header: Vec<&str> = lua.lines().take_while(|l| l.starts_with("--")).collect();
        let code: Vec<&str> = lua
            .lines()
            .skip(header.len())
            .map(|line| line.split("--").next().unwrap_or_default())
            .collect();
        (header.join("\n"), code.join("\n"))
    }

    #[test]
    fn the_prelude_defines_the_shared_pieces() {
        assert_eq!(
            prelude_names(),
            [
                "MAX_TTL_MS",
                "math_min",
                "math_max",
                "math_floor",
                "math_ceil",
                "clock",
                "hash_fields",
                "load_hash",
                "leases",
                "LEASE_PACKING",
                "LEASE_BYTES",
                "lease_pack",
                "lease_unpack",
                "lease_numbers",
                "proxy_fields",
                "load_leases",
                "round_is_newer",
                "round_is_new",
                "round_numbers",
                "round_text",
                "forget_rounds",
                "MAX_DEBTORS",
                "debt_field",
                "settle_debts",
                "stored_bucket",
                "refill_bucket",
                "ms_to_full",
                "expire_key",
                "whole_remaining",
                "penalty_end",
                "penalty_start",
                "penalty_before",
                "penalty_after",
                "proxy_demand",
                "DAY_US",
                "days_from_civil",
                "civil_from_days",
                "window_bounds",
                "window_state",
                "window_debts",
            ]
        );
        // the prelude only defines: each script reads its own KEYS and ARGV
        let (_, code) = header_and_code(PRELUDE_LUA);
        assert!(!has_word(&code, "KEYS") && !has_word(&code, "ARGV"));
    }

    #[test]
    fn the_service_loads_each_script_after_the_prelude_by_the_sha_of_both() {
        assert_eq!(SYNC_LUA, format!("{PRELUDE_LUA}\n{SYNC_BODY_LUA}"));
        assert_eq!(CHECK_LUA, format!("{PRELUDE_LUA}\n{CHECK_BODY_LUA}"));
        assert_eq!(FLEET_LUA, format!("{PRELUDE_LUA}\n{FLEET_BODY_LUA}"));
        assert_eq!(WINDOW_LUA, format!("{PRELUDE_LUA}\n{WINDOW_BODY_LUA}"));
        assert_eq!(
            SYNC_WINDOW_LUA,
            format!("{PRELUDE_LUA}\n{SYNC_WINDOW_BODY_LUA}")
        );
        assert_eq!(
            OVERRIDES_LUA,
            format!("{PRELUDE_LUA}\n{OVERRIDES_BODY_LUA}")
        );
        assert_eq!(KEYS_LUA, format!("{PRELUDE_LUA}\n{KEYS_BODY_LUA}"));
        let scripts = Scripts::new();
        assert_eq!(scripts.sync.get_hash(), Script::new(SYNC_LUA).get_hash());
        assert_eq!(scripts.check.get_hash(), Script::new(CHECK_LUA).get_hash());
        assert_eq!(scripts.fleet.get_hash(), Script::new(FLEET_LUA).get_hash());
        assert_eq!(
            scripts.window.get_hash(),
            Script::new(WINDOW_LUA).get_hash()
        );
        assert_eq!(
            scripts.sync_window.get_hash(),
            Script::new(SYNC_WINDOW_LUA).get_hash()
        );
        assert_eq!(
            scripts.overrides.get_hash(),
            Script::new(OVERRIDES_LUA).get_hash()
        );
        assert_ne!(
            scripts.check.get_hash(),
            Script::new(CHECK_BODY_LUA).get_hash()
        );
    }

    /// A script that declares a prelude name again has its own copy of a shared piece, or hides
    /// it: the drift the prelude is there to prevent.
    #[test]
    fn no_script_redefines_a_prelude_name() {
        let names = prelude_names();
        for (script, body) in BODIES {
            for (number, line) in body.lines().enumerate() {
                for name in declared(line) {
                    assert!(
                        !names.contains(&name),
                        "{script}:{}: declares `{name}`, which lua/prelude.lua defines; \
                         use the prelude's",
                        number + 1
                    );
                }
            }
        }
    }

    /// Each script's header says what KEYS, ARGV and the reply are, and names the prelude
    /// functions its code uses, and only those.
    #[test]
    fn each_header_names_the_prelude_functions_its_script_uses() {
        let functions: Vec<&str> = prelude_names()
            .into_iter()
            .filter(|name| name.chars().any(|c| c.is_ascii_lowercase()))
            .collect();
        for (script, body) in BODIES {
            let (header, code) = header_and_code(body);
            assert!(header.starts_with(&format!("-- {script}:")), "{script}");
            for part in ["KEYS:", "ARGV:", "Returns:", "lua/prelude.lua"] {
                assert!(header.contains(part), "{script}: {part}");
            }
            for name in &functions {
                assert_eq!(
                    has_word(&code, name),
                    has_word(&header, name),
                    "{script}: uses `{name}` and its header names it, or neither"
                );
            }
        }
    }

    #[test]
    fn the_scan_reads_lua_declarations() {
        assert_eq!(declared("local function clock(override)"), ["clock"]);
        assert_eq!(declared("  local a, _, b = f()"), ["a", "_", "b"]);
        assert_eq!(declared("local limits = {}"), ["limits"]);
        assert_eq!(declared("local remaining"), ["remaining"]);
        assert!(declared("-- local x = 1").is_empty());
        assert!(declared("  x = 1").is_empty());
        assert!(has_word("x = clock(1)", "clock"));
        assert!(!has_word("x = clocks(1)", "clock"));
        let (header, code) = header_and_code("-- a: clock\nx = 1 -- leases\n");
        assert!(has_word(&header, "clock") && !has_word(&code, "leases"));
    }
}

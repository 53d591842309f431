//! The Lua scripts of `lua/`, compiled in and run by SHA (`redis::Script` sends `EVALSHA` and
//! loads the script on `NOSCRIPT`, so a restarted or new Redis node is served too).

use redis::Script;

/// `lua/sync.lua`: one proxy's batch, one call per hash slot.
pub const SYNC_LUA: &str = include_str!("../../lua/sync.lua");
/// `lua/check.lua`: one strict decision.
pub const CHECK_LUA: &str = include_str!("../../lua/check.lua");
/// `lua/token_bucket.lua`: the per-request baseline for benchmarks (not used by the service).
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../lua/token_bucket.lua");

/// The scripts the service runs, hashed once.
pub struct Scripts {
    pub sync: Script,
    pub check: Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        Scripts {
            sync: Script::new(SYNC_LUA),
            check: Script::new(CHECK_LUA),
        }
    }
}

impl Default for Scripts {
    fn default() -> Scripts {
        Scripts::new()
    }
}

//! The Redis key of one limit of one entry, and the Redis Cluster hash slot it lives in.
//!
//! `sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>`
//! for a token bucket, and the same followed by `/<algorithm>` for a window, and `/<calendar>`
//! for a calendar window (`…:3/86400000/3/fixed_window`, `…:9/2592000000/9/fixed_window/month`):
//! a token bucket and a window never share a key (a window's ends in a letter, a bucket's in a
//! digit). The hash tag makes every limit of one entry share a slot, so one script call covers
//! them.

use redis::cluster_routing::Slot;
use redis::ScriptInvocation;
use sluice_protocol::fnv1a;
use sluice_protocol::{AlgorithmSpec, LimitSpec};

/// The hash tag of an entry key: what Redis Cluster hashes to place it.
pub fn hash_tag(entry_key: &str) -> String {
    format!("{:016x}", fnv1a(entry_key.as_bytes()))
}

/// The Redis key of one limit of an entry.
pub fn limit_key(entry_key: &str, limit: &LimitSpec) -> String {
    let mut key = format!(
        "sluice:{{{}}}:{}:{}/{}/{}",
        hash_tag(entry_key),
        entry_key,
        limit.requests,
        limit.period_ms,
        limit.burst
    );
    if limit.algorithm.windowed() {
        key.push('/');
        key.push_str(limit.algorithm.name());
        if let Some(calendar) = limit.calendar {
            key.push('/');
            key.push_str(calendar.name());
        }
    }
    key
}

/// The Redis key of an entry's penalty (a rule's `penalty`, see `lua/prelude.lua`): its first
/// limit's key followed by `:penalty` (no limit's key ends in a letter after a colon). Named
/// after the limits as every key is: a proxy sending other limits for the same entry key keeps
/// its own counts and penalty, and cannot start a penalty on the others'.
pub fn penalty_key(entry_key: &str, limits: &[LimitSpec]) -> Option<String> {
    let first = limits.first()?;
    Some(format!("{}:penalty", limit_key(entry_key, first)))
}

/// Adds an entry's penalty to a script call, after its limits, as every deciding script reads
/// it: `penalty_ms` in ARGV (0: none), and, if not 0, the penalty's key in KEYS.
pub fn add_penalty(
    invocation: &mut ScriptInvocation<'_>,
    entry_key: &str,
    limits: &[LimitSpec],
    penalty_ms: u64,
) {
    match penalty_key(entry_key, limits) {
        Some(key) if penalty_ms > 0 => {
            invocation.key(key).arg(penalty_ms);
        }
        _ => {
            invocation.arg(0);
        }
    }
}

/// Adds an entry's limits to a script call as `check.lua` and `sync.lua` read them (token
/// buckets): per limit, its key in KEYS and `requests, period_ms, burst` in ARGV.
pub fn add_limits(invocation: &mut ScriptInvocation<'_>, entry_key: &str, limits: &[LimitSpec]) {
    for limit in limits {
        invocation
            .key(limit_key(entry_key, limit))
            .arg(limit.requests)
            .arg(limit.period_ms)
            .arg(limit.burst);
    }
}

/// Adds an entry's windows to a script call as `window.lua` and `sync_window.lua` read them: per limit, its key in
/// KEYS and `requests, period_ms, window` in ARGV, the window being how it is aligned and
/// counted: `fixed` (to the epoch), `week`, `month` (to the calendar) or `sliding`.
pub fn add_windows(invocation: &mut ScriptInvocation<'_>, entry_key: &str, limits: &[LimitSpec]) {
    for limit in limits {
        invocation
            .key(limit_key(entry_key, limit))
            .arg(limit.requests)
            .arg(limit.period_ms)
            .arg(window_kind(limit));
    }
}

/// Adds an entry's sliding logs to a script call as `sliding_log.lua` reads them: per limit,
/// its key in KEYS and `requests, period_ms` in ARGV.
pub fn add_logs(invocation: &mut ScriptInvocation<'_>, entry_key: &str, limits: &[LimitSpec]) {
    for limit in limits {
        invocation
            .key(limit_key(entry_key, limit))
            .arg(limit.requests)
            .arg(limit.period_ms);
    }
}

/// How `window.lua` counts a window: `fixed`, `week`, `month` or `sliding`.
pub fn window_kind(limit: &LimitSpec) -> &'static str {
    match (limit.algorithm, limit.calendar) {
        (AlgorithmSpec::SlidingWindow, _) => "sliding",
        (_, Some(calendar)) => calendar.name(),
        _ => "fixed",
    }
}

/// The hash slot of every key of an entry.
pub fn slot(entry_key: &str) -> Slot {
    Slot::for_key(format!("{{{}}}", hash_tag(entry_key)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_names_the_entry_and_the_limit() {
        let limit = LimitSpec::token_bucket(10, 1000, 20);
        let key = limit_key("api:1.2.3.4", &limit);
        assert_eq!(
            key,
            format!(
                "sluice:{{{}}}:api:1.2.3.4:10/1000/20",
                hash_tag("api:1.2.3.4")
            )
        );
        assert_eq!(hash_tag("").len(), 16);
        assert_eq!(
            Slot::for_key(&key),
            slot("api:1.2.3.4"),
            "the hash tag decides the slot"
        );
    }

    #[test]
    fn a_window_never_shares_a_key_with_a_bucket() {
        use sluice_protocol::Calendar;
        let tag = hash_tag("r:k");
        let bucket = LimitSpec::token_bucket(3, 86_400_000, 3);
        let fixed = LimitSpec::window(AlgorithmSpec::FixedWindow, 3, 86_400_000);
        let sliding = LimitSpec::window(AlgorithmSpec::SlidingWindow, 3, 86_400_000);
        let monthly = LimitSpec::calendar(3, Calendar::Month);
        let keys = [bucket, fixed, sliding, monthly].map(|l| limit_key("r:k", &l));
        assert_eq!(
            keys,
            [
                format!("sluice:{{{tag}}}:r:k:3/86400000/3"),
                format!("sluice:{{{tag}}}:r:k:3/86400000/3/fixed_window"),
                format!("sluice:{{{tag}}}:r:k:3/86400000/3/sliding_window"),
                format!("sluice:{{{tag}}}:r:k:3/2592000000/3/fixed_window/month"),
            ]
        );
        assert_eq!(
            [
                fixed,
                sliding,
                monthly,
                LimitSpec::calendar(3, Calendar::Week)
            ]
            .map(|l| window_kind(&l)),
            ["fixed", "sliding", "month", "week"]
        );
    }
}

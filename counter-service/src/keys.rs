//! The Redis key of one limit of one entry, and the Redis Cluster hash slot it lives in.
//!
//! `sluice:{<16 hex of FNV-1a-64 of the entry key>}:<entry key>:<requests>/<period_ms>/<burst>`:
//! the hash tag makes every limit of one entry share a slot, so one script call covers them.

use redis::cluster_routing::Slot;
use redis::ScriptInvocation;
use sluice_protocol::fnv1a;
use sluice_protocol::LimitSpec;

/// The hash tag of an entry key: what Redis Cluster hashes to place it.
pub fn hash_tag(entry_key: &str) -> String {
    format!("{:016x}", fnv1a(entry_key.as_bytes()))
}

/// The Redis key of one limit of an entry.
pub fn limit_key(entry_key: &str, limit: &LimitSpec) -> String {
    format!(
        "sluice:{{{}}}:{}:{}/{}/{}",
        hash_tag(entry_key),
        entry_key,
        limit.requests,
        limit.period_ms,
        limit.burst
    )
}

/// Adds an entry's limits to a script call as both scripts read them: per limit, its key in
/// KEYS and `requests, period_ms, burst` in ARGV.
pub fn add_limits(invocation: &mut ScriptInvocation<'_>, entry_key: &str, limits: &[LimitSpec]) {
    for limit in limits {
        invocation
            .key(limit_key(entry_key, limit))
            .arg(limit.requests)
            .arg(limit.period_ms)
            .arg(limit.burst);
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
        let limit = LimitSpec {
            requests: 10,
            period_ms: 1000,
            burst: 20,
        };
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
}

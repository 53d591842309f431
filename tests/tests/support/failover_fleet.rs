//! What the two failover suites under load share (`failover.rs`: a Redis Cluster primary killed;
//! `sentinel.rs`: a Sentinel primary): the proxies' rules, how an Envoy is started on the service,
//! and the Redis key of the cached rule's bucket for a user.

use serde_json::json;
use sluice_core::protocol::{fnv1a, KEY_PART_SEPARATOR};
use sluice_tests::envoy::{Envoy, EnvoyOptions, Template};
use sluice_tests::service::Service;

/// The filter's callout timeout (`service.timeout_ms`).
pub const TIMEOUT_MS: u64 = 200;
/// The sync interval (`service.sync_interval_ms`).
pub const INTERVAL_MS: u64 = 100;
/// The cached rule: 20/s, burst 20, per user; its fallback 40/s, burst 20: more generous than the
/// global limit on purpose, so that what the fallback admits while the service cannot answer exceeds
/// what the global bucket would have, and an undebited fallback shows in the count.
pub const RATE: f64 = 20.0;
pub const BURST: f64 = 20.0;
pub const FALLBACK_RATE: f64 = 40.0;
pub const FALLBACK_BURST: f64 = 20.0;

/// sluice with a cached rule per user (`x-user` on `/api/`) and a strict one (`/strict/`: 100/s,
/// its fallback 5/s).
pub fn plugin_config(token: &str) -> String {
    json!({
        "headers": "both",
        "service": {
            "cluster": "sluice_service",
            "authority": "sluice_service",
            "token": token,
            "timeout_ms": TIMEOUT_MS,
            "sync_interval_ms": INTERVAL_MS,
            "breaker_failures": 3,
            "breaker_cooldown_ms": 1000,
        },
        "rules": [
            {"name": "users", "match": {"path_prefix": "/api/"}, "key": ["header:x-user"],
             "consistency": "cached",
             "limits": [{"requests": RATE as u64, "per": "second", "burst": BURST as u64}],
             "fallback": {"policy": "fail_open",
                          "limits": [{"requests": FALLBACK_RATE as u64, "per": "second", "burst": FALLBACK_BURST as u64}]}},
            {"name": "strict", "match": {"path_prefix": "/strict/"}, "key": ["header:x-user"],
             "consistency": "strict",
             "limits": [{"requests": 100, "per": "second", "burst": 100}],
             "fallback": {"policy": "fail_open", "limits": [{"requests": 5, "per": "second", "burst": 5}]}},
        ],
    })
    .to_string()
}

/// An Envoy (two workers) with [`plugin_config`], its cluster `sluice_service` pointing at `service`.
pub fn start_envoy(service: &Service) -> Envoy {
    let port = service.address().expect("the service listens").port();
    Envoy::start(EnvoyOptions {
        template: Template::SluiceService,
        plugin_config_json: plugin_config(service.token()),
        concurrency: 2,
        placeholders: vec![("SERVICE_PORT".to_owned(), port.to_string())],
    })
    .unwrap()
}

/// The slot-deciding part of every Redis key of an entry (`counter-service/src/keys.rs`): `{<tag>}`.
pub fn hash_tag(entry_key: &str) -> String {
    format!("{{{:016x}}}", fnv1a(entry_key.as_bytes()))
}

/// The entry key the filter syncs for `rule` and one key part.
pub fn entry_key(rule: &str, part: &str) -> String {
    format!("{rule}{KEY_PART_SEPARATOR}{part}")
}

/// The Redis key of the cached rule's bucket for `user` (one limit: 20 per 1000 ms, burst 20).
pub fn bucket_key(user: &str) -> String {
    let entry = entry_key("users", user);
    format!("sluice:{}:{entry}:20/1000/20", hash_tag(&entry))
}

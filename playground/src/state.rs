//! A read-only view of one key's limits: what is left now, without spending or writing
//! anything. Reads the rule's key table in the store the way the limiter does.

use serde::Serialize;
use sluice_core::limit::Algorithm;
use sluice_core::limiter::bucket_limits;
use sluice_core::policy::RuleId;
use sluice_core::store::Store;
use sluice_core::Limiter;

/// One limit of one key at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LimitView {
    /// Requests (of cost 1) that would be admitted now.
    pub remaining: u64,
    /// A token bucket's tokens, with their fraction; `None` for the other algorithms.
    pub tokens: Option<f64>,
}

/// The state of each limit `rule` keeps for `key` at `now_us` (a key never seen: fresh).
/// Empty when the rule keeps no local state (a fail-closed rule away from its service).
pub fn view(
    limiter: &Limiter,
    rule: RuleId,
    key: &str,
    now_us: u64,
    store: &mut dyn Store,
) -> Vec<LimitView> {
    let Some(enforced) = limiter.rule(rule) else {
        return Vec::new();
    };
    let limits = bucket_limits(enforced.rule);
    let table = enforced.table;
    let fingerprint = table.fingerprint(key);
    let set = store
        .get(&table.set_key(fingerprint))
        .ok()
        .flatten()
        .map(|(bytes, _)| bytes)
        .unwrap_or_default();
    let mut record = table.find_or_fresh(&set, fingerprint, limits, now_us);
    record
        .states(limits)
        .map(|(limit, mut state)| {
            let tokens = (limit.algorithm() == Algorithm::TokenBucket)
                .then(|| state.bucket.refilled(limit, now_us).tokens);
            LimitView {
                remaining: state.check(limit, now_us, 0).remaining,
                tokens,
            }
        })
        .collect()
}

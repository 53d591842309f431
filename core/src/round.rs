//! One sync round, proxy side, as pure steps over the store: compose the batch from the keys
//! waiting, settle the service's answer (leases, refused entries, hints, the breaker), or undo
//! a batch that did not get through. The filter sends and receives; everything else is here.

use crate::limiter::Limiter;
use crate::pending::{entry_bytes, Pending, MAX_BATCH_BYTES, MAX_BATCH_KEYS};
use crate::policy::RuleId;
use crate::policy::Service;
use crate::protocol::{SyncRequest, SyncResponse};
use crate::proxy_sync;
use crate::store::Store;

/// A batch to send, and which rule each entry's key belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub rules: Vec<RuleId>,
    pub request: SyncRequest,
}

/// How an answer was settled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    /// Entries the service refused alone (their counts are dropped), and the first reason.
    pub refused: usize,
    pub reason: Option<String>,
}

/// Why an answer could not be settled: the batch must be undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mismatch;

/// Takes as many waiting keys as fit in one batch, by count and by bytes, and snapshots their
/// counts (resetting them in the records). The rest stay in `waiting`. With shedding and a
/// fleet level, the proxy's load goes with it. `None` when there is nothing to report.
pub fn compose(
    limiter: &Limiter,
    waiting: &mut Pending,
    proxy: &str,
    interval_ms: u64,
    store: &mut dyn Store,
) -> Option<Batch> {
    let load = limiter
        .policy()
        .shedding
        .as_ref()
        .filter(|s| s.fleet)
        .map(|s| crate::shed::load_report(s, store));
    let mut entries = Vec::new();
    let mut rules = Vec::new();
    let mut bytes = 0;
    while entries.len() < MAX_BATCH_KEYS {
        let Some((rule, key)) = waiting.pop() else {
            break;
        };
        let limits = limiter.rule(rule).map_or(0, |r| r.rule.limits.len());
        let size = entry_bytes(&key, limits);
        if bytes + size > MAX_BATCH_BYTES && !entries.is_empty() {
            // Back to the front would be fairer, but the next round takes it first anyway:
            // the waiting set is oldest first and this key is now its newest.
            let _ = waiting.push(rule, key);
            break;
        }
        if let Some(entry) = proxy_sync::snapshot(limiter, rule, &key, store) {
            bytes += size;
            entries.push(entry);
            rules.push(rule);
        }
    }
    // A round goes out every interval, keys or not: its answer carries the fleet's level, the
    // emergency bypass and the live overrides.
    Some(Batch {
        rules,
        request: SyncRequest {
            proxy: proxy.to_string(),
            interval_ms,
            entries,
            load,
            overrides_version: proxy_sync::read_state(store).overrides_version,
        },
    })
}

/// The service answered a batch: install its leases (a refused entry's counts are dropped:
/// sending them again would be refused again), close the breaker, release the round and keep
/// its hints.
pub fn settle(
    limiter: &Limiter,
    batch: &Batch,
    response: &SyncResponse,
    now_us: u64,
    store: &mut dyn Store,
) -> Result<Settled, Mismatch> {
    if response.grants.len() != batch.request.entries.len() {
        return Err(Mismatch);
    }
    let mut settled = Settled::default();
    let entries = batch.rules.iter().zip(&batch.request.entries);
    for ((rule, entry), grant) in entries.zip(&response.grants) {
        if let Some(reason) = &grant.refused {
            settled.refused += 1;
            settled.reason.get_or_insert_with(|| reason.clone());
            continue;
        }
        let _ = proxy_sync::apply_lease(limiter, *rule, &entry.key, grant, now_us, store);
    }
    let hints = &response.hints;
    if let Some(live) = &hints.overrides.live {
        // The set first, then its version: a worker that sees the version finds the set.
        let _ = crate::store::update(store, crate::overrides::OVERRIDES_KEY, |bytes| {
            *bytes = crate::overrides::encode(live);
            ((), true)
        });
    }
    let _ = proxy_sync::update_state(store, |s| {
        s.breaker.succeeded();
        s.busy_until_us = 0;
        s.interval_ms = hints.next_sync_ms;
        s.bypass = hints.overrides.bypass;
        s.fleet = proxy_sync::Fleet::heard(hints.overrides.load_level, now_us);
        if let Some(live) = &hints.overrides.live {
            s.overrides_version = live.version;
        }
    });
    Ok(settled)
}

/// A batch that did not get through (not sent, failed, refused as a whole, or answered with
/// something else): its counts go back into the records, the breaker counts a failure and the
/// round is released. Returns the keys to announce again (those no request announced since).
pub fn undo(
    limiter: &Limiter,
    batch: &Batch,
    service: &Service,
    now_us: u64,
    jitter: f64,
    store: &mut dyn Store,
) -> Vec<(RuleId, String)> {
    let mut announce = Vec::new();
    for (rule, entry) in batch.rules.iter().zip(&batch.request.entries) {
        if let Ok(true) = proxy_sync::restore(limiter, *rule, entry, store) {
            announce.push((*rule, entry.key.clone()));
        }
    }
    let _ = proxy_sync::update_state(store, |s| {
        s.busy_until_us = 0;
        s.breaker.failed(
            service.breaker_failures,
            now_us,
            service.breaker_cooldown_ms.saturating_mul(1_000),
            jitter,
        );
    });
    announce
}

//! One sync round, proxy side, as pure steps over the store: compose the batch from the keys
//! waiting, settle the service's answer (leases, refused entries, hints, the breaker), undo
//! a batch that did not get through, or keep a batch in doubt. The filter sends and receives;
//! everything else is here.
//!
//! Exactly once. Every entry carries the round it was first sent in
//! ([`crate::protocol::SyncEntry::round`]); the service applies a proxy's entry on a key only if
//! its round is newer than the last one it applied there. A batch that surely did not reach the
//! service (not sent, refused as a whole with a 4xx) is undone: its counts go back into the
//! records and leave again with the next round's label. A batch that may have been applied
//! (a timeout, a reset, a 5xx, an answer that does not fit) is in doubt: its entries are kept
//! as they were sent, labels and all, in [`IN_DOUBT_KEY`], and every following batch carries
//! them first until one is answered; the service counts the ones it applied before as nothing.
//! A key in doubt sends no newer counts meanwhile (they wait in its record), so a batch never
//! holds one key twice. The list is at most one batch, by count and by bytes: the batch that
//! carries it holds it first and fills the rest.

use crate::limiter::Limiter;
use crate::pending::{entry_bytes, Pending, MAX_BATCH_BYTES, MAX_BATCH_KEYS};
use crate::policy::RuleId;
use crate::policy::Service;
use crate::protocol::{SyncEntry, SyncRequest, SyncResponse};
use crate::proxy_sync;
use crate::store::Store;

/// Shared-data key of the entries in doubt: the last batch whose answer was lost, as sent.
pub const IN_DOUBT_KEY: &str = "sluice/in-doubt";

/// A batch to send, and which rule each entry's key belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub rules: Vec<RuleId>,
    pub request: SyncRequest,
    /// The first `replayed` entries are the ones in doubt, resent with their labels.
    pub replayed: usize,
}

/// The entries in doubt and their rules (none if the list is missing or unreadable).
pub fn in_doubt(store: &mut dyn Store) -> Vec<(RuleId, SyncEntry)> {
    let Ok(Some((bytes, _))) = store.get(IN_DOUBT_KEY) else {
        return Vec::new();
    };
    serde_json::from_slice::<Vec<(usize, SyncEntry)>>(&bytes)
        .map(|list| {
            list.into_iter()
                .map(|(rule, entry)| (RuleId::new(rule), entry))
                .collect()
        })
        .unwrap_or_default()
}

/// Replaces the entries in doubt (an empty list clears them).
fn keep_in_doubt(store: &mut dyn Store, entries: &[(RuleId, &SyncEntry)]) {
    let _ = crate::store::update(store, IN_DOUBT_KEY, |bytes| {
        if entries.is_empty() {
            let changed = !bytes.is_empty();
            bytes.clear();
            return ((), changed);
        }
        let list: Vec<(usize, &SyncEntry)> = entries
            .iter()
            .map(|(rule, entry)| (rule.index(), *entry))
            .collect();
        *bytes = serde_json::to_vec(&list).unwrap_or_default();
        ((), true)
    });
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

/// Takes the entries in doubt first, as they were sent, then as many waiting keys as fit in
/// one batch, by count and by bytes, and snapshots their counts (resetting them in the records)
/// under the label of the round last claimed. The rest stay in `waiting`, and so do keys in
/// doubt (their newer counts go once the doubt is settled). With shedding and a fleet level,
/// the proxy's load goes with it. `None` when there is nothing to report.
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
    let state = proxy_sync::read_state(store);
    let label = state.round_label();
    let mut entries = Vec::new();
    let mut rules = Vec::new();
    let mut bytes = 0;
    let doubts = in_doubt(store);
    let replayed = doubts.len();
    let mut doubted = std::collections::HashSet::new();
    for (rule, entry) in doubts {
        bytes += entry_bytes(&entry.key, entry.limits.len());
        doubted.insert((rule, entry.key.clone()));
        entries.push(entry);
        rules.push(rule);
    }
    let mut deferred = Vec::new();
    while entries.len() < MAX_BATCH_KEYS {
        let Some((rule, key)) = waiting.pop() else {
            break;
        };
        if doubted.contains(&(rule, key.clone())) {
            deferred.push((rule, key));
            continue;
        }
        let limits = limiter.rule(rule).map_or(0, |r| r.rule.limits.len());
        let size = entry_bytes(&key, limits);
        if bytes + size > MAX_BATCH_BYTES && !entries.is_empty() {
            // Back to the front would be fairer, but the next round takes it first anyway:
            // the waiting set is oldest first and this key is now its newest.
            let _ = waiting.push(rule, key);
            break;
        }
        if let Some(mut entry) = proxy_sync::snapshot(limiter, rule, &key, store) {
            entry.round = label;
            bytes += size;
            entries.push(entry);
            rules.push(rule);
        }
    }
    for (rule, key) in deferred {
        let _ = waiting.push(rule, key);
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
            overrides_version: state.overrides_version,
        },
        replayed,
    })
}

/// The service answered a batch: install its leases (a refused entry's counts are dropped:
/// sending them again would be refused again), settle the entries in doubt it carried, close
/// the breaker, release the round and keep its hints.
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
    if batch.replayed > 0 {
        keep_in_doubt(store, &[]);
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

/// A batch that surely did not get through (not sent, refused as a whole): its counts go back
/// into the records (the entries in doubt it carried stay in doubt), the breaker counts a
/// failure and the round is released. Returns the keys to announce again (those no request
/// announced since).
pub fn undo(
    limiter: &Limiter,
    batch: &Batch,
    service: &Service,
    now_us: u64,
    jitter: f64,
    store: &mut dyn Store,
) -> Vec<(RuleId, String)> {
    let mut announce = Vec::new();
    let entries = batch.rules.iter().zip(&batch.request.entries);
    for (rule, entry) in entries.skip(batch.replayed) {
        if let Ok(true) = proxy_sync::restore(limiter, *rule, entry, store) {
            announce.push((*rule, entry.key.clone()));
        }
    }
    failed(service, now_us, jitter, store);
    announce
}

/// A batch that may have been applied (timed out, reset, a 5xx, an answer that does not fit):
/// its entries, as sent, become the entries in doubt, resent first by every following batch
/// until one is answered; the breaker counts a failure and the round is released.
pub fn doubt(batch: &Batch, service: &Service, now_us: u64, jitter: f64, store: &mut dyn Store) {
    let entries: Vec<(RuleId, &SyncEntry)> = batch
        .rules
        .iter()
        .copied()
        .zip(&batch.request.entries)
        .collect();
    keep_in_doubt(store, &entries);
    failed(service, now_us, jitter, store);
}

fn failed(service: &Service, now_us: u64, jitter: f64, store: &mut dyn Store) {
    let _ = proxy_sync::update_state(store, |s| {
        s.busy_until_us = 0;
        s.breaker.failed(
            service.breaker_failures,
            now_us,
            service.breaker_cooldown_ms.saturating_mul(1_000),
            jitter,
        );
    });
}

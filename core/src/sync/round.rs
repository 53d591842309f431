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
//! holds one key twice. The list is one batch, by count and by bytes: the batch that carries it
//! holds it first and fills the rest. An answer settles only the entries its batch carried, and a
//! batch in doubt joins the list rather than replacing it, so rounds that overlap (an answer
//! later than the next round's claim) lose nothing; the list may then hold more than a batch
//! for a while, and the next batches take it in turn. It never holds more than
//! [`MAX_IN_DOUBT_KEYS`] entries or [`MAX_IN_DOUBT_BYTES`]: a batch in doubt that would go past
//! either is undone instead for the entries that do not fit (their counts go back into the
//! records, to leave again under a newer label: counted twice if that batch was applied after
//! all, never lost).

use crate::limiter::Limiter;
use crate::policy::RuleId;
use crate::policy::Service;
use crate::protocol::{LimitSpec, SyncEntry, SyncRequest, SyncResponse};
use crate::store::Store;
use crate::sync::outbox::{entry_bytes, Pending, MAX_BATCH_BYTES, MAX_BATCH_KEYS};
use crate::sync::proxy;

/// Shared-data key of the entries in doubt: the last batch whose answer was lost, as sent.
pub const IN_DOUBT_KEY: &str = "sluice/in-doubt";

/// At most this many entries are kept in doubt (four batches).
pub const MAX_IN_DOUBT_KEYS: usize = 4 * MAX_BATCH_KEYS;

/// At most this many bytes of entries, as [`entry_bytes`] counts them, are kept in doubt.
pub const MAX_IN_DOUBT_BYTES: usize = 4 * MAX_BATCH_BYTES;

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

/// Changes the entries in doubt atomically (an empty list is stored as nothing).
fn change_in_doubt(store: &mut dyn Store, mut step: impl FnMut(&mut Vec<(usize, SyncEntry)>)) {
    let _ = crate::store::update(store, IN_DOUBT_KEY, |bytes| {
        let mut list: Vec<(usize, SyncEntry)> = serde_json::from_slice(bytes).unwrap_or_default();
        step(&mut list);
        if list.is_empty() {
            let changed = !bytes.is_empty();
            bytes.clear();
            return ((), changed);
        }
        *bytes = serde_json::to_vec(&list).unwrap_or_default();
        ((), true)
    });
}

/// The same report: the same rule, key and round.
fn same(a: &(usize, SyncEntry), rule: RuleId, entry: &SyncEntry) -> bool {
    a.0 == rule.index() && a.1.round == entry.round && a.1.key == entry.key
}

/// How an answer was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// Entries the service refused alone (their counts are dropped), and the first reason.
    pub refused: usize,
    pub reason: Option<String>,
    /// What became of the live overrides the answer carried.
    pub overrides: crate::overrides::live::Taken,
}

impl Default for Settled {
    fn default() -> Settled {
        Settled {
            refused: 0,
            reason: None,
            overrides: crate::overrides::live::Taken::Nothing,
        }
    }
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
    let state = proxy::read_state(store);
    let label = state.round_label();
    let interval_us = state
        .effective_interval_ms(interval_ms)
        .saturating_mul(1_000);
    let mut entries = Vec::new();
    let mut rules = Vec::new();
    let mut bytes = 0;
    // The entries in doubt first, as many as fit (normally all: they were one batch).
    let mut doubted = std::collections::HashSet::new();
    for (rule, entry) in in_doubt(store) {
        doubted.insert((rule, entry.key.clone()));
        let size = entry_bytes(&entry.key, entry.limits.len());
        let fits = entries.len() < MAX_BATCH_KEYS && bytes + size <= MAX_BATCH_BYTES;
        if fits || entries.is_empty() {
            bytes += size;
            entries.push(entry);
            rules.push(rule);
        }
    }
    let replayed = entries.len();
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
        match proxy::take(limiter, rule, &key, state.claimed_at_us, interval_us, store) {
            proxy::Taken::Entry(mut entry) => {
                entry.round = label;
                bytes += size;
                entries.push(entry);
                rules.push(rule);
            }
            // Its report waits for a later round (starved while the global bucket is empty:
            // `proxy::may_wait`): it stays announced.
            proxy::Taken::Held => deferred.push((rule, key)),
            proxy::Taken::Nothing => {}
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
            overrides_delta: true,
            fleet_share: limiter.policy().fleet_share(),
            top: crate::top::reports(limiter, store),
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
        // A batch composed under other limits (a reload or a live override while it was in
        // flight or in doubt): a lease goes only to a rule that still has the limits it was
        // granted for, not to the key's record under the new ones.
        let granted_for = limiter.rule_for(*rule, &entry.key).is_some_and(|enforced| {
            let limits = &enforced.rule.limits;
            limits.len() == entry.limits.len()
                && limits
                    .iter()
                    .zip(&entry.limits)
                    .all(|(limit, spec)| LimitSpec::from(limit) == *spec)
        });
        if granted_for {
            let _ = proxy::apply_lease(limiter, *rule, &entry.key, grant, now_us, store);
        }
    }
    if batch.replayed > 0 {
        let carried = batch.rules.iter().zip(&batch.request.entries);
        let carried: Vec<_> = carried.take(batch.replayed).collect();
        change_in_doubt(store, |list| {
            list.retain(|doubt| !carried.iter().any(|(r, e)| same(doubt, **r, e)));
        });
    }
    let hints = &response.hints;
    // The set first, then its version: a worker that sees the version finds the set.
    let taken = crate::overrides::live::take(&hints.overrides, store);
    settled.overrides = taken.clone();
    let _ = proxy::update_state(store, |s| {
        s.breaker.succeeded();
        s.busy_until_us = 0;
        // A shorter advice than the one this round was claimed under brings the next round
        // forward to it: the proxy is back to its pace one round after the service is well.
        let configured_ms = batch.request.interval_ms;
        let claimed_us = s.effective_interval_ms(configured_ms).saturating_mul(1_000);
        s.interval_ms = hints.next_sync_ms;
        let advised_us = s.effective_interval_ms(configured_ms).saturating_mul(1_000);
        if advised_us < claimed_us {
            s.next_at_us = s.next_at_us.min(s.claimed_at_us.saturating_add(advised_us));
        }
        s.bypass = hints.overrides.bypass;
        s.fleet = proxy::Fleet::heard(hints.overrides.load_level, now_us);
        // An answer without a count (the service could not count, or is older) keeps the last.
        if let Some(proxies) = hints.overrides.fleet_proxies {
            s.fleet_proxies = proxy::fleet_proxies(proxies);
        }
        match taken {
            crate::overrides::live::Taken::Kept { version, .. } => s.overrides_version = version,
            // The next round asks for the whole set.
            crate::overrides::live::Taken::Gap { .. } => s.overrides_version = 0,
            crate::overrides::live::Taken::Nothing
            | crate::overrides::live::Taken::TooLarge { .. } => {}
        }
    });
    Ok(settled)
}

/// Why a call to the counter service gave no usable answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    NotSent,
    /// Envoy's async client timed out (504) or the call was reset (no status).
    Timeout,
    Unauthorized,
    Status,
    /// A 200 whose body is not the expected answer.
    Malformed,
}

impl Failure {
    /// Classifies a callout's `:status` (not 200).
    pub fn of(status: Option<&str>) -> Failure {
        match status {
            None | Some("504") => Failure::Timeout,
            Some("401") | Some("403") => Failure::Unauthorized,
            Some(_) => Failure::Status,
        }
    }
}

/// Whether a call that ended in `failure`, with `:status` `status`, surely was not acted on:
/// not sent, or a 4xx (refused as a whole before anything was applied). A reset or a timeout
/// (no status, 504), a 5xx or a 200 that does not parse may have been applied.
pub fn surely_not_applied(failure: Failure, status: Option<&str>) -> bool {
    failure == Failure::NotSent || status.is_some_and(|s| s.len() == 3 && s.starts_with('4'))
}

/// A batch that got no usable answer: [`undo`]ne when it surely did not get through, else kept
/// in [`doubt`]. Returns the keys to announce again.
#[allow(clippy::too_many_arguments)]
pub fn recover(
    limiter: &Limiter,
    batch: &Batch,
    service: &Service,
    failure: Failure,
    status: Option<&str>,
    now_us: u64,
    jitter: f64,
    store: &mut dyn Store,
) -> Vec<(RuleId, String)> {
    if surely_not_applied(failure, status) {
        undo(limiter, batch, service, now_us, jitter, store)
    } else {
        doubt(limiter, batch, service, now_us, jitter, store)
    }
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
    let entries = batch.rules.iter().zip(&batch.request.entries);
    let announce = put_back(limiter, entries.skip(batch.replayed), store);
    failed(service, now_us, jitter, store);
    announce
}

/// Puts entries' counts back into their records; returns the keys to announce again (those no
/// request announced since).
fn put_back<'a>(
    limiter: &Limiter,
    entries: impl Iterator<Item = (&'a RuleId, &'a SyncEntry)>,
    store: &mut dyn Store,
) -> Vec<(RuleId, String)> {
    let mut announce = Vec::new();
    for (rule, entry) in entries {
        if let Ok(true) = proxy::restore(limiter, *rule, entry, store) {
            announce.push((*rule, entry.key.clone()));
        }
    }
    announce
}

/// A batch that may have been applied (timed out, reset, a 5xx, an answer that does not fit):
/// its entries, as sent, join the entries in doubt (those it replayed are there already),
/// resent first by every following batch until one is answered; the breaker counts a failure
/// and the round is released. Entries that would take the list past [`MAX_IN_DOUBT_KEYS`] or
/// [`MAX_IN_DOUBT_BYTES`] are undone instead (counted twice if the batch was applied after all,
/// never lost); returns their keys to announce again, as [`undo`] does.
pub fn doubt(
    limiter: &Limiter,
    batch: &Batch,
    service: &Service,
    now_us: u64,
    jitter: f64,
    store: &mut dyn Store,
) -> Vec<(RuleId, String)> {
    let mut overflow = Vec::new();
    change_in_doubt(store, |list| {
        overflow.clear();
        let mut bytes: usize = list
            .iter()
            .map(|(_, e)| entry_bytes(&e.key, e.limits.len()))
            .sum();
        for (rule, entry) in batch.rules.iter().zip(&batch.request.entries) {
            if list.iter().any(|doubt| same(doubt, *rule, entry)) {
                continue;
            }
            let size = entry_bytes(&entry.key, entry.limits.len());
            if list.len() < MAX_IN_DOUBT_KEYS && bytes + size <= MAX_IN_DOUBT_BYTES {
                bytes += size;
                list.push((rule.index(), entry.clone()));
            } else {
                overflow.push((rule, entry));
            }
        }
    });
    let announce = put_back(limiter, overflow.into_iter(), store);
    failed(service, now_us, jitter, store);
    announce
}

fn failed(service: &Service, now_us: u64, jitter: f64, store: &mut dyn Store) {
    let _ = proxy::update_state(store, |s| {
        s.busy_until_us = 0;
        s.breaker.failed(
            service.breaker_failures,
            now_us,
            service.breaker_cooldown_ms.saturating_mul(1_000),
            jitter,
        );
    });
}

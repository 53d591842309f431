//! The sync, worker side: on each tick, refresh what requests need to know (breaker, bypass);
//! if this worker wins the round, gather every worker's unsynced keys and send one batch.

use std::collections::HashMap;
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;
use sluice_core::pending::{entry_bytes, MAX_BATCH_BYTES, MAX_BATCH_KEYS};
use sluice_core::policy::Service;
use sluice_core::protocol::{SyncEntry, SyncRequest, SyncResponse};
use sluice_core::sync;
use sluice_core::Limiter;

use crate::callout::{self, Failure};
use crate::host::{self, SharedData};
use crate::shared::Shared;

/// A batch on its way: which key each grant in the answer belongs to.
pub struct InFlight {
    keys: Vec<(usize, String)>,
    entries: Vec<SyncEntry>,
    sent_at_us: u64,
}

/// The worker's part in syncing.
#[derive(Default)]
pub struct Syncer {
    queue: Option<u32>,
    in_flight: HashMap<u32, InFlight>,
}

impl Syncer {
    pub fn queue(&self) -> Option<u32> {
        self.queue
    }

    /// Joins the proxy's announcement queue and starts ticking.
    pub fn start(&mut self, service: &Service) {
        self.queue = hostcalls::register_shared_queue(sync::QUEUE_NAME).ok();
        let tick_ms = (service.sync_interval_ms / 10).clamp(5, 1_000);
        let _ = hostcalls::set_tick_period(Duration::from_millis(tick_ms));
    }

    pub fn tick(&mut self, shared: &Shared, proxy_id: &str) {
        let Some(service) = shared.limiter.policy().service.as_ref() else {
            return;
        };
        let now = host::now_us();
        let mut store = SharedData;
        let state = sync::read_state(&mut store);
        shared.publish(&state, service, now);

        let busy_us = (service.timeout_ms + 50) * 1_000;
        let Some(claimed) = sync::claim_round(
            &mut store,
            now,
            service.sync_interval_ms,
            busy_us,
            service.breaker_failures,
        ) else {
            // Not this worker's round: its waiting keys go on the queue for the winner,
            // within the quota of the current round.
            shared.announcer.flush(state.rounds);
            return;
        };
        let interval_ms = claimed.effective_interval_ms(service.sync_interval_ms);
        let limiter = &shared.limiter;
        let (mut gathered, forgotten) = shared.announcer.gather(limiter);
        shared.metrics.sync_dropped(forgotten);
        // The batch: as many waiting keys as fit, by count and by bytes; the rest wait.
        let mut entries = Vec::new();
        let mut batch_keys = Vec::new();
        let mut bytes = 0;
        while entries.len() < MAX_BATCH_KEYS {
            let Some((rule, key)) = gathered.pop() else {
                break;
            };
            let limits = limiter
                .policy()
                .rules
                .get(rule)
                .map_or(0, |r| r.limits.len());
            let size = entry_bytes(&key, limits);
            if bytes + size > MAX_BATCH_BYTES && !entries.is_empty() {
                let _ = gathered.push(rule, key);
                break;
            }
            if let Some(entry) = sync::snapshot(limiter, rule, &key, &mut store) {
                bytes += size;
                entries.push(entry);
                batch_keys.push((rule, key));
            }
        }
        shared.announcer.flush(claimed.rounds);
        shared.announcer.keep(limiter, gathered);
        if entries.is_empty() {
            let _ = sync::update_state(&mut store, |s| s.busy_until_us = 0);
            return;
        }
        let request = SyncRequest {
            proxy: proxy_id.to_string(),
            interval_ms,
            entries,
        };
        let batch = InFlight {
            keys: batch_keys,
            entries: request.entries.clone(),
            sent_at_us: now,
        };
        match callout::post(service, "/v1/sync", &request) {
            Ok(token) => {
                shared.metrics.sync_sent();
                self.in_flight.insert(token, batch);
            }
            Err(failure) => {
                let _ = hostcalls::log(
                    LogLevel::Warn,
                    &format!("sluice: sync to cluster {:?} not sent", service.cluster),
                );
                self.restore(shared, &batch);
                failed(shared, service, now, failure);
            }
        }
    }

    /// A batch that did not reach the service goes back into the records.
    fn restore(&self, shared: &Shared, batch: &InFlight) {
        let mut store = SharedData;
        for ((rule, key), entry) in batch.keys.iter().zip(&batch.entries) {
            if let Ok(true) = sync::restore(&shared.limiter, *rule, entry, &mut store) {
                let forgotten = shared
                    .announcer
                    .announce(&shared.limiter, *rule, key.clone());
                shared.metrics.sync_dropped(forgotten);
            }
        }
    }

    /// The service answered (or the call failed: no `:status`).
    pub fn answered(&mut self, shared: &Shared, token: u32, num_headers: usize, body_size: usize) {
        let Some(batch) = self.in_flight.remove(&token) else {
            return;
        };
        let Some(service) = shared.limiter.policy().service.as_ref() else {
            return;
        };
        let now = host::now_us();
        shared
            .metrics
            .sync_latency(now.saturating_sub(batch.sent_at_us) / 1_000);
        let response =
            callout::answer::<SyncResponse>(num_headers, body_size).and_then(|r| {
                match r.grants.len() == batch.keys.len() {
                    true => Ok(r),
                    false => Err(Failure::Malformed),
                }
            });
        let response = match response {
            Ok(response) => response,
            Err(failure) => {
                if failure == Failure::Unauthorized {
                    let _ = hostcalls::log(
                        LogLevel::Error,
                        "sluice: the counter service refused our token (401): check service.token",
                    );
                }
                self.restore(shared, &batch);
                failed(shared, service, now, failure);
                return;
            }
        };
        let refused = apply(&shared.limiter, &batch.keys, &response, now);
        if let Some((count, reason)) = refused {
            shared.metrics.sync_refused(count);
            let _ = hostcalls::log(
                LogLevel::Warn,
                &format!("sluice: the counter service refused {count} key(s) of a batch, their counts are dropped: {reason}"),
            );
        }
        let mut store = SharedData;
        let hints = &response.hints;
        let _ = sync::update_state(&mut store, |s| {
            s.breaker.succeeded();
            s.busy_until_us = 0;
            s.interval_ms = hints.next_sync_ms;
            s.bypass = hints.overrides.bypass;
        });
        shared.metrics.sync_ok();
        let state = sync::read_state(&mut store);
        shared.publish(&state, service, now);
    }
}

/// Installs the grants of an answer; returns how many entries the service refused, and the
/// first reason. A refused entry's counts are not put back: sending them again would be refused
/// again.
fn apply(
    limiter: &Limiter,
    keys: &[(usize, String)],
    response: &SyncResponse,
    now: u64,
) -> Option<(usize, String)> {
    let mut store = SharedData;
    let mut refused: Option<(usize, String)> = None;
    for ((rule, key), grant) in keys.iter().zip(&response.grants) {
        if let Some(reason) = &grant.refused {
            let entry = refused.get_or_insert_with(|| (0, reason.clone()));
            entry.0 += 1;
            continue;
        }
        let _ = sync::apply_grant(limiter, *rule, key, grant, now, &mut store);
    }
    refused
}

/// Counts a failed sync against the breaker and releases the round.
fn failed(shared: &Shared, service: &Service, now: u64, failure: Failure) {
    shared.metrics.sync_failed(failure);
    shared.breaker_failed(service, now, true);
}

//! The sync, worker side: on each tick, refresh what requests need to know (breaker, bypass);
//! if this worker wins the round, gather every worker's unsynced keys and send one batch.

use std::collections::HashMap;

use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;
use sluice_core::overrides::live::{Taken, MAX_KEPT_BYTES};
use sluice_core::policy::Service;
use sluice_core::protocol::SyncResponse;
use sluice_core::protocol::MAX_SYNC_ANSWER_BYTES;
use sluice_core::sync::proxy;
use sluice_core::sync::round::{self, Batch};

use crate::callout::{self, Failure};
use crate::host::{self, SharedData};
use crate::shared::Shared;

/// A batch on its way.
pub struct InFlight {
    batch: Batch,
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

    /// Joins the proxy's announcement queue. The winner of each round takes the announcements
    /// off it on its tick: nothing waits for a queue-ready callback (nginx never makes one).
    pub fn start(&mut self) {
        self.queue = hostcalls::register_shared_queue(proxy::QUEUE_NAME).ok();
    }

    pub fn tick(&mut self, shared: &Shared, proxy_id: &str) {
        let limiter = shared.limiter();
        let Some(service) = limiter.policy().service.as_ref() else {
            return;
        };
        let now = host::now_us();
        let mut store = SharedData;
        let state = proxy::read_state(&mut store);
        shared.publish(&state, service, now);

        let busy_us = (service.timeout_ms + 50) * 1_000;
        let Some(claimed) = proxy::claim_round(
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
        let limiter = shared.limiter();
        let (mut waiting, forgotten) = shared.announcer.gather(&limiter);
        shared.metrics.sync_dropped(forgotten);
        // The configured interval, not the one the service last advised: the service advises
        // from what it is sent, so sending its own advice back would never let it come down.
        let batch = round::compose(
            &limiter,
            &mut waiting,
            proxy_id,
            service.sync_interval_ms,
            &mut store,
        );
        shared.announcer.flush(claimed.rounds);
        shared.announcer.keep(&limiter, waiting);
        let Some(batch) = batch else {
            let _ = proxy::update_state(&mut store, |s| s.busy_until_us = 0);
            return;
        };
        match callout::post(service, "/v1/sync", &batch.request) {
            Ok(token) => {
                shared.metrics.sync_sent();
                let sent_at_us = now;
                self.in_flight.insert(token, InFlight { batch, sent_at_us });
            }
            Err(failure) => {
                let _ = hostcalls::log(
                    LogLevel::Warn,
                    &format!("sluice: sync to {} not sent", service.upstream.describe()),
                );
                recover(shared, service, &batch, now, failure, None);
            }
        }
    }

    /// The service answered (or the call failed: no `:status`).
    pub fn answered(&mut self, shared: &Shared, token: u32, num_headers: usize, body_size: usize) {
        let Some(InFlight { batch, sent_at_us }) = self.in_flight.remove(&token) else {
            return;
        };
        let limiter = shared.limiter();
        let Some(service) = limiter.policy().service.as_ref() else {
            return;
        };
        let now = host::now_us();
        shared
            .metrics
            .sync_latency(now.saturating_sub(sent_at_us) / 1_000);
        let mut store = SharedData;
        if body_size > MAX_SYNC_ANSWER_BYTES {
            // Not read: a service within its bounds never answers this much.
            let _ = hostcalls::log(
                LogLevel::Warn,
                &format!(
                    "sluice: a sync answer of {body_size} bytes, more than {MAX_SYNC_ANSWER_BYTES}, was not read"
                ),
            );
            shared.metrics.overrides_refused();
        }
        let settled =
            callout::answer_within::<SyncResponse>(num_headers, body_size, MAX_SYNC_ANSWER_BYTES)
                .and_then(|response| {
                    round::settle(&limiter, &batch, &response, now, &mut store)
                        .map_err(|_| Failure::Malformed)
                });
        let settled = match settled {
            Ok(settled) => settled,
            Err(failure) => {
                if failure == Failure::Unauthorized {
                    let _ = hostcalls::log(
                        LogLevel::Error,
                        "sluice: the counter service refused our token (401): check service.token",
                    );
                }
                let status = host::call_status(num_headers);
                recover(shared, service, &batch, now, failure, status.as_deref());
                return;
            }
        };
        match settled.overrides {
            Taken::Nothing => {}
            Taken::Kept { whole, .. } => shared.metrics.overrides_taken(whole),
            Taken::Gap { kept, from } => {
                shared.metrics.overrides_refused();
                let _ = hostcalls::log(
                    LogLevel::Warn,
                    &format!(
                        "sluice: live overrides delta from version {from} ignored (this proxy has {kept}): the next sync asks for the whole set"
                    ),
                );
            }
            Taken::TooLarge { version, bytes } => {
                shared.metrics.overrides_refused();
                let _ = hostcalls::log(
                    LogLevel::Warn,
                    &format!(
                        "sluice: live overrides version {version} refused: {bytes} bytes, more than {MAX_KEPT_BYTES}; the last set is kept"
                    ),
                );
            }
        }
        if let Some(reason) = settled.reason {
            shared.metrics.sync_refused(settled.refused);
            let _ = hostcalls::log(
                LogLevel::Warn,
                &format!(
                    "sluice: the counter service refused {} key(s) of a batch, their counts are dropped: {reason}",
                    settled.refused
                ),
            );
        }
        shared.metrics.sync_ok();
        let state = proxy::read_state(&mut store);
        shared.publish(&state, service, now);
    }
}

/// A batch that got no usable answer: core puts it back or keeps it in doubt; its keys are
/// announced again and the breaker told.
fn recover(
    shared: &Shared,
    service: &Service,
    batch: &Batch,
    now: u64,
    failure: Failure,
    status: Option<&str>,
) {
    let mut store = SharedData;
    let limiter = shared.limiter();
    let jitter = host::jitter(now);
    let announce = round::recover(
        &limiter, batch, service, failure, status, now, jitter, &mut store,
    );
    for (rule, key) in announce {
        let forgotten = shared.announcer.announce(&limiter, rule, key);
        shared.metrics.sync_dropped(forgotten);
    }
    shared.metrics.sync_failed(failure);
    let state = proxy::read_state(&mut store);
    shared.publish(&state, service, now);
}

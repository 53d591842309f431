//! What every request of a VM shares: the limiter, metric ids, the announcer, and what the last
//! tick learned about the counter service; and the breaker's bookkeeping, shared by the sync
//! and strict checks.

use std::cell::Cell;

use sluice_core::policy::Service;
use sluice_core::sync::{self, SyncState};
use sluice_core::{table, Limiter};

use crate::announce::Announcer;
use crate::host::SharedData;
use crate::metrics::Metrics;

pub struct Shared {
    pub limiter: Limiter,
    pub metrics: Metrics,
    /// Announces keys with unsynced counts to the worker that syncs.
    pub announcer: Announcer,
    /// The breaker is closed: grants and strict checks may be used.
    pub service_up: Cell<bool>,
    /// The service's emergency bypass override is on.
    pub bypass: Cell<bool>,
    /// This worker already asked for an early sync since its last tick.
    pub hurried: Cell<bool>,
}

impl Shared {
    /// Publishes the proxy-wide sync state to this worker's requests.
    pub fn publish(&self, state: &SyncState, service: &Service, now_us: u64) {
        let breaker = state.breaker.state(service.breaker_failures, now_us);
        self.service_up
            .set(state.breaker.service_up(service.breaker_failures, now_us));
        self.bypass.set(state.bypass);
        self.hurried.set(false);
        self.metrics.breaker(breaker);
    }

    /// Counts a failed callout against the breaker; a failed sync also releases its round.
    pub fn breaker_failed(&self, service: &Service, now_us: u64, release_round: bool) {
        let jitter = 0.5 + (table::fnv1a(&now_us.to_le_bytes()) % 1_000) as f64 / 1_000.0;
        let mut store = SharedData;
        let _ = sync::update_state(&mut store, |s| {
            if release_round {
                s.busy_until_us = 0;
            }
            s.breaker.failed(
                service.breaker_failures,
                now_us,
                service.breaker_cooldown_ms.saturating_mul(1_000),
                jitter,
            );
        });
        let state = sync::read_state(&mut store);
        self.publish(&state, service, now_us);
    }
}

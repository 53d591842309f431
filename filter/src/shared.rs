//! What every request of a VM shares: the limiter, metric ids, the announcer, and what the last
//! tick learned about the counter service.

use std::cell::Cell;

use sluice_core::policy::Service;
use sluice_core::proxy_sync::SyncState;
use sluice_core::Limiter;

use crate::announce::Announcer;
use crate::metrics::Metrics;
use crate::shaper::Shaper;
use crate::shedder::Shedder;

pub struct Shared {
    pub limiter: Limiter,
    pub metrics: Metrics,
    /// Announces keys with unsynced counts to the worker that syncs.
    pub announcer: Announcer,
    /// The breaker is closed: leases and strict checks may be used.
    pub service_up: Cell<bool>,
    /// The service's emergency bypass override is on.
    pub bypass: Cell<bool>,
    /// This worker already asked for an early sync since its last tick.
    pub hurried: Cell<bool>,
    /// Load shedding's worker side, when configured.
    pub shedder: Option<Shedder>,
    /// Requests a leaky bucket holds until their slot.
    pub shaper: Shaper,
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
        if let Some(shedder) = &self.shedder {
            // Stale after three intervals (and at least a second) without an answer.
            let interval_ms = state.effective_interval_ms(service.sync_interval_ms);
            let fresh_us = (interval_ms * 3_000).max(1_000_000);
            shedder.fleet.set(state.fleet.level(now_us, fresh_us));
        }
    }
}

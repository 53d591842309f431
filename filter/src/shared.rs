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
    /// When this worker last logged a warn rule's would-be denial, and how many it did not
    /// log since (one line a second per worker).
    pub warn_log: Cell<(u64, u64)>,
}

/// Least time between two warn log lines of one worker.
const WARN_LOG_EVERY_US: u64 = 1_000_000;

impl Shared {
    /// Logs that a warn rule would have denied `key`, at most once a second per worker (the
    /// lines it skips are counted in the next).
    pub fn warn(&self, rule: &str, key: &str, now_us: u64) {
        let (last, skipped) = self.warn_log.get();
        if last != 0 && now_us.saturating_sub(last) < WARN_LOG_EVERY_US {
            self.warn_log.set((last, skipped + 1));
            return;
        }
        self.warn_log.set((now_us, 0));
        let shown: String = key
            .chars()
            .map(|c| {
                if c == sluice_core::key::SEPARATOR {
                    ':'
                } else {
                    c
                }
            })
            .filter(|c| !c.is_control())
            .collect();
        let more = if skipped > 0 {
            format!(" ({skipped} more since the last line)")
        } else {
            String::new()
        };
        crate::host::log_warn(&format!(
            "sluice: rule {rule} (warn) would deny key {shown:?}{more}"
        ));
    }
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

//! Envoy stats through `define_metric`: per rule allowed / denied / shadow-denied, and the
//! sync's health. Envoy shows them prefixed with `wasmcustom.`.
//!
//! A request's own counters (its rule's outcome, charged tokens, bypassed) are counted in the
//! worker and handed to the host on the root context's tick ([`Metrics::flush`]): no host call on
//! the request path. The sync's health, off that path, goes to the host at once.

use std::cell::Cell;

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use sluice_core::policy::RuleId;
use sluice_core::sync::breaker::BreakerState;
use sluice_core::Outcome;

use crate::callout::Failure;

/// The counters of one rule, in this order: allowed, denied, shadow-denied, warned,
/// unavailable (failed closed: refused with a 503), uncounted (an [`Outcome`] each, see
/// [`slot`]), then charged tokens.
const SLOTS: usize = 7;
/// The slot of charged tokens.
const CHARGED: usize = 6;

/// The slot of an outcome's counter.
fn slot(outcome: Outcome) -> usize {
    match outcome {
        Outcome::Allowed => 0,
        Outcome::Denied => 1,
        Outcome::ShadowDenied => 2,
        Outcome::Warned => 3,
        // The name `unavailable` is kept for the 503 it has always counted.
        Outcome::FailedClosed => 4,
        Outcome::Uncounted => 5,
    }
}

/// One counter: its metric id and what this worker counted since the last flush.
#[derive(Debug, Default)]
struct Counter {
    id: u32,
    unflushed: Cell<u64>,
}

impl Counter {
    fn new(name: &str) -> Counter {
        Counter {
            id: counter(name),
            unflushed: Cell::new(0),
        }
    }

    fn add(&self, n: u64) {
        self.unflushed.set(self.unflushed.get().saturating_add(n));
    }

    /// Hands what was counted to the host, if anything.
    fn flush(&self) {
        let n = self.unflushed.take();
        if n > 0 {
            let _ = hostcalls::increment_metric(self.id, n.min(i64::MAX as u64) as i64);
        }
    }
}

/// Every metric the filter reports, defined once per VM.
///
/// Not `Clone`: the unflushed counts would be handed to the host once per copy (see `Drop`).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Per rule, its counters by slot.
    rules: Vec<[Counter; SLOTS]>,
    bypassed: Counter,
    sync_sent: u32,
    sync_ok: u32,
    sync_failed: u32,
    sync_timeout: u32,
    sync_unauthorized: u32,
    sync_refused: u32,
    sync_dropped: u32,
    sync_latency_ms: u32,
    overrides_whole: u32,
    overrides_delta: u32,
    overrides_refused: u32,
    breaker_open: u32,
    check_sent: u32,
    check_failed: u32,
    overrides_not_applied: u32,
    fleet_proxies: u32,
}

fn define(kind: MetricType, name: &str) -> u32 {
    // A host that cannot define metrics gets id 0 and the updates go nowhere.
    hostcalls::define_metric(kind, name).unwrap_or(0)
}

fn counter(name: &str) -> u32 {
    define(MetricType::Counter, name)
}

fn bump(id: u32) {
    let _ = hostcalls::increment_metric(id, 1);
}

/// A root context configured again replaces its requests' shared state: what the old state's
/// requests counted goes to the host when the last of them is done.
impl Drop for Metrics {
    fn drop(&mut self) {
        self.flush();
    }
}

impl Metrics {
    pub fn define<'a>(rule_names: impl Iterator<Item = &'a str>, with_service: bool) -> Metrics {
        let rules = rule_names
            .map(|name| {
                [
                    "allowed",
                    "denied",
                    "shadow_denied",
                    "warned",
                    "unavailable",
                    "uncounted",
                    "charged_tokens",
                ]
                .map(|what| Counter::new(&format!("sluice.rule.{name}.{what}")))
            })
            .collect();
        let mut metrics = Metrics {
            rules,
            bypassed: Counter::new("sluice.bypassed"),
            ..Metrics::default()
        };
        if with_service {
            metrics.sync_sent = counter("sluice.sync.sent");
            metrics.sync_ok = counter("sluice.sync.ok");
            metrics.sync_failed = counter("sluice.sync.failed");
            metrics.sync_timeout = counter("sluice.sync.timeout");
            metrics.sync_unauthorized = counter("sluice.sync.unauthorized");
            metrics.sync_refused = counter("sluice.sync.refused");
            metrics.sync_dropped = counter("sluice.sync.dropped");
            metrics.sync_latency_ms = define(MetricType::Histogram, "sluice.sync.latency_ms");
            metrics.overrides_whole = counter("sluice.overrides.whole");
            metrics.overrides_delta = counter("sluice.overrides.delta");
            metrics.overrides_refused = counter("sluice.overrides.refused");
            metrics.breaker_open = define(MetricType::Gauge, "sluice.breaker.open");
            metrics.check_sent = counter("sluice.check.sent");
            metrics.check_failed = counter("sluice.check.failed");
            metrics.overrides_not_applied =
                define(MetricType::Gauge, "sluice.overrides.not_applied");
            metrics.fleet_proxies = define(MetricType::Gauge, "sluice.fleet.proxies");
        }
        metrics
    }

    /// Counts a rule's outcome (handed to the host at the next [`flush`](Self::flush)).
    pub fn outcome(&self, rule: RuleId, outcome: Outcome) {
        if let Some(counter) = self
            .rules
            .get(rule.index())
            .and_then(|c| c.get(slot(outcome)))
        {
            counter.add(1);
        }
    }

    /// Tokens a response's reported cost charged to a rule (handed to the host at the next
    /// [`flush`](Self::flush)).
    pub fn charged(&self, rule: RuleId, cost: u64) {
        if let Some(counter) = self.rules.get(rule.index()).and_then(|c| c.get(CHARGED)) {
            counter.add(cost);
        }
    }

    /// Counts a bypassed request (handed to the host at the next [`flush`](Self::flush)).
    pub fn bypassed(&self) {
        self.bypassed.add(1);
    }

    /// Hands the host what the requests counted since the last flush: one host call per
    /// counter that moved, none for the others. Called on every tick and when the VM is done.
    pub fn flush(&self) {
        for counter in self.rules.iter().flatten() {
            counter.flush();
        }
        self.bypassed.flush();
    }

    pub fn sync_sent(&self) {
        bump(self.sync_sent);
    }

    pub fn sync_ok(&self) {
        bump(self.sync_ok);
    }

    pub fn sync_failed(&self, failure: Failure) {
        bump(self.sync_failed);
        match failure {
            Failure::Timeout => bump(self.sync_timeout),
            Failure::Unauthorized => bump(self.sync_unauthorized),
            Failure::NotSent | Failure::Status | Failure::Malformed => {}
        }
    }

    /// Keys of a batch the service refused alone (their counts are dropped).
    pub fn sync_refused(&self, keys: usize) {
        if keys > 0 {
            let _ = hostcalls::increment_metric(self.sync_refused, keys as i64);
        }
    }

    /// Keys whose counts were dropped because too many were waiting for a round.
    pub fn sync_dropped(&self, keys: usize) {
        if keys > 0 {
            let _ = hostcalls::increment_metric(self.sync_dropped, keys as i64);
        }
    }

    pub fn sync_latency(&self, ms: u64) {
        let _ = hostcalls::record_metric(self.sync_latency_ms, ms);
    }

    /// The live overrides of a sync answer were taken: a whole set, or a delta.
    pub fn overrides_taken(&self, whole: bool) {
        bump(if whole {
            self.overrides_whole
        } else {
            self.overrides_delta
        });
    }

    /// The live overrides of a sync answer were refused: past the proxy's bound, or a delta that
    /// did not follow the set kept.
    pub fn overrides_refused(&self) {
        bump(self.overrides_refused);
    }

    pub fn breaker(&self, state: BreakerState) {
        let open = (state != BreakerState::Closed) as u64;
        let _ = hostcalls::record_metric(self.breaker_open, open);
    }

    pub fn check_sent(&self) {
        bump(self.check_sent);
    }

    pub fn check_failed(&self) {
        bump(self.check_failed);
    }

    /// The proxies the fleet-share fallbacks are divided among now (0: none counted yet).
    pub fn fleet_proxies(&self, proxies: u32) {
        let _ = hostcalls::record_metric(self.fleet_proxies, proxies as u64);
    }

    /// Entries of the live overrides in force that this proxy did not apply (each logged).
    pub fn overrides_not_applied(&self, entries: usize) {
        let _ = hostcalls::record_metric(self.overrides_not_applied, entries as u64);
    }
}

//! Envoy stats through `define_metric`: per rule allowed / denied / shadow-denied, and the
//! sync's health. Envoy shows them prefixed with `wasmcustom.`.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use sluice_core::breaker::BreakerState;
use sluice_core::policy::RuleId;
use sluice_core::Outcome;

use crate::callout::Failure;

/// Metric ids of one rule.
#[derive(Debug, Clone, Copy, Default)]
struct RuleMetrics {
    allowed: u32,
    denied: u32,
    shadow_denied: u32,
    warned: u32,
    unavailable: u32,
    charged: u32,
}

/// Every metric the filter reports, defined once per VM.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    rules: Vec<RuleMetrics>,
    bypassed: u32,
    sync_sent: u32,
    sync_ok: u32,
    sync_failed: u32,
    sync_timeout: u32,
    sync_unauthorized: u32,
    sync_refused: u32,
    sync_dropped: u32,
    sync_latency_ms: u32,
    breaker_open: u32,
    check_sent: u32,
    check_failed: u32,
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

impl Metrics {
    pub fn define<'a>(rule_names: impl Iterator<Item = &'a str>, with_service: bool) -> Metrics {
        let rules = rule_names
            .map(|name| RuleMetrics {
                allowed: counter(&format!("sluice.rule.{name}.allowed")),
                denied: counter(&format!("sluice.rule.{name}.denied")),
                shadow_denied: counter(&format!("sluice.rule.{name}.shadow_denied")),
                warned: counter(&format!("sluice.rule.{name}.warned")),
                unavailable: counter(&format!("sluice.rule.{name}.unavailable")),
                charged: counter(&format!("sluice.rule.{name}.charged_tokens")),
            })
            .collect();
        let mut metrics = Metrics {
            rules,
            bypassed: counter("sluice.bypassed"),
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
            metrics.breaker_open = define(MetricType::Gauge, "sluice.breaker.open");
            metrics.check_sent = counter("sluice.check.sent");
            metrics.check_failed = counter("sluice.check.failed");
        }
        metrics
    }

    pub fn outcome(&self, rule: RuleId, outcome: Outcome) {
        let Some(ids) = self.rules.get(rule.index()) else {
            return;
        };
        bump(match outcome {
            Outcome::Allowed => ids.allowed,
            Outcome::Denied => ids.denied,
            Outcome::ShadowDenied => ids.shadow_denied,
            Outcome::Warned => ids.warned,
            Outcome::Unavailable => ids.unavailable,
        });
    }

    /// Tokens a response's reported cost charged to a rule.
    pub fn charged(&self, rule: RuleId, cost: u64) {
        if let Some(ids) = self.rules.get(rule.index()) {
            let _ = hostcalls::increment_metric(ids.charged, cost.min(i64::MAX as u64) as i64);
        }
    }

    pub fn bypassed(&self) {
        bump(self.bypassed);
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
}

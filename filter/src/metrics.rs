//! Envoy stats through `define_metric`: per rule allowed / denied / shadow-denied, and totals.
//! Envoy shows them prefixed with `wasmcustom.`.

use proxy_wasm::hostcalls;
use proxy_wasm::types::MetricType;
use sluice_core::Outcome;

/// Metric ids of one rule.
#[derive(Debug, Clone, Copy, Default)]
struct RuleMetrics {
    allowed: u32,
    denied: u32,
    shadow_denied: u32,
    unavailable: u32,
}

/// Every metric the filter reports, defined once per VM.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    rules: Vec<RuleMetrics>,
    bypassed: u32,
}

fn counter(name: &str) -> u32 {
    // A host that cannot define metrics gets id 0 and the increments go nowhere.
    hostcalls::define_metric(MetricType::Counter, name).unwrap_or(0)
}

impl Metrics {
    pub fn define<'a>(rule_names: impl Iterator<Item = &'a str>) -> Metrics {
        let rules = rule_names
            .map(|name| RuleMetrics {
                allowed: counter(&format!("sluice.rule.{name}.allowed")),
                denied: counter(&format!("sluice.rule.{name}.denied")),
                shadow_denied: counter(&format!("sluice.rule.{name}.shadow_denied")),
                unavailable: counter(&format!("sluice.rule.{name}.unavailable")),
            })
            .collect();
        Metrics {
            rules,
            bypassed: counter("sluice.bypassed"),
        }
    }

    pub fn outcome(&self, rule: usize, outcome: Outcome) {
        let Some(ids) = self.rules.get(rule) else {
            return;
        };
        let id = match outcome {
            Outcome::Allowed => ids.allowed,
            Outcome::Denied => ids.denied,
            Outcome::ShadowDenied => ids.shadow_denied,
            Outcome::Unavailable => ids.unavailable,
        };
        let _ = hostcalls::increment_metric(id, 1);
    }

    pub fn bypassed(&self) {
        let _ = hostcalls::increment_metric(self.bypassed, 1);
    }
}

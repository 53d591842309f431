//! Metrics: Envoy stats shared by every VM of a process, and each VM's own metric ids.

use std::collections::BTreeMap;

/// A proxy-wasm metric type (`proxy_define_metric`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MetricKind {
    Counter = 0,
    Gauge = 1,
    Histogram = 2,
}

impl MetricKind {
    pub(crate) fn from_raw(raw: u32) -> Option<MetricKind> {
        match raw {
            0 => Some(MetricKind::Counter),
            1 => Some(MetricKind::Gauge),
            2 => Some(MetricKind::Histogram),
            _ => None,
        }
    }
}

/// One stat's value, as [`Proxy::metrics`](super::Proxy::metrics) reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricValue {
    Counter(u64),
    /// Envoy gauges are unsigned; a decrement below zero wraps, as in a release Envoy.
    Gauge(u64),
    /// Every recorded value, in order.
    Histogram(Vec<u64>),
}

/// The process's stats, by name: defining the same name on several VMs (Envoy's workers)
/// names the same stat, so counters sum across workers.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    values: BTreeMap<String, MetricValue>,
}

impl Stats {
    pub(crate) fn define(&mut self, kind: MetricKind, name: &str) {
        self.values.entry(name.to_string()).or_insert(match kind {
            MetricKind::Counter => MetricValue::Counter(0),
            MetricKind::Gauge => MetricValue::Gauge(0),
            MetricKind::Histogram => MetricValue::Histogram(Vec::new()),
        });
    }

    pub(crate) fn get(&self, name: &str) -> Option<&MetricValue> {
        self.values.get(name)
    }

    pub(crate) fn get_mut(&mut self, name: &str) -> Option<&mut MetricValue> {
        self.values.get_mut(name)
    }

    pub(crate) fn all(&self) -> BTreeMap<String, MetricValue> {
        self.values.clone()
    }
}

/// A VM's metric ids. Like proxy-wasm-cpp-host, the low two bits of an id carry the type
/// (1 counter, 2 gauge, 3 histogram) and each definition takes a fresh id.
#[derive(Debug, Default)]
pub(crate) struct MetricIds {
    next: u32,
    names: BTreeMap<u32, (MetricKind, String)>,
}

impl MetricIds {
    pub(crate) fn define(&mut self, kind: MetricKind, name: &str) -> u32 {
        self.next += 4;
        let id = self.next | (kind as u32 + 1);
        self.names.insert(id, (kind, name.to_string()));
        id
    }

    pub(crate) fn lookup(&self, id: u32) -> Option<&(MetricKind, String)> {
        self.names.get(&id)
    }
}

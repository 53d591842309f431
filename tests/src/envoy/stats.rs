//! Envoy's admin `/stats` in text form (`name: value` lines).

use std::collections::BTreeMap;

/// A snapshot of Envoy's statistics.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    values: BTreeMap<String, String>,
}

impl Stats {
    /// Parses the admin interface's text format.
    pub fn parse(text: &str) -> Stats {
        let values = text
            .lines()
            .filter_map(|line| line.split_once(": "))
            .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
            .collect();
        Stats { values }
    }

    /// The counter or gauge `name`, if Envoy has it and it is a number.
    pub fn counter(&self, name: &str) -> Option<u64> {
        self.values.get(name)?.parse().ok()
    }

    /// Every statistic whose name contains `part`, for assert messages.
    pub fn matching(&self, part: &str) -> Vec<(&str, &str)> {
        self.values
            .iter()
            .filter(|(name, _)| name.contains(part))
            .map(|(name, value)| (name.as_str(), value.as_str()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_counters_and_skips_histograms() {
        let stats = Stats::parse(
            "wasmcustom.sluice.rule.per-ip.allowed: 50\n\
             http.edge.downstream_rq_time: P0(nan,1.0) P25(nan,1.025)\n",
        );
        assert_eq!(
            stats.counter("wasmcustom.sluice.rule.per-ip.allowed"),
            Some(50)
        );
        assert_eq!(stats.counter("http.edge.downstream_rq_time"), None);
        assert_eq!(stats.counter("absent"), None);
        assert_eq!(stats.matching("sluice").len(), 1);
    }
}

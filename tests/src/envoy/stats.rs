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

/// How many samples the histogram `name` holds in all (its cumulative `totals` buckets), from the admin
/// interface's `/stats?histogram_buckets=detailed` text; `None` if the text has no such histogram or it has no
/// recorded values yet.
pub fn histogram_samples(text: &str, name: &str) -> Option<u64> {
    let mut lines = text.lines();
    lines.find(|line| line.trim_end() == format!("{name}:"))?;
    let totals = lines
        .take_while(|line| line.starts_with(' '))
        .find_map(|line| line.trim().strip_prefix("totals="))?;
    // `start,width:count` per bucket, comma-space separated.
    totals
        .split(", ")
        .map(|bucket| {
            bucket
                .rsplit_once(':')
                .and_then(|(_, n)| n.parse::<u64>().ok())
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_samples_of_a_detailed_histogram() {
        let text = "a.other: 3\n\
                    wasmcustom.sluice.shed.api.latency_ms:\n  \
                    totals=0,0:2, 3,0.1:1, 300,10:4\n  \
                    intervals=300,10:3\n  \
                    summary=P0(0,0) P100(310,310)\n\
                    wasmcustom.sluice.shed.b.latency_ms: No recorded values\n";
        assert_eq!(
            histogram_samples(text, "wasmcustom.sluice.shed.api.latency_ms"),
            Some(7)
        );
        assert_eq!(
            histogram_samples(text, "wasmcustom.sluice.shed.b.latency_ms"),
            None
        );
        assert_eq!(histogram_samples(text, "absent"), None);
    }

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

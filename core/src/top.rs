//! Who is being limited: the keys a rule admits and denies most, counted in fixed memory.
//!
//! Each worker counts a rule's keys (a rule with `top_keys`) in two [`SpaceSaving`] sketches of
//! `top_keys` counters, one for the keys it admits and one for those it denies (Metwally,
//! Agrawal, El Abbadi, "Efficient computation of frequent and top-k elements in data streams",
//! 2005). Its guarantee, for a stream of `N` requests and `k` counters: every key counted more
//! than `N / k` times holds a counter, and every counter overestimates its key's count by at most
//! the smallest counter, itself at most `N / k`.
//!
//! What leaves a worker is a [`Summary`]: the sketch in the form that merges without its error
//! growing with the number of merges (Misra–Gries; Agarwal et al., "Mergeable summaries", 2012):
//! each count a lower bound, and one `error` for the summary, such that for every key
//! `true - error <= count <= true` (a key not listed counts 0, so its true count is at most
//! `error`), and `error <= (total - sum of counts) / k <= total / k`. Summaries of several workers,
//! several proxies or several minutes merge into one of the same form and the same bound over
//! their summed total ([`Summary::merge`]); the service answers its `error` with the keys.
//!
//! Keys are the rule's keys as the proxy builds them: a key longer than the key cap is already
//! its digest ([`crate::limiter::key`]), so no counter holds more than
//! [`crate::limiter::key::MAX_KEY_BYTES`] bytes of key.

use serde::{Deserialize, Serialize};

use crate::store::{self, Store};
use sluice_protocol::{TopKey, TopReport, TopSummary};

/// Fewest counters a rule's `top_keys` may ask for.
pub const MIN_COUNTERS: u32 = 4;
/// Most counters a rule's `top_keys` may ask for (and most keys of a summary a proxy sends).
pub const MAX_COUNTERS: u32 = sluice_protocol::MAX_TOP_KEYS as u32;

/// One counter of a [`SpaceSaving`] sketch.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Counter {
    /// The key's fingerprint in its rule's table: compared before the key, never 0.
    fingerprint: u64,
    /// Requests counted for it, an overestimate by at most `error`.
    count: u64,
    /// What the counter held when this key took it over.
    error: u64,
    key: String,
}

/// A space-saving sketch of `capacity` counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpaceSaving {
    counters: Vec<Counter>,
    capacity: usize,
    total: u64,
}

impl SpaceSaving {
    pub fn new(capacity: usize) -> SpaceSaving {
        SpaceSaving {
            counters: Vec::with_capacity(capacity),
            capacity: capacity.max(1),
            total: 0,
        }
    }

    /// Counts one request of `key` (whose fingerprint, never 0, tells keys apart).
    pub fn offer(&mut self, fingerprint: u64, key: &str) {
        self.total = self.total.saturating_add(1);
        if let Some(c) = self
            .counters
            .iter_mut()
            .find(|c| c.fingerprint == fingerprint)
        {
            c.count = c.count.saturating_add(1);
            return;
        }
        if self.counters.len() < self.capacity {
            self.counters.push(Counter {
                fingerprint,
                count: 1,
                error: 0,
                key: key.to_owned(),
            });
            return;
        }
        // The smallest counter takes the new key over, and keeps its count as the key's error.
        let mut at = 0;
        let mut min = u64::MAX;
        for (i, c) in self.counters.iter().enumerate() {
            if c.count < min {
                min = c.count;
                at = i;
            }
        }
        if let Some(c) = self.counters.get_mut(at) {
            c.fingerprint = fingerprint;
            c.error = c.count;
            c.count = c.count.saturating_add(1);
            c.key.clear();
            c.key.push_str(key);
        }
    }

    /// Requests counted since it was made or last taken.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The smallest counter once every counter is taken (0 before): no key without a counter
    /// was counted more often, and no counter overestimates its key by more.
    pub fn min(&self) -> u64 {
        if self.counters.len() < self.capacity {
            return 0;
        }
        self.counters.iter().map(|c| c.count).min().unwrap_or(0)
    }

    /// The counter of `key`, if it holds one: its count and its error (`count - error` is a lower
    /// bound of the true count, `count` an upper one).
    pub fn estimate(&self, key: &str) -> Option<(u64, u64)> {
        self.counters
            .iter()
            .find(|c| c.key == key)
            .map(|c| (c.count, c.error))
    }

    /// The sketch as a mergeable [`Summary`] (each count less the smallest counter), and the
    /// sketch emptied.
    pub fn take(&mut self) -> Summary {
        let min = self.min();
        let mut keys: Vec<(String, u64)> = self
            .counters
            .drain(..)
            .filter(|c| c.count > min)
            .map(|c| (c.key, c.count - min))
            .collect();
        sort(&mut keys);
        let summary = Summary {
            total: self.total,
            error: min,
            keys,
        };
        self.total = 0;
        summary
    }
}

/// A mergeable summary of a stream of keys (see the module's description): for every key,
/// `true - error <= count <= true`, a key not listed counting 0.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests summarized.
    pub total: u64,
    /// How much any count may fall short of the true one; no key not listed was counted more.
    pub error: u64,
    /// Keys and their counts, largest first (ties by key).
    pub keys: Vec<(String, u64)>,
}

impl Summary {
    /// Whether it summarizes nothing.
    pub fn is_empty(&self) -> bool {
        self.total == 0 && self.keys.is_empty()
    }

    /// Adds `other` to it and keeps at most `capacity` keys: counts of the same key add up, and
    /// so do the errors; past `capacity` keys, the `(capacity + 1)`-th largest count is taken from
    /// every count (the keys left with nothing go) and added to the error. Each count stays a lower
    /// bound within `error` of the truth, and `error` at most the summed total over `capacity`.
    pub fn merge(&mut self, other: &Summary, capacity: usize) {
        self.total = self.total.saturating_add(other.total);
        self.error = self.error.saturating_add(other.error);
        for (key, count) in &other.keys {
            match self.keys.iter_mut().find(|(k, _)| k == key) {
                Some((_, c)) => *c = c.saturating_add(*count),
                None => self.keys.push((key.clone(), *count)),
            }
        }
        self.truncate(capacity);
    }

    /// Keeps at most `capacity` keys, as [`Summary::merge`] does.
    pub fn truncate(&mut self, capacity: usize) {
        sort(&mut self.keys);
        let Some(&(_, cut)) = self.keys.get(capacity) else {
            return;
        };
        self.keys.truncate(capacity);
        for (_, count) in &mut self.keys {
            *count -= cut;
        }
        self.keys.retain(|(_, count)| *count > 0);
        self.error = self.error.saturating_add(cut);
    }
}

/// Largest count first, then by key: one order whatever the order of the merges.
fn sort(keys: &mut [(String, u64)]) {
    keys.sort_unstable_by(|(ka, ca), (kb, cb)| cb.cmp(ca).then_with(|| ka.cmp(kb)));
}

/// One worker's sketches of one rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleTop {
    pub admitted: SpaceSaving,
    pub denied: SpaceSaving,
}

impl RuleTop {
    pub fn new(capacity: usize) -> RuleTop {
        RuleTop {
            admitted: SpaceSaving::new(capacity),
            denied: SpaceSaving::new(capacity),
        }
    }

    /// Both sketches as summaries, emptied; `None` when they counted nothing.
    pub fn take(&mut self) -> Option<Taken> {
        if self.admitted.total() == 0 && self.denied.total() == 0 {
            return None;
        }
        Some(Taken {
            admitted: self.admitted.take(),
            denied: self.denied.take(),
        })
    }
}

/// A rule's summaries: what its keys were admitted and denied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taken {
    pub admitted: Summary,
    pub denied: Summary,
}

impl Taken {
    pub fn merge(&mut self, other: &Taken, capacity: usize) {
        self.admitted.merge(&other.admitted, capacity);
        self.denied.merge(&other.denied, capacity);
    }

    pub fn is_empty(&self) -> bool {
        self.admitted.is_empty() && self.denied.is_empty()
    }
}

/// Shared-data key where the workers of a proxy gather a rule's summaries until the sync takes
/// them (one per rule name; at most `top_keys` keys of each kind, so at most
/// `2 * top_keys * MAX_KEY_BYTES` bytes of keys).
pub fn shared_key(rule: &str) -> String {
    format!("sluice/top/{rule}")
}

/// Adds a worker's summaries of `rule` to the proxy's, kept at `capacity` keys of each kind.
pub fn publish(
    store: &mut dyn Store,
    rule: &str,
    taken: &Taken,
    capacity: usize,
) -> Result<(), store::StoreError> {
    store::update(store, &shared_key(rule), |bytes| {
        let mut gathered: Taken = serde_json::from_slice(bytes).unwrap_or_default();
        gathered.merge(taken, capacity);
        *bytes = serde_json::to_vec(&gathered).unwrap_or_default();
        ((), true)
    })
}

/// Takes the proxy's summaries of `rule` (emptying them): what the sync sends.
pub fn take_shared(store: &mut dyn Store, rule: &str) -> Option<Taken> {
    store::update(store, &shared_key(rule), |bytes| {
        if bytes.is_empty() {
            return (None, false);
        }
        let gathered: Option<Taken> = serde_json::from_slice(bytes).ok();
        bytes.clear();
        (gathered.filter(|t| !t.is_empty()), true)
    })
    .ok()
    .flatten()
}

/// How often a worker adds its sketches to its proxy's, when a counter service takes them.
pub const PUBLISH_EVERY_US: u64 = 1_000_000;
/// How often a worker logs its rules' top denied keys, without a counter service.
pub const LOG_EVERY_US: u64 = 60_000_000;

/// A worker's tick for its sketches, `last_us` being when it last published or logged them (0:
/// never; the first tick starts the period): with a counter service, every
/// [`PUBLISH_EVERY_US`] it adds them to its proxy's, which the sync takes; without one, every
/// [`LOG_EVERY_US`] it answers one line per rule that denied (for the host to log at info
/// level). Nothing without a rule with `top_keys`.
pub fn tick(
    limiter: &crate::Limiter,
    last_us: &mut u64,
    now_us: u64,
    store: &mut dyn Store,
) -> Vec<String> {
    if !limiter.counts_top() {
        return Vec::new();
    }
    let service = limiter.policy().service.is_some();
    let every = if service {
        PUBLISH_EVERY_US
    } else {
        LOG_EVERY_US
    };
    if *last_us == 0 {
        *last_us = now_us;
        return Vec::new();
    }
    if now_us.saturating_sub(*last_us) < every {
        return Vec::new();
    }
    *last_us = now_us;
    let mut lines = Vec::new();
    for (id, taken) in limiter.take_top() {
        let Some(rule) = limiter.policy().rule(id) else {
            continue;
        };
        if service {
            let _ = publish(store, &rule.name, &taken, rule.top_keys as usize);
        } else if let Some(line) = denied_line(&rule.name, &taken.denied) {
            lines.push(line);
        }
    }
    lines
}

/// What the sync sends: the proxy's summaries of each rule with `top_keys` (at most
/// [`sluice_protocol::MAX_TOP_RULES`] rules), taken from shared data.
pub fn reports(limiter: &crate::Limiter, store: &mut dyn Store) -> Vec<TopReport> {
    if !limiter.counts_top() {
        return Vec::new();
    }
    limiter
        .policy()
        .rules
        .iter()
        .filter(|r| r.top_keys > 0)
        .take(sluice_protocol::MAX_TOP_RULES)
        .filter_map(|rule| Some(report(&rule.name, &take_shared(store, &rule.name)?)))
        .collect()
}

/// A rule's summaries as they travel ([`TopReport`]), within the protocol's bounds.
pub fn report(rule: &str, taken: &Taken) -> TopReport {
    TopReport {
        rule: rule.to_string(),
        admitted: wire(&taken.admitted),
        denied: wire(&taken.denied),
    }
}

/// A summary as it travels: within the protocol's bounds (a proxy's own never exceed them).
fn wire(summary: &Summary) -> TopSummary {
    let cap = |n: u64| n.min(sluice_protocol::MAX_TOP_COUNT);
    TopSummary {
        total: cap(summary.total),
        error: cap(summary.error).min(cap(summary.total)),
        keys: summary
            .keys
            .iter()
            .filter(|(key, _)| key.len() <= sluice_protocol::MAX_KEY_BYTES)
            .take(sluice_protocol::MAX_TOP_KEYS)
            .map(|(key, count)| TopKey {
                key: key.clone(),
                count: cap(*count).min(cap(summary.total)),
            })
            .collect(),
    }
}

/// The local log line of a rule's top denied keys over the last minute, at most `MAX_LINE_KEYS`
/// keys and each shown in at most [`MAX_SHOWN_KEY_CHARS`] characters (a key's parts joined by
/// `:`, control characters dropped): `None` when the rule denied nothing.
pub fn denied_line(rule: &str, denied: &Summary) -> Option<String> {
    if denied.total == 0 {
        return None;
    }
    let keys: Vec<String> = denied
        .keys
        .iter()
        .take(MAX_LINE_KEYS)
        .map(|(key, count)| format!("{}={count}", shown(key)))
        .collect();
    Some(format!(
        "sluice: rule {rule} denied {} request(s) in the last minute; top keys (each count at most {} short): {}",
        denied.total,
        denied.error,
        if keys.is_empty() {
            "none above the error".to_string()
        } else {
            keys.join(", ")
        }
    ))
}

/// Most keys a local log line shows.
pub const MAX_LINE_KEYS: usize = 10;
/// Most characters of one key a local log line shows.
pub const MAX_SHOWN_KEY_CHARS: usize = 80;

/// A key as a log line shows it: its parts joined by `:`, without control characters, cut to
/// [`MAX_SHOWN_KEY_CHARS`] (then ending in `…`).
pub fn shown(key: &str) -> String {
    let mut out = String::new();
    for (i, c) in key
        .chars()
        .map(|c| {
            if c == sluice_protocol::KEY_PART_SEPARATOR {
                ':'
            } else {
                c
            }
        })
        .filter(|c| !c.is_control())
        .enumerate()
    {
        if i == MAX_SHOWN_KEY_CHARS {
            out.push('…');
            break;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// SplitMix64: a seeded stream, the same on every run.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// `n` requests over `keys` keys, Zipf-distributed with exponent `s`, seeded.
    fn zipf(seed: u64, keys: usize, s: f64, n: usize) -> Vec<String> {
        let weights: Vec<f64> = (1..=keys).map(|r| 1.0 / (r as f64).powf(s)).collect();
        let sum: f64 = weights.iter().sum();
        let mut cdf = Vec::with_capacity(keys);
        let mut acc = 0.0;
        for w in &weights {
            acc += w / sum;
            cdf.push(acc);
        }
        let mut rng = Rng(seed);
        (0..n)
            .map(|_| {
                let u = rng.unit();
                let rank = cdf.partition_point(|&c| c < u).min(keys - 1);
                format!("api\u{1f}10.0.{}.{}", rank / 256, rank % 256)
            })
            .collect()
    }

    fn truth(stream: &[String]) -> HashMap<String, u64> {
        let mut counts = HashMap::new();
        for key in stream {
            *counts.entry(key.clone()).or_insert(0) += 1;
        }
        counts
    }

    fn fingerprint(key: &str) -> u64 {
        crate::limit::table::KeyHasher::new([7, 11]).fingerprint(key)
    }

    fn sketch(stream: &[String], k: usize) -> SpaceSaving {
        let mut s = SpaceSaving::new(k);
        for key in stream {
            s.offer(fingerprint(key), key);
        }
        s
    }

    /// Asserts the summary's guarantee against the true counts: every key within `error` below
    /// its true count and never above, `error` at most the total over `k`.
    fn assert_bounds(summary: &Summary, truth: &HashMap<String, u64>, n: u64, k: u64) {
        assert_eq!(summary.total, n);
        assert!(
            summary.error <= (n - summary.keys.iter().map(|(_, c)| c).sum::<u64>()) / k,
            "error {} over (N - counted) / k",
            summary.error
        );
        assert!(summary.error <= n / k);
        let listed: HashMap<&str, u64> =
            summary.keys.iter().map(|(k, c)| (k.as_str(), *c)).collect();
        for (key, &t) in truth {
            let c = listed.get(key.as_str()).copied().unwrap_or(0);
            assert!(c <= t, "{key:?}: count {c} over its true {t}");
            assert!(
                t - c <= summary.error,
                "{key:?}: count {c} more than {} short of its true {t}",
                summary.error
            );
        }
        for key in listed.keys() {
            assert!(truth.contains_key(*key), "{key:?} was never offered");
        }
    }

    #[test]
    fn space_saving_holds_its_bound_on_a_zipf_stream() {
        let n = 100_000;
        let stream = zipf(0x5eed, 5_000, 1.1, n);
        let truth = truth(&stream);
        for k in [8, 16, 64] {
            let s = sketch(&stream, k);
            let min = s.min();
            assert_eq!(s.total(), n as u64);
            assert!(min <= n as u64 / k as u64, "k {k}: min {min}");
            // Every key counted more than N / k holds a counter...
            let mut heavy = 0;
            for (key, &t) in &truth {
                if t > n as u64 / k as u64 {
                    heavy += 1;
                    assert!(
                        s.estimate(key).is_some(),
                        "k {k}: {key:?} ({t}) has no counter"
                    );
                }
                // ... and every key without a counter was counted at most `min` times.
                if s.estimate(key).is_none() {
                    assert!(t <= min, "k {k}: {key:?} ({t}) over the min {min}");
                }
            }
            assert!(heavy >= 1, "the stream has a heavy key for k {k}");
            // Every counter overestimates by at most its error, itself at most the min.
            for (key, &t) in &truth {
                if let Some((count, error)) = s.estimate(key) {
                    assert!(count >= t, "k {k}: {key:?} counted {count} under its {t}");
                    assert!(
                        count - t <= error,
                        "k {k}: {key:?} {count} - {t} over {error}"
                    );
                    assert!(error <= min, "k {k}: {key:?} error {error} over min {min}");
                }
            }
            // Its summary holds the mergeable form's bound.
            let mut s = s;
            let summary = s.take();
            assert_eq!(summary.error, min);
            assert_bounds(&summary, &truth, n as u64, k as u64);
            assert_eq!(s.total(), 0, "taken: emptied");
            assert_eq!(s.take().keys, Vec::new());
        }
    }

    #[test]
    fn the_heaviest_keys_come_first_with_exact_counts_when_few() {
        let stream: Vec<String> = ["a", "b", "a", "c", "a", "b"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let summary = sketch(&stream, 4).take();
        assert_eq!(summary.error, 0);
        assert_eq!(
            summary.keys,
            vec![("a".into(), 3), ("b".into(), 2), ("c".into(), 1)]
        );
    }

    #[test]
    fn merged_summaries_of_workers_and_proxies_keep_the_bound_of_their_total() {
        // Four proxies of two workers each, the stream dealt among them, their summaries merged
        // per proxy over 5 flushes (the workers' shared summary), then by the service.
        let n = 120_000;
        let stream = zipf(0xfeed, 8_000, 1.05, n);
        let truth = truth(&stream);
        let k = 16;
        let mut fleet = Summary::default();
        for proxy in 0..4 {
            let mut gathered = Summary::default();
            for flush in 0..5 {
                for worker in 0..2 {
                    let part: Vec<String> = stream
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| i % 40 == proxy * 10 + flush * 2 + worker)
                        .map(|(_, key)| key.clone())
                        .collect();
                    gathered.merge(&sketch(&part, k).take(), k);
                }
            }
            fleet.merge(&gathered, 32);
        }
        assert_bounds(&fleet, &truth, n as u64, k as u64);
        assert!(fleet.keys.len() <= 32);
        // The heaviest key of the stream leads.
        let heaviest = truth.iter().max_by_key(|(_, &c)| c).map(|(k, _)| k.clone());
        assert_eq!(fleet.keys.first().map(|(k, _)| k.clone()), heaviest);
    }

    #[test]
    fn a_merge_past_capacity_moves_the_cut_into_the_error() {
        let mut a = Summary {
            total: 30,
            error: 1,
            keys: vec![("x".into(), 10), ("y".into(), 5), ("z".into(), 2)],
        };
        let b = Summary {
            total: 20,
            error: 2,
            keys: vec![("y".into(), 6), ("w".into(), 4)],
        };
        a.merge(&b, 2);
        // y 11, x 10, w 4, z 2: the third, 4, is cut from every count.
        assert_eq!(a.keys, vec![("y".into(), 7), ("x".into(), 6)]);
        assert_eq!(a.error, 1 + 2 + 4);
        assert_eq!(a.total, 50);
    }

    #[test]
    fn counts_that_would_overflow_saturate() {
        let mut a = Summary {
            total: u64::MAX,
            error: u64::MAX,
            keys: vec![("x".into(), u64::MAX)],
        };
        a.merge(&a.clone(), 4);
        assert_eq!(a.keys, vec![("x".into(), u64::MAX)]);
        assert_eq!((a.total, a.error), (u64::MAX, u64::MAX));
    }

    #[test]
    fn workers_gather_in_shared_data_and_the_sync_takes_them_once() {
        let mut store = crate::store::MemoryStore::default();
        let mut one = RuleTop::new(4);
        one.denied.offer(1, "api\u{1f}a");
        one.admitted.offer(2, "api\u{1f}b");
        let mut two = RuleTop::new(4);
        two.denied.offer(1, "api\u{1f}a");
        publish(&mut store, "api", &one.take().unwrap(), 4).unwrap();
        publish(&mut store, "api", &two.take().unwrap(), 4).unwrap();
        assert_eq!(two.take(), None, "nothing counted since");
        let taken = take_shared(&mut store, "api").unwrap();
        assert_eq!(taken.denied.keys, vec![("api\u{1f}a".into(), 2)]);
        assert_eq!(taken.admitted.keys, vec![("api\u{1f}b".into(), 1)]);
        assert_eq!(take_shared(&mut store, "api"), None);
    }

    #[test]
    fn the_log_line_is_bounded() {
        let long = format!("api\u{1f}{}\u{7}", "x".repeat(300));
        let keys: Vec<(String, u64)> = (0..64).map(|i| (format!("{long}{i}"), 100 - i)).collect();
        let line = denied_line(
            "api",
            &Summary {
                total: 10_000,
                error: 3,
                keys,
            },
        )
        .unwrap();
        assert!(
            line.len() < 200 + MAX_LINE_KEYS * (MAX_SHOWN_KEY_CHARS * 3 + 16),
            "{}",
            line.len()
        );
        assert!(line.contains("api:xxx"), "{line}");
        assert!(!line.chars().any(char::is_control), "{line}");
        assert_eq!(line.matches('…').count(), MAX_LINE_KEYS);
        assert_eq!(denied_line("api", &Summary::default()), None);
    }

    fn decide(limiter: &crate::Limiter, ip: &str, now_us: u64, store: &mut dyn Store) -> bool {
        let mut request = crate::request::PlainRequest::get("/").from_ip(ip);
        let conditions = crate::Conditions {
            now_us,
            service_up: true,
            service_back_us: 0,
            load: Default::default(),
        };
        let evaluation = limiter.decide(&mut request, conditions, store);
        matches!(evaluation.decision, crate::Decision::Allow { .. })
    }

    #[test]
    fn a_rule_with_top_keys_counts_what_it_admits_and_denies_and_others_count_nothing() {
        let config = r#"{"rules": [
            {"name": "plain", "key": ["client_ip"], "limits": [{"requests": 1000, "per": "second"}]},
            {"name": "api", "key": ["client_ip"], "limits": [{"requests": 2, "per": "minute"}], "top_keys": 4}
        ]}"#;
        let limiter = crate::Limiter::new(crate::parse(config.as_bytes()).unwrap());
        assert!(limiter.counts_top());
        let mut store = crate::MemoryStore::default();
        let now = 1_700_000_000_000_000;
        let mut allowed = 0;
        for _ in 0..5 {
            allowed += decide(&limiter, "10.0.0.1", now, &mut store) as u32;
        }
        allowed += decide(&limiter, "10.0.0.2", now, &mut store) as u32;
        assert_eq!(allowed, 3);
        let taken = limiter.take_top();
        assert_eq!(taken.len(), 1, "only the rule with top_keys");
        let (id, taken) = &taken[0];
        assert_eq!(limiter.policy().rule(*id).unwrap().name, "api");
        assert_eq!(
            taken.admitted.keys,
            vec![
                ("api\u{1f}10.0.0.1".into(), 2),
                ("api\u{1f}10.0.0.2".into(), 1)
            ]
        );
        assert_eq!(taken.denied.keys, vec![("api\u{1f}10.0.0.1".into(), 3)]);
        assert_eq!((taken.admitted.total, taken.denied.total), (3, 3));
        assert!(limiter.take_top().is_empty(), "taken: emptied");

        let plain = crate::Limiter::new(
            crate::parse(
                br#"{"rules": [{"name": "plain", "key": ["client_ip"], "limits": [{"requests": 1, "per": "second"}]}]}"#,
            )
            .unwrap(),
        );
        decide(&plain, "10.0.0.1", now, &mut store);
        assert!(!plain.counts_top());
        assert!(plain.take_top().is_empty());
    }

    #[test]
    fn without_a_service_a_worker_logs_its_top_denied_keys_every_minute() {
        let config = r#"{"rules": [{"name": "api", "key": ["client_ip"], "limits": [{"requests": 1, "per": "hour"}], "top_keys": 4}]}"#;
        let limiter = crate::Limiter::new(crate::parse(config.as_bytes()).unwrap());
        let mut store = crate::MemoryStore::default();
        let start = 1_700_000_000_000_000;
        let mut last = 0;
        assert!(tick(&limiter, &mut last, start, &mut store).is_empty());
        for _ in 0..4 {
            decide(&limiter, "192.0.2.9", start + 1, &mut store);
        }
        assert!(tick(&limiter, &mut last, start + LOG_EVERY_US - 1, &mut store).is_empty());
        let lines = tick(&limiter, &mut last, start + LOG_EVERY_US, &mut store);
        assert_eq!(
            lines,
            vec!["sluice: rule api denied 3 request(s) in the last minute; top keys (each count at most 0 short): api:192.0.2.9=3".to_string()]
        );
        assert_eq!(
            store.get(&shared_key("api")),
            Ok(None),
            "nothing goes to shared data without a service"
        );
        assert!(tick(&limiter, &mut last, start + 2 * LOG_EVERY_US, &mut store).is_empty());
    }

    #[test]
    fn with_a_service_workers_publish_and_the_round_sends_their_merged_summary() {
        let config = r#"{"service": {"cluster": "svc"}, "rules": [{"name": "api", "key": ["client_ip"], "limits": [{"requests": 1, "per": "hour"}], "top_keys": 4, "consistency": "local"}]}"#;
        let policy = crate::parse(config.as_bytes()).unwrap();
        let (one, two) = (
            crate::Limiter::new(policy.clone()),
            crate::Limiter::new(policy),
        );
        let mut store = crate::MemoryStore::default();
        let start = 1_700_000_000_000_000;
        for worker in [&one, &two] {
            let mut last = 0;
            tick(worker, &mut last, start, &mut store);
            decide(worker, "192.0.2.9", start + 1, &mut store);
            decide(worker, "192.0.2.9", start + 1, &mut store);
            let lines = tick(worker, &mut last, start + PUBLISH_EVERY_US, &mut store);
            assert!(lines.is_empty(), "with a service nothing is logged");
        }
        let mut waiting = crate::sync::outbox::Pending::default();
        let batch = crate::sync::round::compose(&one, &mut waiting, "p", 100, &mut store).unwrap();
        let top = &batch.request.top;
        assert_eq!(top.len(), 1);
        assert_eq!(top[0].rule, "api");
        // The first request of the key was admitted on one worker; the table is shared.
        assert_eq!(top[0].admitted.total, 1);
        assert_eq!(top[0].denied.total, 3);
        assert_eq!(
            top[0].denied.keys,
            vec![TopKey {
                key: "api\u{1f}192.0.2.9".into(),
                count: 3
            }]
        );
        let again = crate::sync::round::compose(&one, &mut waiting, "p", 100, &mut store).unwrap();
        assert!(again.request.top.is_empty(), "sent once");
    }

    #[test]
    fn a_key_past_the_key_cap_is_counted_as_its_digest() {
        let config = r#"{"rules": [{"name": "api", "key": ["header:x-user"], "limits": [{"requests": 1, "per": "hour"}], "top_keys": 4}]}"#;
        let limiter = crate::Limiter::new(crate::parse(config.as_bytes()).unwrap());
        let mut store = crate::MemoryStore::default();
        let long = "u".repeat(4 * sluice_protocol::MAX_KEY_BYTES);
        for _ in 0..3 {
            let mut request = crate::request::PlainRequest::get("/").with_header("x-user", &long);
            let conditions = crate::Conditions {
                now_us: 1_700_000_000_000_000,
                service_up: true,
                service_back_us: 0,
                load: Default::default(),
            };
            limiter.decide(&mut request, conditions, &mut store);
        }
        let taken = limiter.take_top().remove(0).1;
        let (key, count) = &taken.denied.keys[0];
        assert_eq!(*count, 2);
        assert!(key.len() <= sluice_protocol::MAX_KEY_BYTES, "{}", key.len());
        assert!(key.starts_with("api\u{1f}"), "{key:?}");
        assert!(key.contains("sha256:"), "{key:?}");
        let wire = report("api", &taken);
        assert_eq!(wire.denied.keys[0].key, *key, "travels as the digest");
    }
}

//! The rate limit service's configuration (`--rls-config`): the descriptor format users of
//! envoyproxy/ratelimit already write, one domain per YAML document, and sluice's own
//! extensions on a `rate_limit` (`algorithm`, `burst`, `penalty`).
//!
//! ```yaml
//! domain: edge
//! descriptors:
//!   - key: remote_address          # no value: every address its own count
//!     rate_limit: {unit: minute, requests_per_unit: 60}
//!   - key: path
//!     value: /login
//!     rate_limit: {unit: minute, requests_per_unit: 5, algorithm: token_bucket, penalty: 10m}
//!     descriptors:
//!       - key: user
//!         rate_limit: {unit: hour, requests_per_unit: 20}
//! ```
//!
//! A request's descriptor is matched as envoyproxy/ratelimit matches it: entry by entry, each
//! level's `key` with the entry's `value` first, then a `value` ending in `*` whose prefix the
//! entry's value has, then the `key` alone (any value: each value counted apart); the limit is
//! the one of the node its last entry reaches (none if an entry finds no node). A limit named
//! by another matched limit's `replaces` does not apply to that request.
//!
//! An error names its field as a path (`descriptors[1].rate_limit.unit`), in the document it is
//! in (`document 2: ...`).

use std::collections::HashMap;

use serde::Deserialize;
use sluice_protocol::{AlgorithmSpec, Calendar, LimitSpec, MAX_KEY_BYTES, MAX_PENALTY_MS};

/// Most levels of nested descriptors (and so entries a request's descriptor may match).
pub const MAX_DEPTH: usize = 16;
/// Most descriptors in one configuration, all levels and domains together.
pub const MAX_NODES: usize = 10_000;
/// The most `requests_per_unit` can be (Envoy's field is 32 bits; sluice's buckets hold 2^31).
pub const MAX_REQUESTS: u64 = sluice_protocol::MAX_TOKENS;

/// A time unit of envoyproxy/ratelimit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
}

impl Unit {
    fn parse(text: &str) -> Option<Unit> {
        Some(match text.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            _ => return None,
        })
    }

    /// Its number in Envoy's `RateLimitResponse.RateLimit.Unit`.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Week => 7,
        }
    }

    fn millis(self) -> u64 {
        match self {
            Unit::Second => 1_000,
            Unit::Minute => 60_000,
            Unit::Hour => 3_600_000,
            Unit::Day => 86_400_000,
            Unit::Week => Calendar::Week.period_ms(),
            Unit::Month => Calendar::Month.period_ms(),
        }
    }
}

/// A limit of the configuration, ready to count.
#[derive(Debug, Clone, PartialEq)]
pub struct Limit {
    /// Its `name` (empty: none), what `replaces` names and the answer's `current_limit` says.
    pub name: String,
    pub unit: Unit,
    pub requests_per_unit: u64,
    /// How the service counts it: a fixed window of the unit by default, as envoyproxy/ratelimit
    /// counts (a week from Monday, a month from the 1st, UTC).
    pub spec: LimitSpec,
    /// `penalty`: how long a key stays denied once it went over (0: never).
    pub penalty_ms: u64,
    /// The names of the limits it replaces.
    pub replaces: Vec<String>,
}

/// What a descriptor leads to.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// `unlimited: true`: admitted, never counted.
    Unlimited,
    /// Counted against this limit.
    Limited(Limit),
}

/// A descriptor of the configuration.
#[derive(Debug, Default)]
struct Node {
    verdict: Option<Verdict>,
    shadow_mode: bool,
    detailed_metric: bool,
    children: Level,
}

/// The descriptors of one level, as a request's entry finds them.
#[derive(Debug, Default)]
struct Level {
    exact: HashMap<(String, String), Node>,
    /// `value: "prefix*"`: (key, prefix, node), in the configuration's order.
    prefixed: Vec<(String, String, Node)>,
    any: HashMap<String, Node>,
}

/// What one request descriptor matched: its verdict, and how to count and report it.
#[derive(Debug, Clone, PartialEq)]
pub struct Matched<'a> {
    pub verdict: &'a Verdict,
    pub shadow_mode: bool,
    pub detailed_metric: bool,
}

/// Every domain of the configuration.
#[derive(Debug, Default)]
pub struct Config {
    domains: HashMap<String, Level>,
}

impl Config {
    /// Reads a configuration: one or more YAML documents, each a domain.
    pub fn parse(text: &str) -> Result<Config, String> {
        let documents: Vec<serde_json::Value> = serde_saphyr::from_multiple(text)
            .map_err(|e| format!("not YAML: {}", first_line(&e.to_string())))?;
        let mut config = Config::default();
        let mut nodes = 0;
        let many = documents.len() > 1;
        for (i, document) in documents.into_iter().enumerate() {
            let at = |e: String| match many {
                true => format!("document {}: {e}", i + 1),
                false => e,
            };
            if document.is_null() {
                continue;
            }
            let raw: RawDomain = serde_path_to_error::deserialize(document).map_err(|e| {
                let path = e.path().to_string();
                at(format!("{path}: {}", first_line(&e.inner().to_string())))
            })?;
            if raw.domain.is_empty() || raw.domain.len() > MAX_KEY_BYTES {
                return Err(at(format!("domain: must be 1 to {MAX_KEY_BYTES} bytes")));
            }
            if config.domains.contains_key(&raw.domain) {
                return Err(at(format!("domain: {:?} is given twice", raw.domain)));
            }
            let level = read_level(&raw.descriptors, "descriptors", 1, &mut nodes).map_err(at)?;
            config.domains.insert(raw.domain, level);
        }
        Ok(config)
    }

    /// Whether `domain` is configured.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The node a request descriptor's entries (key, value) reach in `domain`, if it has a
    /// verdict.
    pub fn find<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Option<Matched<'a>> {
        let mut level = self.domains.get(domain)?;
        let mut node = None;
        for (key, value) in entries {
            let found = level
                .exact
                .get(&((*key).to_owned(), (*value).to_owned()))
                .or_else(|| {
                    level
                        .prefixed
                        .iter()
                        .find(|(k, prefix, _)| k == key && value.starts_with(prefix.as_str()))
                        .map(|(_, _, node)| node)
                })
                .or_else(|| level.any.get(*key))?;
            level = &found.children;
            node = Some(found);
        }
        let node = node?;
        Some(Matched {
            verdict: node.verdict.as_ref()?,
            shadow_mode: node.shadow_mode,
            detailed_metric: node.detailed_metric,
        })
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or(text)
}

fn read_level(
    descriptors: &[RawDescriptor],
    path: &str,
    depth: usize,
    nodes: &mut usize,
) -> Result<Level, String> {
    if depth > MAX_DEPTH {
        return Err(format!("{path}: nested deeper than {MAX_DEPTH} levels"));
    }
    let mut level = Level::default();
    for (i, raw) in descriptors.iter().enumerate() {
        let at = format!("{path}[{i}]");
        *nodes += 1;
        if *nodes > MAX_NODES {
            return Err(format!("{at}: more than {MAX_NODES} descriptors"));
        }
        if raw.key.is_empty() || raw.key.len() > MAX_KEY_BYTES {
            return Err(format!("{at}.key: must be 1 to {MAX_KEY_BYTES} bytes"));
        }
        if raw.value.as_ref().is_some_and(|v| v.len() > MAX_KEY_BYTES) {
            return Err(format!("{at}.value: longer than {MAX_KEY_BYTES} bytes"));
        }
        let verdict = match &raw.rate_limit {
            Some(rate_limit) => Some(limit(rate_limit, &format!("{at}.rate_limit"))?),
            None => None,
        };
        let node = Node {
            verdict,
            shadow_mode: raw.shadow_mode,
            detailed_metric: raw.detailed_metric,
            children: read_level(
                &raw.descriptors,
                &format!("{at}.descriptors"),
                depth + 1,
                nodes,
            )?,
        };
        let twice = || format!("{at}: key {:?} with this value is given twice", raw.key);
        match raw.value.as_deref() {
            None => {
                if level.any.insert(raw.key.clone(), node).is_some() {
                    return Err(twice());
                }
            }
            Some(value) => match value.strip_suffix('*') {
                Some(prefix) => {
                    let same = |(k, p, _): &(String, String, Node)| *k == raw.key && p == prefix;
                    if level.prefixed.iter().any(same) {
                        return Err(twice());
                    }
                    level
                        .prefixed
                        .push((raw.key.clone(), prefix.to_owned(), node));
                }
                None => {
                    let entry = (raw.key.clone(), value.to_owned());
                    if level.exact.insert(entry, node).is_some() {
                        return Err(twice());
                    }
                }
            },
        }
    }
    Ok(level)
}

fn limit(raw: &RawRateLimit, at: &str) -> Result<Verdict, String> {
    if raw.unlimited {
        let extra = [
            ("unit", raw.unit.is_some()),
            ("requests_per_unit", raw.requests_per_unit.is_some()),
            ("algorithm", raw.algorithm.is_some()),
            ("burst", raw.burst.is_some()),
            ("penalty", raw.penalty.is_some()),
        ];
        if let Some((field, _)) = extra.iter().find(|(_, given)| *given) {
            return Err(format!("{at}.{field}: not with unlimited: true"));
        }
        return Ok(Verdict::Unlimited);
    }
    let unit_text = raw
        .unit
        .as_deref()
        .ok_or_else(|| format!("{at}.unit: missing (second, minute, hour, day, week or month)"))?;
    let unit = Unit::parse(unit_text).ok_or_else(|| {
        format!("{at}.unit: {unit_text:?} is not second, minute, hour, day, week or month")
    })?;
    let requests = raw
        .requests_per_unit
        .ok_or_else(|| format!("{at}.requests_per_unit: missing"))?;
    if !(1..=MAX_REQUESTS).contains(&requests) {
        return Err(format!(
            "{at}.requests_per_unit: must be between 1 and {MAX_REQUESTS}"
        ));
    }
    let algorithm = match raw.algorithm.as_deref() {
        None | Some("fixed_window") => AlgorithmSpec::FixedWindow,
        Some("token_bucket") | Some("gcra") => AlgorithmSpec::TokenBucket,
        Some("sliding_window") => AlgorithmSpec::SlidingWindow,
        Some(other) => {
            return Err(format!(
            "{at}.algorithm: {other:?} is not fixed_window, sliding_window, token_bucket or gcra"
        ))
        }
    };
    let calendar = match unit {
        Unit::Week => Some(Calendar::Week),
        Unit::Month => Some(Calendar::Month),
        _ => None,
    };
    if calendar.is_some() && algorithm != AlgorithmSpec::FixedWindow {
        return Err(format!(
            "{at}.algorithm: a week or a month is a fixed window of the calendar"
        ));
    }
    let spec = match (algorithm, calendar) {
        (AlgorithmSpec::TokenBucket, _) => {
            let burst = raw.burst.unwrap_or(requests);
            if !(1..=MAX_REQUESTS).contains(&burst) {
                return Err(format!("{at}.burst: must be between 1 and {MAX_REQUESTS}"));
            }
            LimitSpec::token_bucket(requests, unit.millis(), burst)
        }
        (_, Some(calendar)) => LimitSpec::calendar(requests, calendar),
        (algorithm, None) => LimitSpec::window(algorithm, requests, unit.millis()),
    };
    if raw.burst.is_some() && algorithm != AlgorithmSpec::TokenBucket {
        return Err(format!("{at}.burst: only with algorithm: token_bucket"));
    }
    let penalty_ms = match raw.penalty.as_deref() {
        None => 0,
        Some(text) => penalty(text).ok_or_else(|| {
            format!("{at}.penalty: {text:?} is not a duration from 1s to 366d (\"10m\")")
        })?,
    };
    let mut replaces = Vec::new();
    for (j, replaced) in raw.replaces.iter().enumerate() {
        if replaced.name.is_empty() {
            return Err(format!("{at}.replaces[{j}].name: must not be empty"));
        }
        replaces.push(replaced.name.clone());
    }
    Ok(Verdict::Limited(Limit {
        name: raw.name.clone().unwrap_or_default(),
        unit,
        requests_per_unit: requests,
        spec,
        penalty_ms,
        replaces,
    }))
}

/// A duration of whole seconds, minutes, hours or days ("10m"), 1 s to 366 days.
fn penalty(text: &str) -> Option<u64> {
    let split = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(split);
    let unit_ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    let ms = number.parse::<u64>().ok()?.checked_mul(unit_ms)?;
    (1_000..=MAX_PENALTY_MS).contains(&ms).then_some(ms)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDomain {
    domain: String,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    descriptors: Vec<RawDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<RawReplace>,
    #[serde(default)]
    algorithm: Option<String>,
    #[serde(default)]
    burst: Option<u64>,
    #[serde(default)]
    penalty: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(config: &Config, domain: &str, entries: &[(&str, &str)]) -> Option<u64> {
        match config.find(domain, entries)?.verdict {
            Verdict::Limited(limit) => Some(limit.requests_per_unit),
            Verdict::Unlimited => Some(0),
        }
    }

    /// envoyproxy/ratelimit's README, example 3: nested descriptors, the default of a key, and
    /// only the last entry's node counting.
    #[test]
    fn nested_descriptors_match_as_envoyproxy_ratelimit_documents() {
        let config = Config::parse(
            r#"
domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 1000
  - key: source_cluster
    value: proxy
    descriptors:
      - key: destination_cluster
        value: bad_service
        rate_limit:
          unit: minute
          requests_per_unit: 1000
      - key: destination_cluster
        rate_limit:
          unit: minute
          requests_per_unit: 10
"#,
        )
        .unwrap();
        let d = "edge_proxy_per_ip";
        assert_eq!(
            limited(&config, d, &[("remote_address", "10.0.0.1")]),
            Some(10)
        );
        assert_eq!(
            limited(&config, d, &[("remote_address", "50.0.0.5")]),
            Some(1000)
        );
        let nested = [
            ("source_cluster", "proxy"),
            ("destination_cluster", "bad_service"),
        ];
        assert_eq!(limited(&config, d, &nested), Some(1000));
        let other = [("source_cluster", "proxy"), ("destination_cluster", "good")];
        assert_eq!(limited(&config, d, &other), Some(10));
        // the first level alone has no limit; an unknown source matches nothing
        assert_eq!(limited(&config, d, &[("source_cluster", "proxy")]), None);
        let unknown = [
            ("source_cluster", "mesh"),
            ("destination_cluster", "bad_service"),
        ];
        assert_eq!(limited(&config, d, &unknown), None);
        assert_eq!(limited(&config, "other", &[("remote_address", "x")]), None);
    }

    #[test]
    fn unlimited_prefixes_and_extensions() {
        let config = Config::parse(
            r#"
domain: d
descriptors:
  - key: key
    value: "api*"
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: token_bucket, burst: 10, penalty: 10m}
  - key: key
    value: internal
    rate_limit: {unlimited: true}
---
domain: e
descriptors:
  - key: month
    rate_limit: {unit: month, requests_per_unit: 1000000}
"#,
        )
        .unwrap();
        let matched = config.find("d", &[("key", "api-v2")]).unwrap();
        let Verdict::Limited(limit) = matched.verdict else {
            panic!("{matched:?}")
        };
        assert_eq!(limit.spec, LimitSpec::token_bucket(5, 60_000, 10));
        assert_eq!(limit.penalty_ms, 600_000);
        assert_eq!(limited(&config, "d", &[("key", "internal")]), Some(0));
        assert_eq!(limited(&config, "d", &[("key", "other")]), None);
        let matched = config.find("e", &[("month", "m")]).unwrap();
        let Verdict::Limited(limit) = matched.verdict else {
            panic!("{matched:?}")
        };
        assert_eq!(limit.spec, LimitSpec::calendar(1_000_000, Calendar::Month));
    }

    /// Every mistake is refused naming its field, in its document.
    #[test]
    fn errors_name_their_field() {
        let cases = [
            ("descriptors: []", "domain"),
            ("domain: d\nextra: 1", "unknown field `extra`"),
            (
                "domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight, requests_per_unit: 1}}]",
                "descriptors[0].rate_limit.unit: \"fortnight\"",
            ),
            (
                "domain: d\ndescriptors: [{key: k, rate_limit: {unit: second}}]",
                "descriptors[0].rate_limit.requests_per_unit: missing",
            ),
            (
                "domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 0}}]",
                "descriptors[0].rate_limit.requests_per_unit: must be between",
            ),
            (
                "domain: d\ndescriptors: [{key: k, rate_limit: {unlimited: true, unit: second}}]",
                "descriptors[0].rate_limit.unit: not with unlimited",
            ),
            (
                "domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1, burst: 5}}]",
                "descriptors[0].rate_limit.burst: only with algorithm: token_bucket",
            ),
            (
                "domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1, penalty: 10y}}]",
                "descriptors[0].rate_limit.penalty",
            ),
            (
                "domain: d\ndescriptors: [{key: k, value: v}, {key: k, value: v}]",
                "descriptors[1]: key \"k\" with this value is given twice",
            ),
            (
                "domain: d\ndescriptors: [{key: k, descriptors: [{key: \"\"}]}]",
                "descriptors[0].descriptors[0].key",
            ),
            (
                "domain: d\n---\ndomain: d",
                "document 2: domain: \"d\" is given twice",
            ),
            ("domain: [", "not YAML"),
        ];
        for (text, expected) in cases {
            let error = Config::parse(text).unwrap_err();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }

    /// A configuration nested past the bound is refused, not walked without end.
    #[test]
    fn depth_and_size_are_bounded() {
        let mut text = String::from("domain: d\ndescriptors:\n");
        for depth in 0..=MAX_DEPTH {
            let pad = "  ".repeat(2 * depth);
            text.push_str(&format!("{pad}  - key: k{depth}\n"));
            if depth < MAX_DEPTH {
                text.push_str(&format!("{pad}    descriptors:\n"));
            }
        }
        let error = Config::parse(&text).unwrap_err();
        assert!(error.contains("nested deeper than 16 levels"), "{error}");
        let many: String = (0..=MAX_NODES)
            .map(|i| format!("  - {{key: k, value: v{i}}}\n"))
            .collect();
        let error = Config::parse(&format!("domain: d\ndescriptors:\n{many}")).unwrap_err();
        assert!(error.contains("more than 10000 descriptors"), "{error}");
    }
}

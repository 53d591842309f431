//! Parsing and validating the JSON plugin configuration into a [`Policy`].
//!
//! Every error names the field it is about, as a path such as `rules[0].limits[1].per`.

mod shedding;

use std::fmt;

use serde::Deserialize;

use crate::limit::{Algorithm, Limit, Period};
use crate::net::Cidr;
use crate::policy::{
    Bypass, ClientIp, Consistency, Fallback, HeaderStyle, KeyPart, Matcher, Mode, Policy, Rule,
    Service,
};

/// Default per-rule key capacity of one proxy.
pub const DEFAULT_MAX_KEYS: u32 = 65_536;
/// Most memory one rule's sliding logs may take in a proxy (8 bytes per timestamp, `requests`
/// timestamps per key and limit, `max_keys` keys).
pub const MAX_LOG_BYTES: u64 = 64 << 20;
/// Default sync interval with the counter service.
pub const DEFAULT_SYNC_INTERVAL_MS: u64 = 100;

/// A configuration error: the field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.field, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

pub(crate) fn err(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        problem: problem.into(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    #[serde(default)]
    headers: Option<String>,
    #[serde(default)]
    bypass: Option<RawBypass>,
    #[serde(default)]
    client_ip: Option<RawClientIp>,
    #[serde(default)]
    rules: Vec<RawRule>,
    #[serde(default)]
    max_keys: Option<u32>,
    #[serde(default)]
    service: Option<RawService>,
    #[serde(default)]
    shedding: Option<shedding::RawShedding>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBypass {
    #[serde(default)]
    paths: Vec<String>,
    #[serde(default)]
    cidrs: Vec<String>,
    #[serde(default)]
    all: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientIp {
    #[serde(default)]
    trusted_hops: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    #[serde(default, rename = "match")]
    matcher: Option<RawMatch>,
    key: Vec<String>,
    limits: Vec<RawLimit>,
    #[serde(default)]
    mode: Option<String>,
    #[serde(default)]
    consistency: Option<String>,
    #[serde(default)]
    fallback: Option<RawFallback>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMatch {
    #[serde(default)]
    path_prefix: Option<String>,
    #[serde(default)]
    methods: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    requests: u64,
    per: String,
    #[serde(default)]
    burst: Option<u64>,
    #[serde(default)]
    algorithm: Option<String>,
    /// Leaky bucket: requests of a burst that pass at once.
    #[serde(default)]
    delay: Option<u32>,
    /// Leaky bucket: requests of a burst that wait for their slot.
    #[serde(default)]
    queue: Option<u32>,
    /// Leaky bucket: the longest a request waits.
    #[serde(default)]
    max_delay_ms: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFallback {
    policy: String,
    #[serde(default)]
    limits: Option<Vec<RawLimit>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawService {
    cluster: String,
    #[serde(default)]
    authority: Option<String>,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default)]
    sync_interval_ms: Option<u64>,
    #[serde(default)]
    breaker_failures: Option<u32>,
    #[serde(default)]
    breaker_cooldown_ms: Option<u64>,
}

/// Parses and validates a plugin configuration.
pub fn parse(json: &[u8]) -> Result<Policy, ConfigError> {
    if json.iter().all(u8::is_ascii_whitespace) {
        return Err(err(
            "",
            "the configuration is empty; expected a JSON object with \"rules\"",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(json);
    let raw: RawPolicy = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." { String::new() } else { path };
        err(field, e.into_inner().to_string())
    })?;
    validate(raw)
}

fn validate(raw: RawPolicy) -> Result<Policy, ConfigError> {
    let headers = match raw.headers.as_deref().unwrap_or("draft") {
        "none" => HeaderStyle::None,
        "legacy" => HeaderStyle::Legacy,
        "draft" => HeaderStyle::Draft,
        "both" => HeaderStyle::Both,
        other => {
            return Err(err(
                "headers",
                format!("expected one of none, legacy, draft, both, got {other:?}"),
            ))
        }
    };

    let bypass = match raw.bypass {
        None => Bypass::default(),
        Some(b) => {
            for (i, path) in b.paths.iter().enumerate() {
                if !path.starts_with('/') {
                    return Err(err(
                        format!("bypass.paths[{i}]"),
                        format!("must start with '/', got {path:?}"),
                    ));
                }
            }
            let cidrs = b
                .cidrs
                .iter()
                .enumerate()
                .map(|(i, c)| Cidr::parse(c).map_err(|p| err(format!("bypass.cidrs[{i}]"), p)))
                .collect::<Result<_, _>>()?;
            Bypass {
                paths: b.paths,
                cidrs,
                all: b.all,
            }
        }
    };

    let client_ip = ClientIp {
        trusted_hops: raw.client_ip.map_or(0, |c| c.trusted_hops),
    };
    if client_ip.trusted_hops > 32 {
        return Err(err("client_ip.trusted_hops", "must be at most 32"));
    }

    let max_keys = raw.max_keys.unwrap_or(DEFAULT_MAX_KEYS);
    if !(crate::table::WAYS as u32..=1_048_576).contains(&max_keys) {
        return Err(err(
            "max_keys",
            format!("must be between {} and 1048576", crate::table::WAYS),
        ));
    }

    let service = raw.service.map(service).transpose()?;

    let shedding = raw.shedding.map(shedding::shedding).transpose()?;
    if raw.rules.is_empty() && shedding.is_none() {
        return Err(err(
            "rules",
            "must hold at least one rule (or configure \"shedding\")",
        ));
    }
    let mut rules = Vec::with_capacity(raw.rules.len());
    for (i, r) in raw.rules.into_iter().enumerate() {
        let rule = rule(&format!("rules[{i}]"), r, service.is_some())?;
        if rules.iter().any(|other: &Rule| other.name == rule.name) {
            return Err(err(
                format!("rules[{i}].name"),
                format!(
                    "{:?} is used by an earlier rule; names must be unique",
                    rule.name
                ),
            ));
        }
        let log: usize = crate::limiter::bucket_limits(&rule)
            .iter()
            .map(Limit::log_len)
            .sum();
        let bytes = max_keys as u64 * 8 * log as u64;
        if bytes > MAX_LOG_BYTES {
            return Err(err(
                format!("rules[{i}].limits"),
                format!(
                    "its sliding logs keep {log} timestamps per key: {} MiB for max_keys {max_keys}, more than the {} MiB a rule may take; lower requests or max_keys",
                    bytes >> 20,
                    MAX_LOG_BYTES >> 20
                ),
            ));
        }
        rules.push(rule);
    }

    Ok(Policy {
        headers,
        bypass,
        client_ip,
        rules,
        max_keys,
        service,
        shedding,
    })
}

/// A request matcher; `at` is its field, e.g. `rules[0].match`.
pub(crate) fn matcher(at: &str, raw: Option<RawMatch>) -> Result<Matcher, ConfigError> {
    let Some(m) = raw else {
        return Ok(Matcher::default());
    };
    if let Some(prefix) = &m.path_prefix {
        if !prefix.starts_with('/') {
            return Err(err(
                format!("{at}.path_prefix"),
                format!("must start with '/', got {prefix:?}"),
            ));
        }
    }
    let mut methods = Vec::with_capacity(m.methods.len());
    for (j, method) in m.methods.iter().enumerate() {
        if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(err(
                format!("{at}.methods[{j}]"),
                format!("must be an HTTP method such as GET, got {method:?}"),
            ));
        }
        methods.push(method.to_ascii_uppercase());
    }
    Ok(Matcher {
        path_prefix: m.path_prefix,
        methods,
    })
}

fn rule(at: &str, raw: RawRule, have_service: bool) -> Result<Rule, ConfigError> {
    let name_ok = !raw.name.is_empty()
        && raw.name.len() <= 64
        && raw
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !name_ok {
        return Err(err(
            format!("{at}.name"),
            format!(
                "must be 1 to 64 characters of a-z, A-Z, 0-9, '-', '_', '.', got {:?}",
                raw.name
            ),
        ));
    }

    let matcher = matcher(&format!("{at}.match"), raw.matcher)?;

    if raw.key.is_empty() {
        return Err(err(
            format!("{at}.key"),
            "must hold at least one part (use [\"const:all\"] for one shared bucket)",
        ));
    }
    let key = raw
        .key
        .iter()
        .enumerate()
        .map(|(j, part)| key_part(part).map_err(|p| err(format!("{at}.key[{j}]"), p)))
        .collect::<Result<Vec<_>, _>>()?;

    let limits = limits(&format!("{at}.limits"), &raw.limits)?;

    let mode = match raw.mode.as_deref().unwrap_or("enforce") {
        "enforce" => Mode::Enforce,
        "shadow" => Mode::Shadow,
        other => {
            return Err(err(
                format!("{at}.mode"),
                format!("expected one of enforce, shadow, got {other:?}"),
            ))
        }
    };

    let default_consistency = if have_service { "cached" } else { "local" };
    let consistency = match raw.consistency.as_deref().unwrap_or(default_consistency) {
        "local" => Consistency::Local,
        "cached" => Consistency::Cached,
        "strict" => Consistency::Strict,
        other => {
            return Err(err(
                format!("{at}.consistency"),
                format!("expected one of local, cached, strict, got {other:?}"),
            ))
        }
    };
    if consistency != Consistency::Local && !have_service {
        return Err(err(
            format!("{at}.consistency"),
            "cached and strict need a top-level \"service\" section",
        ));
    }
    let fallback = match raw.fallback {
        None => Fallback::Open(limits.clone()),
        Some(f) => match f.policy.as_str() {
            "fail_open" => match &f.limits {
                Some(l) => Fallback::Open(self::limits(&format!("{at}.fallback.limits"), l)?),
                None => Fallback::Open(limits.clone()),
            },
            "fail_closed" => {
                if f.limits.is_some() {
                    return Err(err(
                        format!("{at}.fallback.limits"),
                        "fail_closed denies without limits; remove \"limits\" or use fail_open",
                    ));
                }
                Fallback::Closed
            }
            other => {
                return Err(err(
                    format!("{at}.fallback.policy"),
                    format!("expected one of fail_open, fail_closed, got {other:?}"),
                ))
            }
        },
    };

    // A shaper holds requests in one proxy: it has no meaning across proxies.
    let shaped = |l: &[Limit]| l.iter().any(|l| l.algorithm() == Algorithm::LeakyBucket);
    if consistency != Consistency::Local && shaped(&limits) {
        return Err(err(
            format!("{at}.consistency"),
            "leaky_bucket shapes the traffic of one proxy: local consistency only",
        ));
    }
    // A log is one timestamp per request: it is decided request by request, never leased.
    let logged = limits
        .iter()
        .any(|l| l.algorithm() == Algorithm::SlidingLog);
    if consistency == Consistency::Cached && logged {
        return Err(err(
            format!("{at}.consistency"),
            "sliding_log is exact, so it is decided per request: set consistency to strict (across proxies) or local; for a cached limit use sliding_window",
        ));
    }
    if let Fallback::Open(fallback) = &fallback {
        if consistency != Consistency::Local && shaped(fallback) {
            return Err(err(
                format!("{at}.fallback.limits"),
                "leaky_bucket shapes the traffic of one proxy: it cannot stand in for a shared limit",
            ));
        }
    }

    Ok(Rule {
        name: raw.name,
        matcher,
        key,
        limits,
        mode,
        consistency,
        fallback,
    })
}

fn limits(at: &str, raw: &[RawLimit]) -> Result<Vec<Limit>, ConfigError> {
    if raw.is_empty() {
        return Err(err(at, "must hold at least one limit"));
    }
    if raw.len() > 8 {
        return Err(err(at, "must hold at most 8 limits"));
    }
    let parsed = raw
        .iter()
        .enumerate()
        .map(|(k, l)| limit(&format!("{at}[{k}]"), l))
        .collect::<Result<Vec<Limit>, _>>()?;
    // One algorithm per list: a record's ghost speaks for all of its limits in one way.
    if let Some(first) = parsed.first() {
        if let Some(k) = parsed
            .iter()
            .position(|l| l.algorithm() != first.algorithm())
        {
            return Err(err(
                format!("{at}[{k}].algorithm"),
                format!(
                    "the limits of a rule share one algorithm ({} here); count another algorithm in another rule with the same key",
                    first.algorithm().name()
                ),
            ));
        }
    }
    Ok(parsed)
}

fn limit(at: &str, l: &RawLimit) -> Result<Limit, ConfigError> {
    let algorithm = match l.algorithm.as_deref() {
        None => Algorithm::TokenBucket,
        Some(name) => Algorithm::parse(name).ok_or_else(|| {
            err(
                format!("{at}.algorithm"),
                format!("expected one of {}, got {name:?}", Algorithm::NAMES),
            )
        })?,
    };
    let period = Period::parse(&l.per).ok_or_else(|| {
        err(
            format!("{at}.per"),
            format!("expected one of {}, got {:?}", Period::NAMES, l.per),
        )
    })?;
    let shaping_fields = [
        ("delay", l.delay.is_some()),
        ("queue", l.queue.is_some()),
        ("max_delay_ms", l.max_delay_ms.is_some()),
    ];
    if algorithm != Algorithm::LeakyBucket {
        if let Some((field, _)) = shaping_fields.iter().find(|(_, set)| *set) {
            return Err(err(
                format!("{at}.{field}"),
                format!(
                    "{field} shapes a leaky_bucket; this limit is a {}",
                    algorithm.name()
                ),
            ));
        }
    } else {
        if l.burst.is_some() {
            return Err(err(
                format!("{at}.burst"),
                "a leaky_bucket has no burst: `delay` requests of a burst pass at once, `queue` more wait",
            ));
        }
        let queue = l.queue.unwrap_or(0);
        let delay = l.delay.unwrap_or(0);
        if queue > 100_000 {
            return Err(err(format!("{at}.queue"), "must be at most 100000"));
        }
        let max_delay_ms = l.max_delay_ms.unwrap_or(10_000);
        if !(1..=60_000).contains(&max_delay_ms) {
            return Err(err(
                format!("{at}.max_delay_ms"),
                format!("must be between 1 and 60000, got {max_delay_ms}"),
            ));
        }
        let shaping = crate::limit::Shaping {
            delay,
            queue,
            max_delay_ms,
        };
        return Limit::leaky(l.requests, period, shaping).map_err(|problem| {
            let field = if problem.starts_with("week") {
                "per"
            } else {
                "requests"
            };
            err(format!("{at}.{field}"), problem)
        });
    }
    if algorithm == Algorithm::SlidingLog {
        if l.burst.is_some() {
            return Err(err(
                format!("{at}.burst"),
                "sliding_log admits `requests` in any span of `per` and has no burst; burst is for token_bucket and gcra",
            ));
        }
        return Limit::logged(l.requests, period).map_err(|problem| {
            let field = if problem.starts_with("week") {
                "per"
            } else {
                "requests"
            };
            err(format!("{at}.{field}"), problem)
        });
    }
    if algorithm.windowed() {
        if l.burst.is_some() {
            return Err(err(
                format!("{at}.burst"),
                format!(
                    "{} counts `requests` per window and has no burst; burst is for token_bucket and gcra",
                    algorithm.name()
                ),
            ));
        }
        return Limit::windowed(l.requests, period, algorithm).map_err(|problem| {
            let field = if problem.starts_with("week") {
                "per"
            } else {
                "requests"
            };
            err(format!("{at}.{field}"), problem)
        });
    }
    let limit = Limit::new(l.requests, period, l.burst).map_err(|problem| {
        let field = if problem.starts_with("burst") {
            "burst"
        } else if problem.starts_with("week") {
            "per"
        } else {
            "requests"
        };
        err(format!("{at}.{field}"), problem)
    })?;
    Ok(match algorithm {
        Algorithm::Gcra => limit.gcra(),
        _ => limit,
    })
}

fn key_part(part: &str) -> Result<KeyPart, String> {
    match part {
        "client_ip" => Ok(KeyPart::ClientIp),
        "path" => Ok(KeyPart::Path),
        "method" => Ok(KeyPart::Method),
        _ => {
            if let Some(name) = part.strip_prefix("header:") {
                let valid = !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
                if !valid {
                    return Err(format!("{part:?} does not name a header"));
                }
                Ok(KeyPart::Header(name.to_ascii_lowercase()))
            } else if let Some(value) = part.strip_prefix("const:") {
                Ok(KeyPart::Const(value.to_string()))
            } else {
                Err(format!(
                    "expected client_ip, path, method, header:NAME or const:VALUE, got {part:?}"
                ))
            }
        }
    }
}

fn service(raw: RawService) -> Result<Service, ConfigError> {
    if raw.cluster.is_empty() {
        return Err(err("service.cluster", "must name an Envoy cluster"));
    }
    let timeout_ms = raw.timeout_ms.unwrap_or(200);
    if !(1..=60_000).contains(&timeout_ms) {
        return Err(err("service.timeout_ms", "must be between 1 and 60000"));
    }
    let sync_interval_ms = raw.sync_interval_ms.unwrap_or(DEFAULT_SYNC_INTERVAL_MS);
    if !(10..=60_000).contains(&sync_interval_ms) {
        return Err(err(
            "service.sync_interval_ms",
            "must be between 10 and 60000",
        ));
    }
    let breaker_failures = raw.breaker_failures.unwrap_or(3);
    if breaker_failures == 0 {
        return Err(err("service.breaker_failures", "must be at least 1"));
    }
    let breaker_cooldown_ms = raw.breaker_cooldown_ms.unwrap_or(2_000);
    if !(10..=3_600_000).contains(&breaker_cooldown_ms) {
        return Err(err(
            "service.breaker_cooldown_ms",
            "must be between 10 and 3600000",
        ));
    }
    Ok(Service {
        authority: raw.authority.unwrap_or_else(|| raw.cluster.clone()),
        cluster: raw.cluster,
        token: raw.token.unwrap_or_default(),
        timeout_ms,
        sync_interval_ms,
        breaker_failures,
        breaker_cooldown_ms,
    })
}

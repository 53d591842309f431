//! Words for the policy's values: as the configuration writes them (`explain`), and for an
//! API's consumers (`docs`).

use sluice_core::limit::{Algorithm, Limit};
use sluice_core::limiter::key::{MARK, SEPARATOR};
use sluice_core::policy::{Consistency, Fallback, KeyPart, Mode, Rule};
use sluice_core::request::matcher::HeaderTest;

pub fn mode(mode: Mode) -> &'static str {
    match mode {
        Mode::Enforce => "enforce",
        Mode::Shadow => "monitor",
        Mode::Warn => "warn",
    }
}

pub fn consistency(consistency: Consistency) -> &'static str {
    match consistency {
        Consistency::Local => "local",
        Consistency::Cached => "cached",
        Consistency::Strict => "strict",
    }
}

/// A key as the limiter builds it, printable: its parts separated by `:`.
pub fn key(key: &str) -> String {
    key.chars()
        .map(|c| match c {
            SEPARATOR => ":".to_string(),
            MARK => "\\x1e".to_string(),
            c if c.is_control() => c.escape_default().to_string(),
            c => c.to_string(),
        })
        .collect()
}

/// `100 per minute, burst 20, token_bucket`.
pub fn limit(l: &Limit) -> String {
    if l.algorithm() == Algorithm::Concurrency {
        return format!(
            "{} in flight at once, max_hold {}, concurrency",
            l.requests(),
            l.period()
        );
    }
    let base = format!("{} per {}", l.requests(), l.period());
    match l.algorithm() {
        Algorithm::TokenBucket | Algorithm::Gcra => {
            format!("{base}, burst {}, {}", l.burst(), l.algorithm().name())
        }
        Algorithm::LeakyBucket => {
            let s = l.shaping();
            format!(
                "{base}, delay {}, queue {}, max_delay_ms {}, leaky_bucket",
                s.delay, s.queue, s.max_delay_ms
            )
        }
        other => format!("{base}, {}", other.name()),
    }
}

pub fn limits(limits: &[Limit]) -> String {
    limits.iter().map(limit).collect::<Vec<_>>().join("; ")
}

/// What a cached or strict rule does without the counter service.
pub fn fallback(rule: &Rule) -> Option<String> {
    if rule.consistency == Consistency::Local {
        return None;
    }
    Some(match (&rule.fallback, &rule.share) {
        (Fallback::Open(l), Some(share)) => format!(
            "fail_open with the rule's limits divided among the proxies the counter service counts, believed up to {} (share: fleet; each rounded up, at least one request); until it answers a count, {}: {}",
            share.max_proxies,
            match share.assume_proxies {
                1 => "the whole limit (1 proxy assumed)".to_string(),
                n => format!("{n} proxies assumed"),
            },
            limits(l)
        ),
        (Fallback::Open(l), None) => format!("fail_open with {}", limits(l)),
        (Fallback::Closed, _) => "fail_closed (deny, 503)".to_string(),
    })
}

pub fn header_test(name: &str, test: &HeaderTest) -> String {
    match test {
        HeaderTest::Present => format!("{name} present"),
        HeaderTest::Absent => format!("{name} absent"),
        HeaderTest::Equals(value) => format!("{name} = {value:?}"),
    }
}

/// `1,000,000`.
pub fn number(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A period for an API's consumers: its name, or a duration in words (`15 minutes`).
pub fn period_for_consumers(period: sluice_core::limit::Period) -> String {
    use sluice_core::limit::Period;
    let Period::Every(seconds) = period else {
        return period.to_string();
    };
    let (count, unit) = [(86_400, "day"), (3_600, "hour"), (60, "minute")]
        .into_iter()
        .find(|(scale, _)| seconds % scale == 0)
        .map_or((seconds, "second"), |(scale, unit)| (seconds / scale, unit));
    if count == 1 {
        unit.to_string()
    } else {
        format!("{} {unit}s", number(count as u64))
    }
}

/// A limit for an API's consumers: `100 per minute, bursts of up to 20`.
pub fn limit_for_consumers(l: &Limit) -> String {
    use sluice_core::limit::Period;

    let period = period_for_consumers(l.period());
    let base = format!("{} per {period}", number(l.requests()));
    match l.algorithm() {
        Algorithm::TokenBucket | Algorithm::Gcra if l.burst() != l.requests() => {
            format!("{base}, bursts of up to {}", number(l.burst()))
        }
        Algorithm::TokenBucket | Algorithm::Gcra => base,
        Algorithm::FixedWindow => {
            let reset = match l.period() {
                Period::Second => "every second",
                Period::Minute => "at the start of each minute",
                Period::Hour => "at the start of each hour (UTC)",
                Period::Day => "daily at 00:00 UTC",
                Period::Week => "Mondays at 00:00 UTC",
                Period::Month => "on the 1st of each month at 00:00 UTC",
                Period::Every(_) => {
                    return format!(
                        "{base}, resets every {period} counted from 1970-01-01 00:00 UTC"
                    )
                }
            };
            format!("{base}, resets {reset}")
        }
        Algorithm::SlidingWindow => format!("{base} (sliding window)"),
        Algorithm::SlidingLog => format!(
            "{} in any {}",
            number(l.requests()),
            match l.period() {
                p @ (Period::Second | Period::Minute | Period::Hour | Period::Day) => p.to_string(),
                Period::Every(_) => period,
                p => format!("{p} window"),
            }
        ),
        Algorithm::Concurrency => {
            let noun = if l.requests() == 1 {
                "request"
            } else {
                "requests"
            };
            format!(
                "{} {noun} in flight at once (a further one is answered 429, Retry-After: 1)",
                number(l.requests())
            )
        }
        Algorithm::LeakyBucket => {
            let s = l.shaping();
            if s.queue == 0 {
                format!(
                    "{base}, paced (up to {} at once)",
                    number(1 + s.delay as u64)
                )
            } else {
                format!(
                    "{base}, paced (up to {} at once; {} more wait up to {} ms)",
                    number(1 + s.delay as u64),
                    number(s.queue as u64),
                    number(s.max_delay_ms as u64)
                )
            }
        }
    }
}

/// A key part for an API's consumers.
pub fn key_part_for_consumers(part: &KeyPart) -> String {
    match part {
        KeyPart::ClientIp => "client IP".to_string(),
        KeyPart::ClientIpPrefix { v4, v6 } => format!("client network (IPv4 /{v4}, IPv6 /{v6})"),
        KeyPart::Header(name) => format!("header `{name}`"),
        KeyPart::Query { name, .. } => format!("query parameter `{name}`"),
        KeyPart::Claim(name) => format!("token claim `{name}`"),
        KeyPart::Cookie(name) => format!("cookie `{name}`"),
        KeyPart::Path => "path".to_string(),
        KeyPart::Method => "method".to_string(),
        KeyPart::Const(_) => "everyone together".to_string(),
        KeyPart::First(alternatives) => alternatives
            .iter()
            .map(key_part_for_consumers)
            .collect::<Vec<_>>()
            .join(", else "),
    }
}

/// What a rule counts together, for an API's consumers.
pub fn key_for_consumers(parts: &[KeyPart]) -> String {
    let own: Vec<String> = parts
        .iter()
        .filter(|p| !matches!(p, KeyPart::Const(_)))
        .map(key_part_for_consumers)
        .collect();
    if own.is_empty() {
        "everyone together".to_string()
    } else {
        own.join(" + ")
    }
}

/// A penalty's length as configured: its largest whole unit (`10m`, `90s`).
pub fn penalty(micros: u64) -> String {
    let seconds = micros / 1_000_000;
    match sluice_core::Period::from_seconds(seconds) {
        Ok(period) => period.name().into_owned(),
        Err(_) => format!("{seconds}s"),
    }
}

/// A rule's `scale`: `×0.5 at high, ×0.25 at critical (the proxy's level)`.
pub fn scale(scale: &sluice_core::limit::dynamic::Scale) -> String {
    let factors: Vec<String> = [
        ("elevated", scale.elevated),
        ("high", scale.high),
        ("critical", scale.critical),
    ]
    .iter()
    .filter(|(_, f)| *f < 1.0)
    .map(|(name, f)| format!("×{f} at {name}"))
    .collect();
    let whose = match scale.level {
        sluice_core::limit::dynamic::LevelSource::Proxy => "the proxy's level",
        sluice_core::limit::dynamic::LevelSource::Fleet => "the fleet's level",
    };
    if factors.is_empty() {
        return format!("none ({whose}: every factor is 1)");
    }
    format!(
        "{} ({whose}; rounded up to at least 1 request and the cost)",
        factors.join(", ")
    )
}

/// A schedule's window: `22:00-06:00 UTC: 100 requests per minute`.
pub fn window(window: &sluice_core::limit::dynamic::Window) -> String {
    let limits: Vec<String> = window.limits.iter().map(limit).collect();
    format!("{} UTC: {}", window.utc(), limits.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_core::limit::Period;

    #[test]
    fn numbers_have_thousands_separators() {
        assert_eq!(number(7), "7");
        assert_eq!(number(1000), "1,000");
        assert_eq!(number(100_000), "100,000");
        assert_eq!(number(1_000_000), "1,000,000");
    }

    #[test]
    fn limits_read_as_configured() {
        let l = Limit::new(100, Period::Minute, Some(20)).unwrap();
        assert_eq!(limit(&l), "100 per minute, burst 20, token_bucket");
        assert_eq!(
            limit_for_consumers(&l),
            "100 per minute, bursts of up to 20"
        );
        let w = Limit::windowed(10_000, Period::Day, Algorithm::FixedWindow).unwrap();
        assert_eq!(limit(&w), "10000 per day, fixed_window");
        assert_eq!(
            limit_for_consumers(&w),
            "10,000 per day, resets daily at 00:00 UTC"
        );
    }

    #[test]
    fn keys_show_their_separators_as_colons() {
        assert_eq!(key("per-ip\u{1f}203.0.113.7"), "per-ip:203.0.113.7");
        assert_eq!(key("r\u{1f}\u{1e}many"), "r:\\x1emany");
    }
}

//! Rendering rate-limit headers and the 429 body from a [`Quota`].

use crate::decision::Quota;
use crate::policy::HeaderStyle;

/// Whole seconds, rounded up.
pub fn ceil_seconds(micros: u64) -> u64 {
    micros.div_ceil(1_000_000)
}

/// The `Retry-After` value: whole seconds, rounded up, at least 1.
pub fn retry_after_seconds(micros: u64) -> u64 {
    ceil_seconds(micros).max(1)
}

/// The rate-limit headers for `quota` in `style`.
pub fn render(style: HeaderStyle, rule: &str, quota: &Quota) -> Vec<(&'static str, String)> {
    let mut headers = Vec::with_capacity(5);
    let reset = ceil_seconds(quota.reset_us);
    if style.legacy() {
        headers.push(("x-ratelimit-limit", quota.limit.requests().to_string()));
        headers.push(("x-ratelimit-remaining", quota.remaining.to_string()));
        headers.push(("x-ratelimit-reset", reset.to_string()));
    }
    if style.draft() {
        headers.push((
            "ratelimit-policy",
            format!(
                "\"{rule}\";q={};w={}",
                quota.limit.requests(),
                quota.limit.period().seconds()
            ),
        ));
        headers.push((
            "ratelimit",
            format!("\"{rule}\";r={};t={reset}", quota.remaining),
        ));
    }
    headers
}

/// The JSON body of a 429. Rule names are validated to `[A-Za-z0-9._-]`, so nothing in it
/// needs escaping.
pub fn denial_body(rule: &str, quota: &Quota, retry_after: u64) -> String {
    format!(
        "{{\"error\":\"rate_limited\",\"rule\":\"{rule}\",\"message\":\"rate limit exceeded: {} requests per {} for rule {rule}; retry in {retry_after} s\",\"retryAfter\":{retry_after}}}",
        quota.limit.requests(),
        quota.limit.period(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Limit, Period};

    fn quota() -> Quota {
        Quota {
            limit: Limit::new(100, Period::Minute, Some(20)).unwrap(),
            remaining: 17,
            reset_us: 3_000_001,
        }
    }

    #[test]
    fn draft_headers() {
        let h = render(HeaderStyle::Draft, "per-ip", &quota());
        assert_eq!(
            h,
            vec![
                ("ratelimit-policy", "\"per-ip\";q=100;w=60".to_string()),
                ("ratelimit", "\"per-ip\";r=17;t=4".to_string()),
            ]
        );
    }

    #[test]
    fn legacy_headers() {
        let h = render(HeaderStyle::Legacy, "per-ip", &quota());
        assert_eq!(h[0], ("x-ratelimit-limit", "100".to_string()));
        assert_eq!(h[1], ("x-ratelimit-remaining", "17".to_string()));
        assert_eq!(h[2], ("x-ratelimit-reset", "4".to_string()));
        assert!(render(HeaderStyle::None, "per-ip", &quota()).is_empty());
        assert_eq!(render(HeaderStyle::Both, "per-ip", &quota()).len(), 5);
    }

    #[test]
    fn retry_after_is_at_least_one_second() {
        assert_eq!(retry_after_seconds(0), 1);
        assert_eq!(retry_after_seconds(1_000_000), 1);
        assert_eq!(retry_after_seconds(1_000_001), 2);
    }

    #[test]
    fn body_is_json_with_the_rule() {
        let body: serde_json::Value =
            serde_json::from_str(&denial_body("per-ip", &quota(), 4)).unwrap();
        assert_eq!(body["error"], "rate_limited");
        assert_eq!(body["rule"], "per-ip");
        assert_eq!(body["retryAfter"], 4);
        assert!(body["message"]
            .as_str()
            .unwrap()
            .contains("100 requests per minute"));
    }
}

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
    render_into(&mut headers, style, rule, quota);
    headers
}

/// [`render`], appended to `headers`.
pub fn render_into(
    headers: &mut Vec<(&'static str, String)>,
    style: HeaderStyle,
    rule: &str,
    quota: &Quota,
) {
    each_header(style, rule, quota, &mut |name, value| {
        headers.push((name, value.to_string()))
    });
}

/// [`render`], one header at a time: what the filter uses on every admitted request, with no
/// allocation for the legacy headers (numbers are written on the stack).
pub fn each_header(
    style: HeaderStyle,
    rule: &str,
    quota: &Quota,
    header: &mut dyn FnMut(&'static str, &str),
) {
    let reset = ceil_seconds(quota.reset_us);
    let requests = quota.limit.requests();
    let remaining = quota.remaining;
    if style.legacy() {
        header("x-ratelimit-limit", itoa::Buffer::new().format(requests));
        header(
            "x-ratelimit-remaining",
            itoa::Buffer::new().format(remaining),
        );
        header("x-ratelimit-reset", itoa::Buffer::new().format(reset));
    }
    if style.draft() {
        fn quoted(value: &mut String, rule: &str, parts: [(&str, u64); 2]) {
            value.clear();
            value.push('"');
            value.push_str(rule);
            value.push('"');
            for (name, n) in parts {
                value.push(';');
                value.push_str(name);
                value.push('=');
                value.push_str(itoa::Buffer::new().format(n));
            }
        }
        let mut value = String::with_capacity(rule.len() + 32);
        let window = quota.limit.period().seconds();
        quoted(&mut value, rule, [("q", requests), ("w", window)]);
        header("ratelimit-policy", &value);
        quoted(&mut value, rule, [("r", remaining), ("t", reset)]);
        header("ratelimit", &value);
    }
}

/// The JSON body of a 429. Rule names are validated to `[A-Za-z0-9._-]`, so nothing in it
/// needs escaping.
pub fn denial_body(rule: &str, quota: &Quota, retry_after: u64) -> String {
    // Written piece by piece: it is sent on every denial, and the formatting machinery costs
    // more than the rest of the decision.
    let mut requests = itoa::Buffer::new();
    let requests = requests.format(quota.limit.requests());
    let mut retry = itoa::Buffer::new();
    let retry = retry.format(retry_after);
    let period = quota.limit.period().name();
    let mut body = String::with_capacity(160 + 2 * rule.len());
    for piece in [
        "{\"error\":\"rate_limited\",\"rule\":\"",
        rule,
        "\",\"message\":\"rate limit exceeded: ",
        requests,
        " requests per ",
        period,
        " for rule ",
        rule,
        "; retry in ",
        retry,
        " s\",\"retryAfter\":",
        retry,
        "}",
    ] {
        body.push_str(piece);
    }
    body
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
        assert_eq!(
            denial_body("per-ip", &quota(), 4),
            r#"{"error":"rate_limited","rule":"per-ip","message":"rate limit exceeded: 100 requests per minute for rule per-ip; retry in 4 s","retryAfter":4}"#
        );
    }
}

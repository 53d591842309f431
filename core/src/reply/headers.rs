//! Rendering rate-limit headers from a [`Quota`], and a local reply's headers as the host reads
//! them. The local replies themselves are built in [`crate::reply`].

use crate::limiter::decision::Quota;
use crate::policy::HeaderStyle;

/// Whole seconds, rounded up.
pub fn ceil_seconds(micros: u64) -> u64 {
    micros.div_ceil(1_000_000)
}

/// The `Retry-After` value: whole seconds, rounded up, at least 1.
pub fn retry_after_seconds(micros: u64) -> u64 {
    ceil_seconds(micros).max(1)
}

/// How `X-RateLimit-Reset` is written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Reset {
    /// Seconds until the quota is whole again, rounded up.
    #[default]
    Seconds,
    /// The Unix time, in seconds rounded up, at which it is whole again, the quota having been
    /// read at `now_us` (microseconds since the epoch).
    UnixAt { now_us: u64 },
}

impl Reset {
    /// As the policy's `format` says, the quota read at `now_us`.
    pub fn of(format: crate::policy::ResetFormat, now_us: u64) -> Reset {
        match format {
            crate::policy::ResetFormat::Seconds => Reset::Seconds,
            crate::policy::ResetFormat::Unix => Reset::UnixAt { now_us },
        }
    }

    fn value(self, reset_us: u64) -> u64 {
        match self {
            Reset::Seconds => ceil_seconds(reset_us),
            Reset::UnixAt { now_us } => ceil_seconds(now_us.saturating_add(reset_us)),
        }
    }
}

/// The rate-limit headers for `quota` in `style`.
pub fn render(
    style: HeaderStyle,
    rule: &str,
    quota: &Quota,
    reset: Reset,
) -> Vec<(&'static str, String)> {
    let mut headers = Vec::with_capacity(5);
    each_header(style, rule, quota, reset, &mut |name, value| {
        headers.push((name, value.to_string()))
    });
    headers
}

/// [`render`], appended to a local reply's headers.
pub fn render_into(
    headers: &mut ReplyHeaders,
    style: HeaderStyle,
    rule: &str,
    quota: &Quota,
    reset: Reset,
) {
    each_header(style, rule, quota, reset, &mut |name, value| {
        headers.push(name, value);
    });
}

/// A local reply's headers, held as the one buffer a proxy-wasm host reads them from (its
/// serialized header map: the count, each pair's name and value sizes, then every name and
/// value followed by a NUL, numbers little-endian `u32`). A 429 makes one allocation for its
/// headers instead of one per header, one for the list and one to serialize them for the host;
/// and a reply stays as small as with a vector: the step that carries it is moved on every
/// request, admitted or not.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ReplyHeaders {
    /// Empty, or the serialized map.
    map: Vec<u8>,
}

impl ReplyHeaders {
    /// Room for `bytes` of the serialized map before the first reallocation.
    pub fn with_capacity(bytes: usize) -> ReplyHeaders {
        ReplyHeaders {
            map: Vec::with_capacity(bytes),
        }
    }

    /// Adds a header (sluice's own: a fixed name, a value it wrote).
    pub fn push(&mut self, name: &'static str, value: &str) {
        let count = self.len();
        if self.map.is_empty() {
            self.map.extend_from_slice(&[0; 4]);
        }
        // The new pair's sizes go at the end of the table, before every name and value.
        let table_end = 4 + 8 * count;
        let end = self.map.len();
        self.map.resize(end + 8, 0);
        self.map.copy_within(table_end..end, table_end + 8);
        self.map[table_end..table_end + 4].copy_from_slice(&size(name.len()));
        self.map[table_end + 4..table_end + 8].copy_from_slice(&size(value.len()));
        self.map.extend_from_slice(name.as_bytes());
        self.map.push(0);
        self.map.extend_from_slice(value.as_bytes());
        self.map.push(0);
        self.map[..4].copy_from_slice(&size(count + 1));
    }

    /// The headers, (name, value), in the order they were added.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + Clone + '_ {
        let map = &self.map;
        let mut data = 4 + 8 * self.len();
        (0..self.len()).map(move |i| {
            let mut text = |len: usize| {
                let text = map
                    .get(data..data + len)
                    .and_then(|b| std::str::from_utf8(b).ok());
                data += len + 1;
                text.unwrap_or("")
            };
            let name = text(u32_at(map, 4 + 8 * i));
            let value = text(u32_at(map, 8 + 8 * i));
            (name, value)
        })
    }

    /// The first value of header `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        u32_at(&self.map, 0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The serialized header map, as the host reads it.
    pub fn serialized(&self) -> &[u8] {
        match self.map.is_empty() {
            true => &[0; 4],
            false => &self.map,
        }
    }
}

fn size(len: usize) -> [u8; 4] {
    (len as u32).to_le_bytes()
}

/// The little-endian `u32` at `at`, 0 past the end.
fn u32_at(bytes: &[u8], at: usize) -> usize {
    bytes
        .get(at..at + 4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, |b| u32::from_le_bytes(b) as usize)
}

impl std::fmt::Debug for ReplyHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// [`render`], one header at a time: what the filter uses on every admitted request, with no
/// allocation for the legacy headers (numbers are written on the stack).
pub fn each_header(
    style: HeaderStyle,
    rule: &str,
    quota: &Quota,
    legacy_reset: Reset,
    header: &mut dyn FnMut(&'static str, &str),
) {
    // The draft's `t` is always seconds from now.
    let reset = ceil_seconds(quota.reset_us);
    let requests = quota.limit.requests();
    let remaining = quota.remaining;
    if style.legacy() {
        header("x-ratelimit-limit", itoa::Buffer::new().format(requests));
        header(
            "x-ratelimit-remaining",
            itoa::Buffer::new().format(remaining),
        );
        let legacy = legacy_reset.value(quota.reset_us);
        header("x-ratelimit-reset", itoa::Buffer::new().format(legacy));
    }
    if style.draft() {
        fn quoted<const N: usize>(value: &mut String, rule: &str, parts: [(&str, u64); N]) {
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
        if quota.limit.algorithm() == crate::limit::Algorithm::Concurrency {
            // Requests in flight, not per a window: the draft's quota unit says so, and there
            // is no `w`.
            quoted(&mut value, rule, [("q", requests)]);
            value.push_str(";qu=\"concurrent-requests\"");
        } else {
            let window = quota.limit.period().seconds();
            quoted(&mut value, rule, [("q", requests), ("w", window)]);
        }
        header("ratelimit-policy", &value);
        quoted(&mut value, rule, [("r", remaining), ("t", reset)]);
        header("ratelimit", &value);
    }
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
        let h = render(HeaderStyle::Draft, "per-ip", &quota(), Reset::Seconds);
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
        let h = render(HeaderStyle::Legacy, "per-ip", &quota(), Reset::Seconds);
        assert_eq!(h[0], ("x-ratelimit-limit", "100".to_string()));
        assert_eq!(h[1], ("x-ratelimit-remaining", "17".to_string()));
        assert_eq!(h[2], ("x-ratelimit-reset", "4".to_string()));
        assert!(render(HeaderStyle::None, "per-ip", &quota(), Reset::Seconds).is_empty());
        assert_eq!(
            render(HeaderStyle::Both, "per-ip", &quota(), Reset::Seconds).len(),
            5
        );
    }

    #[test]
    fn the_legacy_reset_can_be_a_unix_time() {
        // Read at 1,700,000,000.5 s, whole again 3.000001 s later: at 1,700,000,003.500001 s.
        let now_us = 1_700_000_000_500_000;
        let h = render(
            HeaderStyle::Both,
            "per-ip",
            &quota(),
            Reset::UnixAt { now_us },
        );
        assert_eq!(h[2], ("x-ratelimit-reset", "1700000004".to_string()));
        assert_eq!(
            h[4],
            ("ratelimit", "\"per-ip\";r=17;t=4".to_string()),
            "t: seconds"
        );
        let far = render(
            HeaderStyle::Legacy,
            "r",
            &quota(),
            Reset::UnixAt { now_us: u64::MAX },
        );
        assert_eq!(
            far[2].1,
            (u64::MAX / 1_000_000 + 1).to_string(),
            "no overflow"
        );
    }

    #[test]
    fn reply_headers_read_back_in_order() {
        let mut reply = ReplyHeaders::with_capacity(8);
        assert!(reply.is_empty());
        assert_eq!(reply.serialized(), [0, 0, 0, 0], "no headers: a count of 0");
        reply.push("retry-after", "7");
        reply.push("content-type", "application/json");
        reply.push("x-empty", "");
        render_into(
            &mut reply,
            HeaderStyle::Both,
            "per-ip",
            &quota(),
            Reset::Seconds,
        );
        let pairs: Vec<(&str, String)> = reply.iter().map(|(n, v)| (n, v.to_string())).collect();
        let mut expected = vec![
            ("retry-after", "7".to_string()),
            ("content-type", "application/json".to_string()),
            ("x-empty", String::new()),
        ];
        expected.extend(render(
            HeaderStyle::Both,
            "per-ip",
            &quota(),
            Reset::Seconds,
        ));
        assert_eq!(pairs, expected);
        assert_eq!(reply.len(), 8);
        assert_eq!(reply.get("retry-after"), Some("7"));
        assert_eq!(reply.get("x-empty"), Some(""));
        assert_eq!(reply.get("x-none"), None);
        // The serialized map: the count, the sizes, then the NUL-terminated names and values.
        let map = reply.serialized();
        assert_eq!(map[..12], [8, 0, 0, 0, 11, 0, 0, 0, 1, 0, 0, 0]);
        assert!(map[4 + 8 * 8..].starts_with(b"retry-after\x007\x00content-type\x00"));
        assert_eq!(
            format!("{reply:?}")[..41].to_string(),
            r#"[("retry-after", "7"), ("content-type", ""#
        );
    }

    /// A concurrent limit's policy names its unit (requests in flight) and no window: its
    /// `max_hold` is no window of a rate.
    #[test]
    fn a_concurrent_limit_says_so_and_names_no_window() {
        let quota = Quota {
            limit: Limit::concurrent(10, Period::Every(600)).unwrap(),
            remaining: 3,
            reset_us: 1_000_000,
        };
        let h = render(HeaderStyle::Both, "inflight", &quota, Reset::Seconds);
        assert_eq!(
            h,
            vec![
                ("x-ratelimit-limit", "10".to_string()),
                ("x-ratelimit-remaining", "3".to_string()),
                ("x-ratelimit-reset", "1".to_string()),
                (
                    "ratelimit-policy",
                    "\"inflight\";q=10;qu=\"concurrent-requests\"".to_string()
                ),
                ("ratelimit", "\"inflight\";r=3;t=1".to_string()),
            ]
        );
    }

    #[test]
    fn retry_after_is_at_least_one_second() {
        assert_eq!(retry_after_seconds(0), 1);
        assert_eq!(retry_after_seconds(1_000_000), 1);
        assert_eq!(retry_after_seconds(1_000_001), 2);
    }
}

//! Building a rule's key from a request.

use std::fmt::Write;
use std::net::IpAddr;

use sha2::{Digest, Sha256};

use crate::policy::{KeyPart, Rule};
use crate::request::RequestView;

/// Separates key parts; a control character no header value may hold.
pub const SEPARATOR: char = sluice_protocol::KEY_PART_SEPARATOR;
/// Starts what sluice writes into a key itself (digests, markers); no header value holds it.
pub const MARK: char = '\u{1e}';
/// Longest key sent anywhere: a longer one is replaced by its SHA-256 digest, so no client value
/// can make a key the counter service refuses, or fill memory with long keys.
pub use sluice_protocol::MAX_KEY_BYTES;
/// Distinct values of one repeated header a key is built from (the first ones and the last).
pub const MAX_VALUES: usize = 4;
/// Most keys one rule builds for one request (repeated headers multiply them).
pub const MAX_KEYS: usize = 8;

/// The rule's keys for this request (`rule name`, then each part): one, or one per value of a
/// repeated header (the request is counted against each, so a junk first value cannot escape
/// an exhausted real one), or none when a part is missing: such a request is not counted by the
/// rule.
pub fn build(rule: &Rule, request: &mut dyn RequestView) -> Vec<String> {
    let mut keys = vec![String::with_capacity(64)];
    keys[0].push_str(&rule.name);
    for part in &rule.key {
        // The common case, one value, is appended in place: no allocation beyond the key.
        let one = |keys: &mut Vec<String>, value: &str| {
            for key in keys.iter_mut() {
                key.push(SEPARATOR);
                key.push_str(value);
            }
        };
        let values = match part {
            KeyPart::ClientIp => match request.client_ip() {
                Some(ip) => {
                    one(&mut keys, ip);
                    continue;
                }
                None => return Vec::new(),
            },
            KeyPart::Path => {
                one(&mut keys, request.normal_path());
                continue;
            }
            KeyPart::Method => {
                one(&mut keys, request.method());
                continue;
            }
            KeyPart::Const(value) => {
                one(&mut keys, value);
                continue;
            }
            KeyPart::First(alternatives) => {
                // The first alternative the request has, named so that two alternatives'
                // values never share a bucket (`jwt:sub=alice`, `client_ip=192.0.2.1`).
                let found = alternatives.iter().find_map(|alt| {
                    let values = values_of(alt, request);
                    (!values.is_empty()).then(|| (alt, values))
                });
                match found {
                    Some((alt, values)) => values
                        .into_iter()
                        .map(|v| format!("{}={v}", alt.name()))
                        .collect(),
                    None => Vec::new(),
                }
            }
            other => values_of(other, request),
        };
        match values.len() {
            0 => return Vec::new(),
            1 => one(&mut keys, &values[0]),
            n if keys.len() * n > MAX_KEYS => {
                // Only a client repeating several key headers gets here: one shared bucket for
                // all such requests of the rule.
                let mut key = rule.name.clone();
                key.push(SEPARATOR);
                key.push(MARK);
                key.push_str("many");
                return vec![key];
            }
            _ => {
                keys = keys
                    .iter()
                    .flat_map(|key| {
                        values.iter().map(move |value| {
                            let mut next = String::with_capacity(key.len() + 1 + value.len());
                            next.push_str(key);
                            next.push(SEPARATOR);
                            next.push_str(value);
                            next
                        })
                    })
                    .collect();
            }
        }
    }
    keys.into_iter()
        .map(|key| bounded(&rule.name, key))
        .collect()
}

/// The values of one (not `First`) part: distinct, empty when the request does not have it.
pub fn values_of(part: &KeyPart, request: &mut dyn RequestView) -> Vec<String> {
    match part {
        KeyPart::ClientIp => request
            .client_ip()
            .map(str::to_string)
            .into_iter()
            .collect(),
        KeyPart::ClientIpPrefix { v4, v6 } => request
            .client_ip()
            .and_then(|ip| ip.parse::<IpAddr>().ok())
            .map(|ip| prefix_of(ip, *v4, *v6))
            .into_iter()
            .collect(),
        KeyPart::Path => vec![request.normal_path().to_string()],
        KeyPart::Method => vec![request.method().to_string()],
        KeyPart::Const(value) => vec![value.clone()],
        KeyPart::Header(name) => distinct(request.header(name)),
        KeyPart::Query(name) => distinct(request.query(name)),
        KeyPart::Claim(name) => request.claim(name).into_iter().collect(),
        KeyPart::First(alternatives) => alternatives
            .iter()
            .map(|alt| values_of(alt, request))
            .find(|values| !values.is_empty())
            .unwrap_or_default(),
    }
}

/// The network of `ip` at the part's prefix length, as `network/length`.
fn prefix_of(ip: IpAddr, v4: u8, v6: u8) -> String {
    let ip = match ip {
        IpAddr::V6(v6addr) => v6addr
            .to_ipv4_mapped()
            .map_or(IpAddr::V6(v6addr), IpAddr::V4),
        v4addr => v4addr,
    };
    match ip {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let masked = if v4 == 0 {
                0
            } else {
                bits & (u32::MAX << (32 - v4 as u32))
            };
            format!("{}/{v4}", std::net::Ipv4Addr::from(masked))
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let masked = if v6 == 0 {
                0
            } else {
                bits & (u128::MAX << (128 - v6 as u32))
            };
            format!("{}/{v6}", std::net::Ipv6Addr::from(masked))
        }
    }
}

/// The values a key is built from: distinct, at most [`MAX_VALUES`] (the first ones and the
/// last: the value an upstream reads is one of those).
fn distinct(values: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(values.len().min(MAX_VALUES));
    let last = values.last().cloned();
    for value in values {
        if !out.contains(&value) {
            out.push(value);
        }
    }
    if out.len() > MAX_VALUES {
        out.truncate(MAX_VALUES - 1);
        if let Some(last) = last {
            if !out.contains(&last) {
                out.push(last);
            }
        }
    }
    out
}

/// `key`, or when longer than [`MAX_KEY_BYTES`], the rule's name and the key's SHA-256.
fn bounded(rule: &str, key: String) -> String {
    if key.len() <= MAX_KEY_BYTES {
        return key;
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut short = String::with_capacity(rule.len() + 2 + 7 + 64);
    short.push_str(rule);
    short.push(SEPARATOR);
    short.push(MARK);
    short.push_str("sha256:");
    for byte in digest {
        let _ = write!(short, "{byte:02x}");
    }
    short
}

/// A header value as a key part: itself when it is UTF-8; otherwise [`MARK`], `hex:` and its
/// bytes in hex, so that two different values never share a bucket.
pub fn header_value(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) => text.to_string(),
        Err(_) => {
            let mut out = String::with_capacity(5 + 2 * bytes.len());
            out.push(MARK);
            out.push_str("hex:");
            for byte in bytes {
                let _ = write!(out, "{byte:02x}");
            }
            out
        }
    }
}

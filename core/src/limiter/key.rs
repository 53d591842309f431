//! Building a rule's key from a request.

use std::fmt::Write;

use sha2::{Digest, Sha256};

use crate::policy::{KeyPart, Rule, WhenMissing};
use crate::request::RequestView;

/// Separates key parts; a control character no header value may hold.
pub const SEPARATOR: char = sluice_protocol::KEY_PART_SEPARATOR;
/// Distinct values of one repeated header a key is built from (the first ones and the last).
pub use crate::request::{header_value, unmarked, MARK, MAX_VALUES, MISSING};
/// Longest key sent anywhere: a longer one is replaced by its SHA-256 digest, so no client value
/// can make a key the counter service refuses, or fill memory with long keys.
pub use sluice_protocol::MAX_KEY_BYTES;
/// Most keys one rule builds for one request (repeated headers multiply them).
pub const MAX_KEYS: usize = 8;

/// The rule's keys for this request (`rule name`, then each part): one, or one per value of a
/// repeated header (the request is counted against each, so a junk first value cannot escape
/// an exhausted real one). A part the request does not have takes the value [`MISSING`]; with
/// `"when_missing": "skip"`, there are no keys: the rule does not count the request.
pub fn build(rule: &Rule, request: &mut dyn RequestView) -> Vec<String> {
    keys(rule, request).into_iter().collect()
}

/// A rule's keys for one request, as [`build`] makes them: the common case, one key, without a
/// vector around it (the limiter builds keys on every request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Keys {
    One(String),
    Many(Vec<String>),
}

impl Keys {
    pub fn len(&self) -> usize {
        match self {
            Keys::One(_) => 1,
            Keys::Many(keys) => keys.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn iter_mut(&mut self) -> std::slice::IterMut<'_, String> {
        match self {
            Keys::One(key) => std::slice::from_mut(key).iter_mut(),
            Keys::Many(keys) => keys.iter_mut(),
        }
    }

    /// The keys, in order.
    pub fn iter(&self) -> std::slice::Iter<'_, String> {
        match self {
            Keys::One(key) => std::slice::from_ref(key).iter(),
            Keys::Many(keys) => keys.iter(),
        }
    }
}

/// The keys of [`Keys`], in order.
pub enum KeysIter {
    One(std::option::IntoIter<String>),
    Many(std::vec::IntoIter<String>),
}

impl Iterator for KeysIter {
    type Item = String;

    fn next(&mut self) -> Option<String> {
        match self {
            KeysIter::One(key) => key.next(),
            KeysIter::Many(keys) => keys.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            KeysIter::One(key) => key.size_hint(),
            KeysIter::Many(keys) => keys.size_hint(),
        }
    }
}

impl IntoIterator for Keys {
    type Item = String;
    type IntoIter = KeysIter;

    fn into_iter(self) -> KeysIter {
        match self {
            Keys::One(key) => KeysIter::One(Some(key).into_iter()),
            Keys::Many(keys) => KeysIter::Many(keys.into_iter()),
        }
    }
}

/// [`build`]'s keys, the common single key without a vector.
pub fn keys(rule: &Rule, request: &mut dyn RequestView) -> Keys {
    keys_in(rule, request, String::with_capacity(64))
}

/// [`keys`], the first written into `buffer` (emptied first): a caller that keeps the buffer
/// between requests builds the common single key without an allocation.
pub fn keys_in(rule: &Rule, request: &mut dyn RequestView, buffer: String) -> Keys {
    let mut first = buffer;
    first.clear();
    first.push_str(&rule.name);
    let mut keys = Keys::One(first);
    for part in &rule.key {
        // The common case, one value, is appended in place: no allocation beyond the key.
        let one = |keys: &mut Keys, value: &str| {
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
                None => Vec::new(),
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
                    let values = alt.values(request);
                    (!values.is_empty()).then_some((alt, values))
                });
                match found {
                    Some((alt, values)) => values
                        .into_iter()
                        .map(|v| format!("{}={v}", alt.name()))
                        .collect(),
                    None => Vec::new(),
                }
            }
            other => other.values(request),
        };
        match values.len() {
            0 => match rule.when_missing {
                WhenMissing::Skip => return Keys::Many(Vec::new()),
                WhenMissing::Count => one(&mut keys, MISSING),
            },
            1 => one(&mut keys, &values[0]),
            n if keys.len() * n > MAX_KEYS => {
                // Only a client repeating several key headers gets here: one shared bucket for
                // all such requests of the rule.
                let mut key = rule.name.clone();
                key.push(SEPARATOR);
                key.push(MARK);
                key.push_str("many");
                return Keys::One(key);
            }
            _ => {
                keys = Keys::Many(
                    keys.iter()
                        .flat_map(|key| {
                            values.iter().map(move |value| {
                                let mut next = String::with_capacity(key.len() + 1 + value.len());
                                next.push_str(key);
                                next.push(SEPARATOR);
                                next.push_str(value);
                                next
                            })
                        })
                        .collect(),
                );
            }
        }
    }
    match keys {
        Keys::One(key) => Keys::One(bounded(&rule.name, key)),
        Keys::Many(keys) => Keys::Many(
            keys.into_iter()
                .map(|key| bounded(&rule.name, key))
                .collect(),
        ),
    }
}

/// `key`, or when longer than [`MAX_KEY_BYTES`], the rule's name and the key's SHA-256 (after a
/// [`MISSING`] part when the key has one, so that [`in_missing_bucket`] still tells it).
fn bounded(rule: &str, key: String) -> String {
    if key.len() <= MAX_KEY_BYTES {
        return key;
    }
    let digest = Sha256::digest(key.as_bytes());
    let mut short = String::with_capacity(rule.len() + 2 + 7 + 64 + MISSING.len() + 1);
    short.push_str(rule);
    short.push(SEPARATOR);
    if in_missing_bucket(&key) {
        short.push_str(MISSING);
        short.push(SEPARATOR);
    }
    short.push(MARK);
    short.push_str("sha256:");
    for byte in digest {
        let _ = write!(short, "{byte:02x}");
    }
    short
}

/// Whether `key` (as [`keys`] builds it) is its rule's missing bucket: one of its parts is
/// [`MISSING`], a part the request did not have. Every request without that part shares it (per
/// value of the other parts), so it never starts a penalty: one client's failures would lock out
/// every client without the part (a fresh browser has no session cookie yet). A value a client
/// sends never equals [`MISSING`] ([`unmarked`]).
pub fn in_missing_bucket(key: &str) -> bool {
    key.split(SEPARATOR).skip(1).any(|part| part == MISSING)
}

/// What the access log says of a key: the first 8 bytes of the SHA-256 of the key as the filter
/// writes it (the rule's name, [`SEPARATOR`], then each part), 16 hex digits. Never the key: a
/// key may hold a client's credential or address. An operator who knows a key finds its requests
/// by computing the same (`printf 'api\x1f203.0.113.7' | sha256sum | cut -c1-16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyDigest([u8; 8]);

impl KeyDigest {
    /// The digest of `key`.
    pub fn of(key: &str) -> KeyDigest {
        let full = Sha256::digest(key.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&full[..8]);
        KeyDigest(first)
    }

    /// The 16 lowercase hex digits.
    pub fn hex(&self) -> [u8; 16] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0u8; 16];
        for (i, byte) in self.0.iter().enumerate() {
            hex[2 * i] = DIGITS[usize::from(byte >> 4)];
            hex[2 * i + 1] = DIGITS[usize::from(byte & 0xf)];
        }
        hex
    }
}

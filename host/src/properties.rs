//! Properties (Envoy attributes) answered by `proxy_get_property`.

use std::collections::BTreeMap;

/// Property values by path. A path is a list of segments; the guest sends them joined by NUL
/// bytes, tests usually write them joined by dots (`"node.id"`).
///
/// Values are bytes as Envoy serializes them: strings raw, integers as 8-byte little-endian,
/// booleans as one byte.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Properties {
    values: BTreeMap<Vec<String>, Vec<u8>>,
}

impl Properties {
    pub fn new() -> Properties {
        Properties::default()
    }

    /// Sets a string property at a dotted path.
    pub fn with_str(mut self, path: &str, value: &str) -> Properties {
        self.insert(&dotted(path), value.as_bytes().to_vec());
        self
    }

    /// Sets an integer property at a dotted path (8 bytes, little-endian, like Envoy).
    pub fn with_int(mut self, path: &str, value: i64) -> Properties {
        self.insert(&dotted(path), value.to_le_bytes().to_vec());
        self
    }

    /// Sets raw bytes at a dotted path.
    pub fn with_bytes(mut self, path: &str, value: Vec<u8>) -> Properties {
        self.insert(&dotted(path), value);
        self
    }

    /// Sets raw bytes at an explicit path, for segments that contain dots.
    pub fn insert(&mut self, path: &[&str], value: Vec<u8>) {
        self.values
            .insert(path.iter().map(|s| s.to_string()).collect(), value);
    }

    /// The value at `path`, if set.
    pub fn get(&self, path: &[String]) -> Option<&[u8]> {
        self.values.get(path).map(Vec::as_slice)
    }

    /// Sets every entry of `over` here, replacing what is set: `over` wins, as in `over.or(self)`,
    /// without copying `self`.
    pub(crate) fn overlaid(mut self, over: &Properties) -> Properties {
        for (path, value) in &over.values {
            self.values.insert(path.clone(), value.clone());
        }
        self
    }

    /// Adds every entry of `other` that is not already set here.
    pub(crate) fn or(mut self, other: &Properties) -> Properties {
        for (path, value) in &other.values {
            self.values
                .entry(path.clone())
                .or_insert_with(|| value.clone());
        }
        self
    }
}

fn dotted(path: &str) -> Vec<&str> {
    path.split('.').collect()
}

/// Splits a guest path (segments joined by NUL bytes).
pub(crate) fn parse_path(raw: &[u8]) -> Vec<String> {
    raw.split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

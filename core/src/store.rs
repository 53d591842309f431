//! Storage as one narrow compare-and-swap step.
//!
//! A store hands over a value and its version; a pure step changes the bytes; the store writes
//! them back only if nobody else wrote in between, else the step runs again on the fresh value.
//! proxy-wasm shared data is such a store (its `cas`), and so is a plain map in tests.

use std::collections::HashMap;

/// Why a store could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreError {
    /// Every retry met a concurrent writer.
    Contended,
    /// The host refused the call.
    Unavailable,
}

/// A versioned key-value store with compare-and-swap writes.
pub trait Store {
    /// The value and its version, or `None` when the key was never written.
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    /// Writes `value` if the key's version is still `version` (0: the key did not exist).
    /// `Ok(false)` on a version mismatch.
    fn set(&mut self, key: &str, value: &[u8], version: u32) -> Result<bool, StoreError>;
}

/// How many times [`update`] retries a contended write before giving up.
pub const MAX_ATTEMPTS: u32 = 64;

/// Runs `step` on the value of `key` (empty when absent) and writes the result back atomically.
/// `step` returns its answer and whether it changed the bytes; it may run several times, so it
/// must depend on nothing but its arguments.
pub fn update<S, T>(
    store: &mut S,
    key: &str,
    mut step: impl FnMut(&mut Vec<u8>) -> (T, bool),
) -> Result<T, StoreError>
where
    S: Store + ?Sized,
{
    for _ in 0..MAX_ATTEMPTS {
        let (mut bytes, version) = store.get(key)?.unwrap_or_default();
        let (answer, changed) = step(&mut bytes);
        if !changed || store.set(key, &bytes, version)? {
            return Ok(answer);
        }
    }
    Err(StoreError::Contended)
}

/// An in-memory store with the same versioning as proxy-wasm shared data, for tests and tools.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_version: u32,
}

impl MemoryStore {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|(k, (v, _))| k.len() + v.len())
            .sum()
    }
}

impl Store for MemoryStore {
    fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.entries.get(key).cloned())
    }

    fn set(&mut self, key: &str, value: &[u8], version: u32) -> Result<bool, StoreError> {
        let current = self.entries.get(key).map_or(0, |(_, v)| *v);
        if current != version {
            return Ok(false);
        }
        self.next_version = self.next_version.wrapping_add(1).max(1);
        self.entries
            .insert(key.to_string(), (value.to_vec(), self.next_version));
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_version_is_refused() {
        let mut store = MemoryStore::default();
        assert!(store.set("k", b"a", 0).unwrap());
        let (_, version) = store.get("k").unwrap().unwrap();
        assert!(store.set("k", b"b", version).unwrap());
        assert!(!store.set("k", b"c", version).unwrap(), "version moved on");
        assert!(!store.set("k", b"c", 0).unwrap(), "0 only creates");
    }

    #[test]
    fn update_retries_on_conflict() {
        /// A store where a rival writes once between our read and our write.
        struct Rival {
            inner: MemoryStore,
            interfere: bool,
        }
        impl Store for Rival {
            fn get(&mut self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
                self.inner.get(key)
            }
            fn set(&mut self, key: &str, value: &[u8], version: u32) -> Result<bool, StoreError> {
                if std::mem::take(&mut self.interfere) {
                    let v = self.inner.get(key)?.map_or(0, |(_, v)| v);
                    self.inner.set(key, b"1", v)?;
                }
                self.inner.set(key, value, version)
            }
        }
        let mut store = Rival {
            inner: MemoryStore::default(),
            interfere: true,
        };
        let mut runs = 0;
        let answer = update(&mut store, "n", |bytes| {
            runs += 1;
            let n = std::str::from_utf8(bytes)
                .unwrap_or("0")
                .parse::<u32>()
                .unwrap_or(0);
            *bytes = (n + 1).to_string().into_bytes();
            (n + 1, true)
        })
        .unwrap();
        assert_eq!(runs, 2, "the first write lost the race");
        assert_eq!(answer, 2, "the retry saw the rival's write");
    }
}

//! What one replica of the service remembers of the live overrides between syncs
//! ([`crate::overrides`] reads and writes them in Redis).

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use sluice_protocol::{LiveOverrides, OverridesDelta};

/// Most deltas a replica keeps (to the current version, from as many versions).
pub const MAX_DELTAS: usize = 64;

/// What one replica remembers of the set: the last set it read (by version), the deltas to
/// that version it answered last (by the version they start from), the last bypass (answered
/// while Redis fails), and the version and bypass the last read found, with when (syncs within
/// `--overrides-refresh-ms` of it are answered from memory).
#[derive(Debug, Default)]
pub struct Cache {
    set: Mutex<Option<Arc<Built<LiveOverrides>>>>,
    deltas: Mutex<Vec<Arc<Built<OverridesDelta>>>>,
    bypass: AtomicBool,
    head: Mutex<Option<Head>>,
}

/// A set or a delta, built once and answered to every sync that needs it, with the size of its
/// JSON (counted once, for the metrics).
#[derive(Debug)]
pub struct Built<T> {
    pub value: T,
    pub bytes: u64,
}

impl<T: Serialize> Built<T> {
    pub fn new(value: T) -> Built<T> {
        let mut counted = Counted(0);
        let _ = serde_json::to_writer(&mut counted, &value);
        Built {
            value,
            bytes: counted.0,
        }
    }
}

impl<T> Deref for Built<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

/// A writer that only counts the bytes.
struct Counted(u64);

impl std::io::Write for Counted {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 += bytes.len() as u64;
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The version and bypass of the set as one read found them, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    pub version: u64,
    pub bypass: bool,
    /// The change log holds every change after this version.
    pub log_from: Option<u64>,
    pub at: Instant,
}

impl Cache {
    pub(crate) fn current(&self) -> Option<Arc<Built<LiveOverrides>>> {
        self.set.lock().map(|set| set.clone()).unwrap_or_default()
    }

    pub(crate) fn store(&self, set: Arc<Built<LiveOverrides>>) {
        if let Ok(mut current) = self.set.lock() {
            *current = Some(set);
        }
    }

    /// The delta from `from` to `to`, if this replica built it.
    pub(crate) fn delta(&self, from: u64, to: u64) -> Option<Arc<Built<OverridesDelta>>> {
        let deltas = self.deltas.lock().ok()?;
        deltas
            .iter()
            .find(|delta| delta.from == from && delta.version == to)
            .cloned()
    }

    /// Keeps a delta: those to another version are dropped, and the oldest beyond
    /// [`MAX_DELTAS`].
    pub(crate) fn store_delta(&self, delta: Arc<Built<OverridesDelta>>) {
        if let Ok(mut deltas) = self.deltas.lock() {
            deltas.retain(|kept| kept.version == delta.version && kept.from != delta.from);
            if deltas.len() >= MAX_DELTAS {
                deltas.remove(0);
            }
            deltas.push(delta);
        }
    }

    pub(crate) fn set_bypass(&self, bypass: bool) {
        self.bypass.store(bypass, Ordering::Relaxed);
    }

    /// What the last read found, if it is younger than `within`.
    pub(crate) fn fresh_head(&self, within: Duration, now: Instant) -> Option<Head> {
        let head = self.head.lock().ok().and_then(|head| *head)?;
        (now.saturating_duration_since(head.at) < within).then_some(head)
    }

    pub(crate) fn set_head(&self, version: u64, bypass: bool, log_from: Option<u64>, at: Instant) {
        if let Ok(mut head) = self.head.lock() {
            *head = Some(Head {
                version,
                bypass,
                log_from,
                at,
            });
        }
    }

    /// The next sync reads again (this replica changed the set).
    pub(crate) fn forget_head(&self) {
        if let Ok(mut head) = self.head.lock() {
            *head = None;
        }
    }

    /// The bypass the last successful read answered (false before any).
    pub fn last_bypass(&self) -> bool {
        self.bypass.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(from: u64, version: u64) -> Arc<Built<OverridesDelta>> {
        Arc::new(Built::new(OverridesDelta {
            from,
            version,
            ..OverridesDelta::default()
        }))
    }

    #[test]
    fn deltas_are_kept_for_the_latest_version_only_and_bounded() {
        let cache = Cache::default();
        cache.store_delta(delta(1, 5));
        cache.store_delta(delta(2, 5));
        assert_eq!(cache.delta(1, 5).unwrap().from, 1);
        assert!(cache.delta(1, 6).is_none());
        cache.store_delta(delta(4, 6));
        assert!(cache.delta(1, 5).is_none(), "dropped: another version");
        for from in 0..100 {
            cache.store_delta(delta(from, 6));
        }
        assert_eq!(cache.deltas.lock().unwrap().len(), MAX_DELTAS);
        assert!(cache.delta(99, 6).is_some());
        assert!(cache.delta(0, 6).is_none());
        // its size is its JSON's
        let built = delta(1, 2);
        assert_eq!(built.bytes, br#"{"from":1,"version":2}"#.len() as u64);
    }
}

//! What one replica of the service remembers of the live overrides between syncs
//! ([`crate::overrides`] reads and writes them in Redis).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_protocol::LiveOverrides;

/// What one replica remembers of the set: the last set it read (by version), the last
/// bypass (answered while Redis fails), and the version and bypass the last read found, with
/// when (syncs within `--overrides-refresh-ms` of it are answered from memory).
#[derive(Debug, Default)]
pub struct Cache {
    set: Mutex<Option<Arc<LiveOverrides>>>,
    bypass: AtomicBool,
    head: Mutex<Option<Head>>,
}

/// The version and bypass of the set as one read found them, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    pub version: u64,
    pub bypass: bool,
    pub at: Instant,
}

impl Cache {
    pub(crate) fn current(&self) -> Option<Arc<LiveOverrides>> {
        self.set.lock().map(|set| set.clone()).unwrap_or_default()
    }

    pub(crate) fn store(&self, set: Arc<LiveOverrides>) {
        if let Ok(mut current) = self.set.lock() {
            *current = Some(set);
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

    pub(crate) fn set_head(&self, version: u64, bypass: bool, at: Instant) {
        if let Ok(mut head) = self.head.lock() {
            *head = Some(Head {
                version,
                bypass,
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
